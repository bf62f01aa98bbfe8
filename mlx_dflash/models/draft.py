"""DFlash v1 draft (z-lab checkpoints), docs/math.md §4.

The draft has no embedding and no lm_head: it borrows the target's (``bind``).
Its cache holds context K/V only (after k_norm and RoPE); the block's K/V are
transient. Context rows can be windowed to ``sink`` first + ``recent`` last
positions so long generations stay cheap; RoPE is applied before caching, so
dropping rows never changes the positions of the rows kept.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """z-lab's spread of capture layers: round(1 + i*(n-4)/(N-1))."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    vocab_size: Optional[int] = None
    attention_bias: bool = False
    block_size: int = 16
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[List[int]] = None
    num_target_layers: Optional[int] = None
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    # Sliding layers: context limited to the last window-1 positions before the
    # anchor; inside the block causal (True, z-lab's default) or bidirectional.
    sliding_block_causal: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        dc = d.get("dflash_config") or {}
        n = d["num_hidden_layers"]
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        n_target = d.get("num_target_layers")
        if ids is None and n_target is not None:
            ids = default_target_layer_ids(n_target, n)
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            intermediate_size=d["intermediate_size"],
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1000000.0)),
            rope_scaling=d.get("rope_scaling") or _rope_scaling(d.get("rope_parameters")),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            vocab_size=d.get("vocab_size"),
            attention_bias=d.get("attention_bias", False),
            block_size=dc.get("block_size", d.get("block_size", 16)),
            mask_token_id=dc.get("mask_token_id", d.get("mask_token_id")),
            target_layer_ids=list(ids) if ids is not None else None,
            num_target_layers=n_target,
            layer_types=d.get("layer_types"),
            sliding_window=d.get("sliding_window"),
            sliding_block_causal=d.get("sliding_block_causal", True),
        )

    def is_sliding(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"


def _rope_scaling(params: Optional[dict]) -> Optional[dict]:
    """Scaling from a transformers-v5 ``rope_parameters`` dict (None: plain RoPE)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    return None if kind == "default" else dict(params, type=kind)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.scale = D**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            D, base=cfg.rope_theta, traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def kv(self, x: mx.array, offset: int) -> Tuple[mx.array, mx.array]:
        """K (normed, RoPE from ``offset``) and V for rows x [1, S, H]."""
        S = x.shape[1]
        k = self.k_norm(self.k_proj(x).reshape(1, S, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(1, S, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


@dataclass
class DraftCache:
    """Context K/V per layer ([1, Hkv, L, D]) and the absolute positions held."""

    keys: List[Optional[mx.array]]
    values: List[Optional[mx.array]]
    positions: List[int] = field(default_factory=list)
    length: int = 0  # context positions consumed so far (0..length-1)
    window: Optional[Tuple[int, int]] = None  # (sink, recent) or None = keep all

    def skip(self, rows: int) -> int:
        """Of ``rows`` context rows about to arrive, consume (uncomputed) the
        leading ones the window would drop on arrival; returns how many."""
        if self.window is None or len(self.positions) < self.window[0]:
            return 0
        n = max(rows - self.window[1], 0)
        self.length += n
        return n

    def trim(self) -> None:
        if self.window is None:
            return
        sink, recent = self.window
        n = len(self.positions)
        if n <= sink + recent:
            return
        keep = list(range(sink)) + list(range(n - recent, n))
        idx = mx.array(keep)
        self.keys = [k[:, :, idx] for k in self.keys]
        self.values = [v[:, :, idx] for v in self.values]
        self.positions = [self.positions[i] for i in keep]


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        n_feat = len(cfg.target_layer_ids or [0] * cfg.num_hidden_layers)
        self.fc = nn.Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def bind(self, target) -> "DFlashDraft":
        """Borrow the target's embedding and lm_head (kept out of the parameter tree)."""
        object.__setattr__(self, "_bound_target", target)
        return self

    @property
    def target(self):
        t = getattr(self, "_bound_target", None)
        if t is None:
            raise RuntimeError("draft is not bound to a target (call bind)")
        return t

    @property
    def target_layer_ids(self) -> List[int]:
        return list(self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def make_cache(self, window: Optional[Tuple[int, int]] = None) -> DraftCache:
        """``window`` (sink, recent) bounds the context rows kept. Default: when
        every layer slides over W positions, only the last W-1 rows (all any
        layer can see), so long generations cost what short ones do."""
        n = len(self.layers)
        cfg = self.config
        if window is None and cfg.sliding_window and all(cfg.is_sliding(i) for i in range(n)):
            window = (0, cfg.sliding_window - 1)
        return DraftCache([None] * n, [None] * n, window=window)

    def _mask(self, i: int, cache: DraftCache, anchor_pos: int, B: int):
        """Boolean [B, L_ctx + B] for sliding layers; None (attend all) otherwise."""
        cfg = self.config
        if not cfg.is_sliding(i) or cfg.sliding_window is None:
            return None
        first = anchor_pos - (cfg.sliding_window - 1)
        if not cfg.sliding_block_causal and (not cache.positions or cache.positions[0] >= first):
            return None  # every cached row is in the window (a trimmed cache)
        pos = mx.array(cache.positions) if cache.positions else mx.zeros((0,), mx.int32)
        ctx_ok = pos >= first
        ctx_ok = mx.broadcast_to(ctx_ok[None], (B, pos.shape[0]))
        if cfg.sliding_block_causal:
            blk = mx.tril(mx.ones((B, B), dtype=mx.bool_))
        else:
            blk = mx.ones((B, B), dtype=mx.bool_)
        return mx.concatenate([ctx_ok, blk], axis=1)

    def __call__(
        self,
        features: Optional[mx.array],
        anchor: int,
        anchor_pos: int,
        block_size: int,
        cache: DraftCache,
    ) -> mx.array:
        """Draft logits [block_size - 1, V] for slots 1..B-1 of [anchor, MASK x (B-1)].

        ``features`` [S, N*H_target]: captured target features of the context
        positions cache.length .. anchor_pos - 1 not yet in the cache (or None).
        """
        cfg = self.config
        B = block_size
        if features is not None and features.shape[0] > 0:
            S = features.shape[0]
            if cache.length + S != anchor_pos:
                raise ValueError(
                    f"draft context out of step: cache holds {cache.length} positions, "
                    f"{S} new rows, anchor at {anchor_pos}"
                )
            ctx = self.hidden_norm(self.fc(features[None]))
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.kv(ctx, cache.length)
                if cache.keys[i] is None:
                    cache.keys[i], cache.values[i] = k, v
                else:
                    cache.keys[i] = mx.concatenate([cache.keys[i], k], axis=2)
                    cache.values[i] = mx.concatenate([cache.values[i], v], axis=2)
            cache.positions.extend(range(cache.length, cache.length + S))
            cache.length += S
            cache.trim()
        elif cache.length != anchor_pos:
            raise ValueError(f"draft context missing: holds {cache.length}, anchor at {anchor_pos}")

        ids = mx.array([anchor] + [cfg.mask_token_id] * (B - 1))
        h = self.target.embed(ids)[None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).reshape(1, B, attn.n_heads, -1)).transpose(0, 2, 1, 3)
            q = attn.rope(q, offset=anchor_pos)
            kb, vb = attn.kv(x, anchor_pos)
            if cache.keys[i] is not None:
                keys = mx.concatenate([cache.keys[i], kb], axis=2)
                values = mx.concatenate([cache.values[i], vb], axis=2)
            else:
                keys, values = kb, vb
            mask = self._mask(i, cache, anchor_pos, B)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
            h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.target.lm_head(self.norm(h[:, 1:]))[0]


# --- training forward -----------------------------------------------------------

def _rope_at(rope, x: mx.array, positions: mx.array) -> mx.array:
    """The layer's RoPE module (scaling included, as at inference) at explicit
    positions: x [Bt, nh, S, D]; positions [Bt, S]. Tokens go in as the batch,
    each with its own offset."""
    Bt, nh, S, D = x.shape
    xt = x.transpose(0, 2, 1, 3).reshape(Bt * S, nh, 1, D)
    out = rope(xt, offset=positions.reshape(-1).astype(mx.int32))
    return out.reshape(Bt, S, nh, D).transpose(0, 2, 1, 3)


def training_mask(anchors: mx.array, L: int, B: int, sliding_window: Optional[int] = None,
                  block_causal: bool = True) -> mx.array:
    """Boolean [Bt, m*B, L + m*B]: block j (anchor a_j) sees context positions
    p < a_j (p >= a_j - (W-1) for a sliding layer) and its own block slots
    (causally for a sliding layer with ``block_causal``); never another block."""
    Bt, m = anchors.shape
    a_row = mx.repeat(anchors, B, axis=1)  # [Bt, mB] anchor of each query row
    ctx_pos = mx.arange(L)
    ctx_ok = ctx_pos[None, None, :] < a_row[:, :, None]
    if sliding_window is not None:
        ctx_ok = ctx_ok & (ctx_pos[None, None, :] >= a_row[:, :, None] - (sliding_window - 1))
    blk = mx.arange(m * B) // B
    slot = mx.arange(m * B) % B
    same = blk[:, None] == blk[None, :]
    if sliding_window is not None and block_causal:
        same = same & (slot[None, :] <= slot[:, None])
    same = mx.broadcast_to(same[None], (Bt, m * B, m * B))
    return mx.concatenate([ctx_ok, same], axis=-1)


def train_logits(draft: "DFlashDraft", features: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """Logits [Bt, m, B-1, V] for m blocks per sequence in one forward.

    features [Bt, L, N*H] (target features at every position), tokens [Bt, L],
    anchors [Bt, m] (1 <= a <= L - B). Block j is [tokens[a_j], MASK x (B-1)]
    at positions a_j..a_j+B-1; it attends to the context before its anchor and
    to itself, exactly as one inference cycle with the context cached.
    """
    cfg = draft.config
    Bt, L, _ = features.shape
    m = anchors.shape[1]
    B = cfg.block_size
    ctx = draft.hidden_norm(draft.fc(features))  # [Bt, L, H]
    first = mx.take_along_axis(tokens, anchors, axis=1)  # [Bt, m]
    ids = mx.concatenate([first[..., None], mx.full((Bt, m, B - 1), cfg.mask_token_id, dtype=tokens.dtype)], -1)
    h = draft.target.embed(ids.reshape(Bt, m * B))
    q_pos = (anchors[..., None] + mx.arange(B)).reshape(Bt, m * B)
    c_pos = mx.broadcast_to(mx.arange(L)[None], (Bt, L))
    masks = {}
    for i, layer in enumerate(draft.layers):
        at = layer.self_attn
        sl = cfg.sliding_window if cfg.is_sliding(i) else None
        if sl not in masks:
            masks[sl] = training_mask(anchors, L, B, sl, cfg.sliding_block_causal)[:, None]
        x = layer.input_layernorm(h)
        nh, nkv = at.n_heads, at.n_kv
        q = at.q_norm(at.q_proj(x).reshape(Bt, m * B, nh, -1)).transpose(0, 2, 1, 3)
        q = _rope_at(at.rope, q, q_pos)

        def kv(rows, pos):
            S = rows.shape[1]
            k = at.k_norm(at.k_proj(rows).reshape(Bt, S, nkv, -1)).transpose(0, 2, 1, 3)
            v = at.v_proj(rows).reshape(Bt, S, nkv, -1).transpose(0, 2, 1, 3)
            return _rope_at(at.rope, k, pos), v

        kc, vc = kv(ctx, c_pos)
        kb, vb = kv(x, q_pos)
        keys = mx.concatenate([kc, kb], axis=2)
        values = mx.concatenate([vc, vb], axis=2)
        if nh != nkv:
            keys = mx.repeat(keys, nh // nkv, axis=1)
            values = mx.repeat(values, nh // nkv, axis=1)
        scores = (q * at.scale) @ keys.swapaxes(-1, -2)
        scores = mx.where(masks[sl], scores, -1e9)
        out = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype) @ values
        h = h + at.o_proj(out.transpose(0, 2, 1, 3).reshape(Bt, m * B, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = draft.target.lm_head(draft.norm(h)).reshape(Bt, m, B, -1)
    return logits[:, :, 1:]
