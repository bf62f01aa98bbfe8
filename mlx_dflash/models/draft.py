"""DFlash drafts (z-lab checkpoints): v1 (docs/math.md §4) and DFlash 2.

The draft has no embedding and no lm_head: it borrows the target's (``bind``).
DFlash 2 adds, per layer, a grouped dynamic convolution along the block
around the attention and the MLP sublayer, and a candidate selector that
re-ranks the head's top-K per slot with transition scores from the
previous slot's token (docs/dflash2.md).
Its cache holds context K/V only (after k_norm and RoPE); the block's K/V are
transient. Context rows can be windowed to ``sink`` first + ``recent`` last
positions so long generations stay cheap; RoPE is applied before caching, so
dropping rows never changes the positions of the rows kept.
"""

import bisect
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..cache import LayerCache, Rows, State
from ..errors import is_count
from ..kernels.fused_exp import attention, fused_exp_for, silu_fused
from .qwen35 import array_offset_rope


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """z-lab's spread of capture layers: round(1 + i*(n-4)/(N-1))."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


V2_FIELDS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


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
    # DFlash 2 ("DFlash2DraftModel"): convolutions and candidate selector;
    # None = missing from the config (an error for a DFlash 2 draft).
    architecture: str = "DFlashDraftModel"
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    # Applied to the draft's logits (and to the target embedding it reads).
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0

    @property
    def is_v2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    @property
    def kind(self) -> str:
        return "DFlash 2" if self.is_v2 else "DFlash v1"

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        """The config of a draft's config.json dict; KeyError for a missing
        field, ValueError naming a field of the wrong kind."""
        if not isinstance(d, dict):
            raise ValueError(f"the config is a {type(d).__name__}, not a JSON object")
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ValueError(f"dflash_config must be an object, got {type(dc).__name__}")
        counts = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
        for k, v in [(k, d[k]) for k in counts if k in d] + [(k, d[k]) for k in ("head_dim", "vocab_size") if d.get(k)]:
            if not is_count(v):
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        for k in ("block_size", "mask_token_id", "num_target_layers"):
            v = dc.get(k, d.get(k))
            if v is not None and not is_count(v, 0 if k == "mask_token_id" else 1):
                raise ValueError(
                    f"{k} must be a {'non-negative' if k == 'mask_token_id' else 'positive'} integer, got {v!r}"
                )
        ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is not None and not (isinstance(ids, list) and all(is_count(i, 0) for i in ids)):
            raise ValueError(f"target_layer_ids must be a list of layer numbers, got {ids!r}")
        n = d["num_hidden_layers"]
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        n_target = d.get("num_target_layers")
        if ids is None and n_target is not None:
            ids = default_target_layer_ids(n_target, n)
        _check_values(d, dc, n)
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
            architecture="DFlash2DraftModel"
            if "DFlash2DraftModel" in (d.get("architectures") or [])
            else "DFlashDraftModel",
            **{k: (int(dc[k]) if k in dc else d.get(k)) for k in V2_FIELDS},
            output_multiplier=float(dc.get("output_multiplier", d.get("output_multiplier", 1.0))),
            final_logit_softcapping=dc.get("final_logit_softcapping", d.get("final_logit_softcapping")),
            input_embedding_scale=float(dc.get("input_embedding_scale", d.get("input_embedding_scale", 1.0))),
        )

    def is_sliding(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"


def _check_values(d: dict, dc: dict, n_layers: int) -> None:
    """The draft config's other values, as the forward uses them (a string
    here was a TypeError in the first drafted cycle, mid-generation)."""

    def positive(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

    theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1.0))
    for name, v in (("rms_norm_eps", d.get("rms_norm_eps", 1e-6)), ("rope_theta", theta)):
        if not positive(v):
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    cap = dc.get("final_logit_softcapping", d.get("final_logit_softcapping"))
    if cap is not None and not positive(cap):
        raise ValueError(f"final_logit_softcapping must be a positive number or null, got {cap!r}")
    for name in ("sliding_window", "max_position_embeddings"):
        v = d.get(name)
        if v is not None and not is_count(v, 1):
            raise ValueError(
                f"{name} must be a positive integer{' or null' if name == 'sliding_window' else ''}, got {v!r}"
            )
    kinds = d.get("layer_types")
    if kinds is not None and (
        not isinstance(kinds, list)
        or len(kinds) != n_layers
        or any(k not in ("full_attention", "sliding_attention") for k in kinds)
    ):
        raise ValueError(
            f"layer_types must list 'full_attention' or 'sliding_attention' for each of the {n_layers} layers, "
            f"got {kinds!r}"
        )


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
            D,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def _rope(self, x: mx.array, pos) -> mx.array:
        """RoPE of x [Bt, heads, S, D] at positions pos, pos + 1, .. (``pos`` an
        int or a scalar array) or at explicit positions ``pos`` [Bt, S]."""
        if isinstance(pos, mx.array) and pos.ndim > 0:
            Bt, nh, S, D = x.shape  # tokens as the batch, each with its own offset
            xt = x.transpose(0, 2, 1, 3).reshape(Bt * S, nh, 1, D)
            out = self.rope(xt, offset=pos.reshape(-1).astype(mx.int32))
            return out.reshape(Bt, S, nh, D).transpose(0, 2, 1, 3)
        return self.rope(x, offset=pos)

    def kv(self, x: mx.array, pos) -> Tuple[mx.array, mx.array]:
        """K (normed, RoPE at ``pos``) and V [Bt, Hkv, S, D] for rows x [Bt, S, H]."""
        Bt, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(Bt, S, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(Bt, S, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self._rope(k, pos), v

    def project(self, x: mx.array, pos) -> Tuple[mx.array, mx.array, mx.array]:
        """q, k, v [Bt, heads, S, D] of rows x [Bt, S, H]: normed, RoPE at ``pos``."""
        Bt, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(Bt, S, self.n_heads, -1)).transpose(0, 2, 1, 3)
        return (self._rope(q, pos),) + self.kv(x, pos)

    def output(self, out: mx.array) -> mx.array:
        """The output projection of attention rows out [Bt, heads, S, D]: [Bt, S, H]."""
        Bt, _, S, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(Bt, S, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x, fused_exp: bool = False):
        gate = self.gate_proj(x)
        gate = silu_fused(gate) if fused_exp else nn.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    # A layer is two steps around the attend over context and block K/V
    # (which the caller does: a cache at inference, whole sequences in
    # training). Block rows h [Bt, ..., B, H]; the attention sees them as
    # [Bt, S, H].

    def pre(self, h: mx.array, pos) -> tuple:
        """q, k, v of the block rows (RoPE at ``pos``), then what ``post`` needs."""
        return self.self_attn.project(_rows(self.input_layernorm(h)), pos)

    def post(self, h: mx.array, out: mx.array, fused_exp: bool = False) -> mx.array:
        """Residual of the attention rows out [Bt, heads, S, D], then the MLP
        sublayer; ``fused_exp``: its SiLU by fused_exp.silu_fused (proposals on a CPU)."""
        h = h + self.self_attn.output(out).reshape(h.shape)
        return h + self.mlp(self.post_attention_layernorm(h), fused_exp)


def _rows(x: mx.array) -> mx.array:
    """[Bt, ..., H] -> [Bt, S, H]."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


class BlockConv(nn.Module):
    """DFlash 2 grouped dynamic causal convolution along the block.

    ``base_kernel`` [2 sides, taps, H]: side 0 filters a sublayer's input,
    side 1 its output. The per-row correction comes from one projection of
    the sublayer's (normed) input, one coefficient per tap and group of
    ``group_size`` channels. Tap o reads the row o places earlier in the
    same block (zero before the anchor).
    """

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group_size), bias=False)

    def coefficients(self, x: mx.array) -> mx.array:
        """[..., B, H] -> [..., B, 2, taps, groups]."""
        return self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.taps, -1)

    def __call__(self, x: mx.array, coeff: mx.array, side: int) -> mx.array:
        B = x.shape[-2]
        out = None
        for o in range(min(self.taps, B)):
            xs = x
            if o:
                pad = mx.zeros((*x.shape[:-2], o, x.shape[-1]), x.dtype)
                xs = mx.concatenate([pad, x[..., : B - o, :]], axis=-2)
            k = self.base_kernel[side, o].astype(x.dtype) + mx.repeat(coeff[..., side, o, :], self.group_size, axis=-1)
            out = k * xs if out is None else out + k * xs
        return out

    def set_identity(self) -> None:
        """Tap 0 = 1, other taps and the projection 0: the layer starts as v1's."""
        self.base_kernel = mx.zeros_like(self.base_kernel).at[:, 0].add(1.0)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)


class Draft2Layer(DraftLayer):
    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        self.attention_conv = BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    # Each sublayer f becomes h + conv(f(conv(norm(h), c, 0)), c, 1), with
    # c = conv.coefficients(norm(h)); the attention's c is carried to post.

    def pre(self, h: mx.array, pos) -> tuple:
        x = self.input_layernorm(h)
        c = self.attention_conv.coefficients(x)
        return self.self_attn.project(_rows(self.attention_conv(x, c, 0)), pos) + (c,)

    def post(self, h: mx.array, out: mx.array, c: mx.array, fused_exp: bool = False) -> mx.array:
        h = h + self.attention_conv(self.self_attn.output(out).reshape(h.shape), c, 1)
        x = self.post_attention_layernorm(h)
        c = self.mlp_conv.coefficients(x)
        return h + self.mlp_conv(self.mlp(self.mlp_conv(x, c, 0), fused_exp), c, 1)


class CandidateSelector(nn.Module):
    """DFlash 2 selector: per slot the head's top-K candidates, scored
    ``unary(c) + <A[prev] * P(h_slot), B[c]>`` given the previous slot's
    token (the anchor for slot 1). Tables keep the published names."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.zeros((vocab, rank))
        self.successor_codebook = mx.zeros((vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def candidates(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        """Top-K ids [..., K] (best first) and their fp32 logits."""
        K = min(self.top_k, logits.shape[-1])
        part = mx.stop_gradient(mx.argpartition(-logits, K - 1, axis=-1)[..., :K])
        vals = mx.take_along_axis(logits, part, axis=-1)
        order = mx.stop_gradient(mx.argsort(-vals, axis=-1))
        return mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(vals, order, axis=-1).astype(mx.float32)

    def scores(self, prev: mx.array, proj: mx.array, cand: mx.array, unary: mx.array) -> mx.array:
        """prev [...], proj [..., r], cand/unary [..., K] -> transition scores [..., K]."""
        a = self.predecessor_codebook[prev] * proj
        edges = (self.successor_codebook[cand] @ a[..., None])[..., 0]
        return unary + edges.astype(mx.float32)

    def lattice(self, hidden: mx.array, logits: mx.array, anchor):
        """The candidate lattice of slots 1..S: candidates [S, K], slot 1's
        scores from the anchor [K], and every later slot's transition scores
        [S-1, K (previous candidate), K]. hidden [S, H], logits [S, V]."""
        cand, unary = self.candidates(logits)
        proj = self.hidden_projection(hidden)  # [S, r]
        succ = self.successor_codebook[cand]  # [S, K, r]
        anchor = anchor.reshape(()) if isinstance(anchor, mx.array) else mx.array(anchor)
        first = self.scores(anchor, proj[0], cand[0], unary[0])
        pred = self.predecessor_codebook[cand[:-1]] * proj[1:, None]  # [S-1, K, r]
        trans = unary[1:, None] + (pred @ succ[1:].swapaxes(-1, -2)).astype(mx.float32)
        return cand, first, trans

    def walk(self, hidden: mx.array, logits: mx.array, anchor, choose):
        """Walk the lattice from the anchor; ``choose(scores [K], slot) -> index``
        picks each step. Returns (tokens [S], candidates [S, K], the scores
        each step chose from [S, K])."""
        cand, row, trans = self.lattice(hidden, logits, anchor)
        idx, rows = [], []
        for i in range(cand.shape[0]):
            if i:
                row = trans[i - 1][idx[-1]]
            j = choose(row, i)
            idx.append(j if isinstance(j, mx.array) else mx.array(j))
            rows.append(row)
        picks = mx.stack(idx).reshape(-1, 1)
        return mx.take_along_axis(cand, picks, axis=-1)[:, 0].astype(mx.int32), cand, mx.stack(rows)


class DraftCache(LayerCache):
    """Context K/V per layer ([B, Hkv, L, D]) and the absolute positions held.

    ``keys`` / ``values`` are the rows held, one array per layer. They live in
    buffers grown in steps (:class:`~mlx_dflash.cache.Rows`): new context rows
    and each cycle's block rows are written in place after the held ones, so a
    cycle copies O(new rows), not the whole context (a windowed cache is
    trimmed to its window by a gather instead).

    As a :class:`~mlx_dflash.cache.LayerCache`: unwindowed, row i is position
    i and the cache is a sequence cache (its rows can be shared between
    snapshots); windowed, its state is the window's rows and their positions,
    taken whole. The block rows are scratch: no rollback applies.
    """

    def __init__(self, keys, values, positions=None, length: int = 0, window: Optional[Tuple[int, int]] = None):
        self._rows: List[Rows] = []
        for k, v in zip(keys, values):
            r = Rows(2)
            r.bufs = [k, v]
            self._rows.append(r)
        self.positions: List[int] = list(positions or [])
        self.length = length  # context positions consumed so far (0..length-1)
        self.window = window  # (sink, recent) or None = keep all

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def sequence(self) -> bool:
        return self.window is None

    @property
    def keys(self) -> List[Optional[mx.array]]:
        return [r.held(self.rows)[0] if r.bufs[0] is not None else None for r in self._rows]

    @property
    def values(self) -> List[Optional[mx.array]]:
        return [r.held(self.rows)[1] if r.bufs[1] is not None else None for r in self._rows]

    def write(self, i: int, start: int, k: mx.array, v: mx.array) -> Tuple[mx.array, mx.array]:
        """Write rows k, v [B, Hkv, S, D] of layer i at ``start`` (growing the
        buffers in steps); returns the layer's rows [0, start + S)."""
        keys, values = self._rows[i].write(start, [k, v])
        return keys, values

    def dropped(self, rows: int) -> int:
        """Of ``rows`` context rows about to arrive, the leading ones the
        window would drop on arrival."""
        if self.window is None or len(self.positions) < self.window[0]:
            return 0
        return max(rows - self.window[1], 0)

    def skip(self, rows: int) -> int:
        """Consume (uncomputed) the :meth:`dropped` ones of ``rows`` arriving
        context rows; returns how many."""
        n = self.dropped(rows)
        self.length += n
        return n

    def advance(self, n: int) -> None:
        """Hold the ``n`` context rows just written after the held ones (the
        next positions), then trim to the window."""
        self.positions.extend(range(self.length, self.length + n))
        self.length += n
        self.trim()

    def trim(self) -> None:
        if self.window is None:
            return
        sink, recent = self.window
        n = len(self.positions)
        if n <= sink + recent:
            return
        keep = list(range(sink)) + list(range(n - recent, n))
        for r in self._rows:  # gathered to the front of the same buffers
            r.gather(0, keep)
        self.positions = [self.positions[i] for i in keep]

    def fork(self) -> "DraftCache":
        """A cache holding the same rows that later writes to either leave
        the other unchanged."""
        return DraftCache(self.keys, self.values, self.positions, self.length, self.window)

    # --- the LayerCache protocol ---------------------------------------------
    def layout(self) -> dict:
        return {"type": "draft", "layers": len(self._rows), "window": list(self.window) if self.window else None}

    def truncate(self, n: int) -> None:
        if not self.sequence:
            raise ValueError("a windowed draft context cannot be truncated")
        self.positions = self.positions[:n]
        self.length = min(self.length, n)

    def state(self) -> List[mx.array]:
        return [a for r in self._rows for a in r.held(self.rows)]

    def snapshot_state(self, a: int = 0, b: Optional[int] = None) -> State:
        """Unwindowed: rows [a, b), two arrays per layer. Windowed: the whole
        state (rows held, then their positions as an int32 array)."""
        if self.sequence:
            b = self.rows if b is None else b
            if not 0 <= a <= b <= self.rows:
                raise ValueError(f"rows [{a}, {b}) outside the {self.rows} held")
            return [x for r in self._rows for x in r.copy(a, b)], {**self.layout(), "rows": b - a}
        arrays = [x for r in self._rows for x in r.copy(0, self.rows)]
        return arrays + [mx.array(self.positions, dtype=mx.int32)], {**self.layout(), "length": self.length}

    def restore_state(self, pieces: Sequence[State]) -> None:
        self._check(pieces)
        n = len(self._rows)
        if self.sequence:
            for i, r in enumerate(self._rows):
                r.load([arrays[2 * i : 2 * i + 2] for arrays, _ in pieces])
            rows = sum(meta["rows"] for _, meta in pieces)
            self.positions, self.length = list(range(rows)), rows
            return
        if len(pieces) != 1:
            raise ValueError("a windowed draft context is restored from one piece")
        arrays, meta = pieces[0]
        for i, r in enumerate(self._rows):
            r.load([arrays[2 * i : 2 * i + 2]])
        self.positions, self.length = arrays[2 * n].tolist(), int(meta["length"])


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.compiled = True  # decode-time block forwards as compiled steps (see _step); False: plain ops
        n_feat = len(cfg.target_layer_ids or [0] * cfg.num_hidden_layers)
        self.fc = nn.Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        layer = Draft2Layer if cfg.is_v2 else DraftLayer
        self.layers = [layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.is_v2:
            self.candidate_selector = CandidateSelector(
                cfg.vocab_size, cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k
            )

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

    def _window(self, i: int, cache: DraftCache, anchor_pos: int, B: int, keys: mx.array, values: mx.array):
        """The keys, values [.., L_ctx + B, D] and mask (bool [B, rows], or
        None: attend all) layer i attends with. A sliding layer gets only the
        context rows in its window (held positions ascend, so they are a
        suffix): its cost is bounded by the window, not the context."""
        cfg = self.config
        if not cfg.is_sliding(i) or cfg.sliding_window is None:
            return keys, values, None
        s = bisect.bisect_left(cache.positions, anchor_pos - (cfg.sliding_window - 1))
        if s:
            keys, values = keys[:, :, s:], values[:, :, s:]
        if not cfg.sliding_block_causal:
            return keys, values, None
        blk = mx.tril(mx.ones((B, B), dtype=mx.bool_))
        return keys, values, mx.concatenate([mx.ones((B, cache.rows - s), dtype=mx.bool_), blk], axis=1)

    def add_context(self, features: mx.array, cache: DraftCache) -> None:
        """Append context rows for target features [S, N*H] of positions
        cache.length .. cache.length + S - 1 (new arrays: earlier ones are kept intact)."""
        S = features.shape[0]
        ctx = self.hidden_norm(self.fc(features[None]))
        start = cache.rows
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cache.length)
            cache.write(i, start, k, v)
        cache.advance(S)

    def _extend_context(self, features: Optional[mx.array], anchor_pos: int, cache: DraftCache) -> None:
        if self._new_rows(features, anchor_pos, cache):
            self.add_context(features, cache)

    @staticmethod
    def _new_rows(features: Optional[mx.array], anchor_pos: int, cache: DraftCache) -> bool:
        """Whether ``features`` brings context rows, checked to end where the block starts."""
        if features is not None and features.shape[0] > 0:
            S = features.shape[0]
            if cache.length + S != anchor_pos:
                raise ValueError(
                    f"draft context out of step: cache holds {cache.length} positions, "
                    f"{S} new rows, anchor at {anchor_pos}"
                )
            return True
        if cache.length != anchor_pos:
            raise ValueError(f"draft context missing: holds {cache.length}, anchor at {anchor_pos}")
        return False

    def _extend_contexts(self, slots: Sequence[tuple]) -> None:
        """:meth:`_extend_context` for several requests' caches, ``slots`` =
        [(features, anchor_pos, cache)]: the new rows of all of them projected
        in one pass (each row RoPE'd at its own position), then written to
        each cache (what each gets alone)."""
        new = [(f, c) for f, p, c in slots if self._new_rows(f, p, c)]
        if len(new) < 2 or not all(array_offset_rope(layer.self_attn.rope) for layer in self.layers):
            for f, c in new:
                self.add_context(f, c)
            return
        ctx = self.hidden_norm(self.fc(mx.concatenate([f for f, _ in new], axis=0)[None]))
        pos = mx.array([[p for f, c in new for p in range(c.length, c.length + f.shape[0])]], dtype=mx.int32)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, pos)
            o = 0
            for f, c in new:
                n = f.shape[0]
                c.write(i, c.rows, k[:, :, o : o + n], v[:, :, o : o + n])
                o += n
        for f, c in new:
            c.advance(f.shape[0])

    def embed(self, ids: mx.array) -> mx.array:
        h = self.target.embed(ids)
        s = self.config.input_embedding_scale
        return h if s == 1.0 else h * s

    def restrict_vocab(self, ids: Optional[Sequence[int]]) -> "DFlashDraft":
        """Propose only among the token ids ``ids`` (None: every token).

        The head is the target's, and on a large vocabulary it is most of a
        draft forward (Qwen3.5's 248k rows are a third of a 0.8B target):
        a block computes it for every slot. Restricted, the draft reads a
        copy of those rows alone, and every other token gets logit -inf, so
        it is never proposed (q = 0 there when sampling). Verification is
        unchanged, so the output is too; a token outside ``ids`` only ends
        an accepted run early (docs/performance.md#draft-vocabulary)."""
        if ids is None:
            object.__setattr__(self, "_vocab", None)
            return self
        kept = sorted(set(int(i) for i in ids))
        V = self.target.vocab_size
        if not kept or kept[0] < 0 or kept[-1] >= V:
            got = f"{kept[0]}..{kept[-1]}" if kept else "none"
            raise ValueError(f"a draft vocabulary takes token ids in 0..{V - 1}, got {got}")
        keep = mx.array(kept, dtype=mx.int32)
        object.__setattr__(self, "_vocab", (keep, self.target.head_rows(keep)))
        return self

    @property
    def vocab(self) -> Optional[mx.array]:
        """The sorted token ids the draft proposes among (None: all)."""
        v = getattr(self, "_vocab", None)
        return None if v is None else v[0]

    def logits(self, hidden: mx.array) -> mx.array:
        """The target's head on normed draft rows, with the draft's output
        multiplier and soft cap (if its config has them); with a restricted
        vocabulary only its rows are computed, the rest -inf."""
        cfg = self.config
        vocab = getattr(self, "_vocab", None)
        out = self.target.lm_head(hidden) if vocab is None else vocab[1](hidden)
        if cfg.output_multiplier != 1.0:
            out = out * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            out = mx.tanh(out / cap) * cap
        if vocab is not None:
            full = mx.full((*out.shape[:-1], self.target.vocab_size), -mx.inf, dtype=out.dtype)
            out = mx.put_along_axis(full, mx.broadcast_to(vocab[0], out.shape), out, axis=-1)
        return out

    def block_hidden(
        self,
        features: Optional[mx.array],
        anchor: int,
        anchor_pos: int,
        block_size: int,
        cache: DraftCache,
    ) -> mx.array:
        """Normed final hidden rows [block_size, H] of [anchor, MASK x (B-1)].

        ``features`` [S, N*H_target]: captured target features of the context
        positions cache.length .. anchor_pos - 1 not yet in the cache (or None).
        """
        cfg = self.config
        B = block_size
        self._extend_context(features, anchor_pos, cache)
        ids = mx.array([anchor] + [cfg.mask_token_id] * (B - 1))
        h = self.embed(ids)[None]
        # Each layer's steps run compiled (parameters read as inputs, so a
        # draft being trained is seen as it is now); the attend over the
        # context cache, whose length changes every cycle, runs between them.
        compiled = self.compiled and all(array_offset_rope(layer.self_attn.rope) for layer in self.layers)
        pos = mx.array(anchor_pos, dtype=mx.int32) if compiled else anchor_pos
        fused = fused_exp_for(True)  # a proposal block: the fused SiLU on a CPU
        for i, layer in enumerate(self.layers):
            q, kb, vb, *carry = self._step(i, B, "pre", fused, compiled)(h, pos)
            # The block's rows go after the context's, as scratch (not held).
            keys, values = cache.write(i, cache.rows, kb, vb)
            keys, values, mask = self._window(i, cache, anchor_pos, B, keys, values)
            out = attention(q, keys, values, layer.self_attn.scale, mask, decode_block=True)
            h = self._step(i, B, "post", fused, compiled)(h, out, *carry)
        return self.norm(h[0])

    def _step(self, i: int, B: int, kind: str, fused: bool, compiled: bool):
        """Layer i's ``pre`` or ``post`` for blocks of B rows, compiled once per
        (layer, width) when ``compiled``."""
        if compiled:
            fns = self.__dict__.setdefault("_compiled_fns", {})
            key = (i, B, kind, fused)
            fn = fns.get(key)
            if fn is None:
                fn = fns[key] = mx.compile(self._step(i, B, kind, fused, False), inputs=[self.layers[i].state])
            return fn
        layer = self.layers[i]
        return layer.pre if kind == "pre" else lambda h, out, *carry: layer.post(h, out, *carry, fused_exp=fused)

    def __call__(
        self,
        features: Optional[mx.array],
        anchor: int,
        anchor_pos: int,
        block_size: int,
        cache: DraftCache,
    ) -> mx.array:
        """Draft logits [block_size - 1, V] for slots 1..B-1 (DFlash 2: the
        selector's unary logits, which DDTree reads)."""
        return self.logits(self.block_hidden(features, anchor, anchor_pos, block_size, cache)[1:])

    def propose(
        self,
        features,
        anchor: int,
        anchor_pos: int,
        block_size: int,
        cache: DraftCache,
        sampler=None,
        sample: bool = False,
    ):
        """The drafted block: (tokens [B-1] int32, q [B-1, V] or None).

        Greedy: v1 takes each slot's argmax, DFlash 2 walks the selector's
        best successors from the anchor. ``sample``: tokens drawn from the
        proposal q (v1: the sampler's filtered softmax of the logits;
        DFlash 2: the selector's softmax over each slot's K candidates given
        the token drawn before it), with noise keyed by (seed, position).
        """
        hidden = self.block_hidden(features, anchor, anchor_pos, block_size, cache)[1:]
        return self._proposal(hidden, self.logits(hidden), anchor, anchor_pos, block_size, sampler, sample)

    def block_hidden_slots(self, slots: Sequence[tuple], block_size: int) -> mx.array:
        """:meth:`block_hidden` of several requests' blocks in one forward:
        ``slots`` = [(features, anchor, anchor_pos, cache)], one per request;
        returns [S, block_size, H], row b what :meth:`block_hidden` gives slot
        b alone. Row-wise work runs on all slots' rows at once; each slot's
        context is extended and attended over on its own."""
        cfg = self.config
        B, S = block_size, len(slots)
        self._extend_contexts([(features, anchor_pos, cache) for features, _, anchor_pos, cache in slots])
        h = self.embed(mx.array([[anchor] + [cfg.mask_token_id] * (B - 1) for _, anchor, _, _ in slots]))
        compiled = self.compiled and all(array_offset_rope(layer.self_attn.rope) for layer in self.layers)
        if S == 1:
            pos = mx.array(slots[0][2], dtype=mx.int32) if compiled else slots[0][2]
        else:  # each row at its own position
            pos = mx.array([[p + j for j in range(B)] for _, _, p, _ in slots], dtype=mx.int32)
        fused = fused_exp_for(True)
        for i, layer in enumerate(self.layers):
            q, kb, vb, *carry = self._step(i, B, "pre", fused, compiled)(h, pos)
            outs = []
            for b, (_, _, anchor_pos, cache) in enumerate(slots):
                keys, values = cache.write(i, cache.rows, kb[b : b + 1], vb[b : b + 1])
                keys, values, mask = self._window(i, cache, anchor_pos, B, keys, values)
                outs.append(attention(q[b : b + 1], keys, values, layer.self_attn.scale, mask, decode_block=True))
            h = self._step(i, B, "post", fused, compiled)(h, mx.concatenate(outs, axis=0), *carry)
        return self.norm(h)

    def propose_slots(self, slots: Sequence[tuple], block_size: int) -> List[tuple]:
        """:meth:`propose` for several requests in one forward: ``slots`` =
        [(features, anchor, anchor_pos, cache, sampler, sample)]; returns
        each one's (tokens, q)."""
        if not all(array_offset_rope(layer.self_attn.rope) for layer in self.layers):
            # A RoPE that takes no array offsets (mlx-lm's dynamic NTK): one slot at a time.
            return [self.propose(f, a, p, block_size, c, sampler, sample) for f, a, p, c, sampler, sample in slots]
        hidden = self.block_hidden_slots([s[:4] for s in slots], block_size)[:, 1:]
        logits = self.logits(hidden)
        return [
            self._proposal(hidden[b], logits[b], anchor, anchor_pos, block_size, sampler, sample)
            for b, (_, anchor, anchor_pos, _, sampler, sample) in enumerate(slots)
        ]

    def logits_slots(self, slots: Sequence[tuple], block_size: int) -> List[mx.array]:
        """:meth:`__call__` for several requests in one forward (a tree per
        slot is built from them): ``slots`` = [(features, anchor, anchor_pos,
        cache)]; returns each one's logits [block_size - 1, V]."""
        if not all(array_offset_rope(layer.self_attn.rope) for layer in self.layers):
            # A RoPE that takes no array offsets (mlx-lm's dynamic NTK): one slot at a time.
            return [self(f, a, p, block_size, c) for f, a, p, c in slots]
        logits = self.logits(self.block_hidden_slots(slots, block_size)[:, 1:])
        return [logits[b] for b in range(len(slots))]

    def _proposal(self, hidden, logits, anchor: int, anchor_pos: int, block_size: int, sampler, sample: bool):
        """(tokens, q) of a block from its rows' hidden states and logits."""
        if not self.config.is_v2:
            return logits_proposal(logits, anchor_pos, sampler, sample)
        sel = self.candidate_selector
        if not sample:
            toks, _, _ = sel.walk(hidden, logits, anchor, lambda sc, i: mx.argmax(sc))
            return toks, None
        from ..sampling import keyed_gumbel

        T = sampler.temperature
        g = keyed_gumbel(sampler.seed, range(anchor_pos + 1, anchor_pos + block_size), sel.top_k, stream=1)
        toks, cand, sc = sel.walk(hidden, logits, anchor, lambda sc, i: mx.argmax(sc / T + g[i]))
        q = mx.softmax(sc / T, axis=-1)
        full = mx.put_along_axis(mx.zeros(logits.shape, mx.float32), cand, q, axis=-1)
        return toks, full


def logits_proposal(logits: mx.array, anchor_pos: int, sampler=None, sample: bool = False):
    """(tokens, q) from per-slot logits [B-1, V]: argmax, or a draw from the
    sampler's filtered, tempered distribution (no repetition penalty; keyed
    by seed and position)."""
    if not sample:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    from ..sampling import keyed_gumbel

    lg = logits.astype(mx.float32)
    lg = sampler._filter(lg - mx.logsumexp(lg, axis=-1, keepdims=True)) / sampler.temperature
    q = mx.softmax(lg, axis=-1)
    n, V = logits.shape
    g = keyed_gumbel(sampler.seed, range(anchor_pos + 1, anchor_pos + 1 + n), V, stream=1)
    return mx.argmax(lg + g, axis=-1).astype(mx.int32), q


def propose(draft, features, anchor: int, anchor_pos: int, block_size: int, cache, sampler=None, sample: bool = False):
    """A draft's block proposal (tokens, q); drafts that only return logits
    (``draft(features, anchor, anchor_pos, B, cache)``) are drafted from those."""
    if hasattr(draft, "propose"):
        return draft.propose(features, anchor, anchor_pos, block_size, cache, sampler, sample)
    return logits_proposal(draft(features, anchor, anchor_pos, block_size, cache), anchor_pos, sampler, sample)


def draft_logits_slots(draft, slots: Sequence[tuple], block_size: int) -> List[mx.array]:
    """Several requests' draft logits (what a tree is built from), ``slots`` =
    [(features, anchor, anchor_pos, cache)]: one batched forward where the
    draft has one (:meth:`DFlashDraft.logits_slots`), else one call per request."""
    if hasattr(draft, "logits_slots"):
        return draft.logits_slots(slots, block_size)
    return [draft(f, a, p, block_size, c) for f, a, p, c in slots]


def propose_slots(draft, slots: Sequence[tuple], block_size: int) -> List[tuple]:
    """Several requests' proposals, ``slots`` = [(features, anchor,
    anchor_pos, cache, sampler, sample)]: one batched forward where the draft
    has one (:meth:`DFlashDraft.propose_slots`), else one call per request."""
    if hasattr(draft, "propose_slots"):
        return draft.propose_slots(slots, block_size)
    return [propose(draft, f, a, p, block_size, c, sampler, sample) for f, a, p, c, sampler, sample in slots]


# --- training forward -----------------------------------------------------------


def training_mask(
    anchors: mx.array, L: int, B: int, sliding_window: Optional[int] = None, block_causal: bool = True
) -> mx.array:
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


def train_hidden(draft: "DFlashDraft", features: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """Normed final hidden rows [Bt, m, B, H] for m blocks per sequence in one forward.

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
    h = draft.embed(ids)  # [Bt, m, B, H]
    q_pos = (anchors[..., None] + mx.arange(B)).reshape(Bt, m * B)
    c_pos = mx.broadcast_to(mx.arange(L)[None], (Bt, L))
    masks = {}
    for i, layer in enumerate(draft.layers):
        sl = cfg.sliding_window if cfg.is_sliding(i) else None
        if sl not in masks:
            masks[sl] = training_mask(anchors, L, B, sl, cfg.sliding_block_causal)[:, None]
        q, kb, vb, *carry = layer.pre(h, q_pos)
        kc, vc = layer.self_attn.kv(ctx, c_pos)
        keys = mx.concatenate([kc, kb], axis=2)
        values = mx.concatenate([vc, vb], axis=2)
        h = layer.post(h, masked_attention(q, keys, values, layer.self_attn.scale, masks[sl]), *carry)
    return draft.norm(h)


def masked_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array) -> mx.array:
    """Softmax attention of q [Bt, H, S, D] over keys, values [Bt, Hkv, L, D]
    under a boolean mask, in plain differentiable ops (training)."""
    nh, nkv = q.shape[1], keys.shape[1]
    if nh != nkv:
        keys = mx.repeat(keys, nh // nkv, axis=1)
        values = mx.repeat(values, nh // nkv, axis=1)
    scores = (q * scale) @ keys.swapaxes(-1, -2)
    scores = mx.where(mask, scores, -1e9)
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype) @ values


def train_logits(draft: "DFlashDraft", features: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """Logits [Bt, m, B-1, V] for slots 1..B-1 of each block (see :func:`train_hidden`)."""
    return draft.logits(train_hidden(draft, features, tokens, anchors)[:, :, 1:])
