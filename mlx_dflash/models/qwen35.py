"""Qwen3.5 / Qwen3.6 hybrid target (dense ``qwen3_5`` and MoE ``qwen3_5_moe``).

The parameters live in mlx-lm's module tree (so its checkpoint loading,
sanitizing and quantization apply unchanged); the forward is our own, because
verify needs what mlx-lm's does not provide: hidden-state capture, a DeltaNet
tape for exact rollback, and a truncatable KV cache.
"""

import copy
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..cache import DeltaNetState, SlotBatch, TargetCache
from ..ddtree import ancestor_matrix
from ..kernels.conv import causal_conv1d_silu
from ..kernels.fused_exp import fused_exp_for, row_exact, sigmoid_fused, silu_fused
from ..kernels.gated_delta import gated_delta_chain, gated_delta_tree

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def array_offset_rope(rope) -> bool:
    """Whether a RoPE module takes its offset as an mx.array (what a compiled
    forward passes); mlx-lm's dynamic-NTK RoPE needs a Python int."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    return not isinstance(rope, DynamicNTKScalingRoPE)


def tree_inputs(parents: Sequence[int]):
    """(depth [T], ancestor matrix [T, T]) of a verify tree, for the attention layers."""
    anc = ancestor_matrix(parents)
    return anc.astype(mx.int32).sum(axis=1) - 1, anc


# --- the layer kinds' steps ----------------------------------------------------
# One implementation per layer kind, which Target.layers_forward runs either as
# plain ops or mx.compile'd: a DeltaNet layer is one step (states in and out,
# plus its tape when recorded); an attention layer is two, around the attend
# over the KV cache (whose length changes every call).


def mlp_step(layer, h: mx.array, fused: bool) -> mx.array:
    """h plus the layer's MLP sublayer; ``fused``: a dense SwiGLU's SiLU by
    fused_exp.silu_fused (MoE blocks always run mlx-lm's)."""
    x = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    if fused and hasattr(mlp, "gate_proj"):
        return h + mlp.down_proj(silu_fused(mlp.gate_proj(x)) * mlp.up_proj(x))
    return h + mlp(x)


def deltanet_step(layer, h: mx.array, conv: mx.array, ssm: mx.array, *, record: bool, fused: bool, parents=None):
    """A DeltaNet layer and its MLP over h [B, T, H] from states conv
    [B, K-1, C] and ssm [B, Hv, Dv, Dk]: (h, conv, ssm), and when ``record``
    the tape's (k, g, delta, conv_in). ``parents``: a tree block."""
    la = layer.linear_attn
    x = layer.input_layernorm(h)
    B, T, _ = x.shape
    Hk, Hv = la.num_k_heads, la.num_v_heads
    Dk, Dv = la.head_k_dim, la.head_v_dim
    K = la.conv_kernel_size
    qkv = la.in_proj_qkv(x)
    z = la.in_proj_z(x).reshape(B, T, Hv, Dv)
    b = la.in_proj_b(x)
    a = la.in_proj_a(x)
    conv_in = mx.concatenate([conv, qkv], axis=1)
    fx = fused_exp_for(record, x.dtype)
    conv_out = causal_conv1d_silu(conv_in, la.conv1d.weight, parents, fused_exp=fx)
    qc, kc, vc = mx.split(conv_out, [la.key_dim, 2 * la.key_dim], axis=-1)
    q = qc.reshape(B, T, Hk, Dk)
    k = kc.reshape(B, T, Hk, Dk)
    v = vc.reshape(B, T, Hv, Dv)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    beta = sigmoid_fused(b) if fx else mx.sigmoid(b)
    g = compute_g(la.A_log, a, la.dt_bias)
    stepwise = record and row_exact(x.dtype)
    if parents is None:
        y, new_ssm, delta = gated_delta_chain(q, k, v, g, beta, ssm, record=record, stepwise=stepwise)
    else:
        y, new_ssm, delta = gated_delta_tree(q, k, v, g, beta, ssm, parents, record=record, stepwise=stepwise)
    if fx:  # mlx-lm's gated RMSNorm, its SiLU fused
        f32 = mx.float32
        out = silu_fused(z.astype(f32)) * mx.fast.rms_norm(y, la.norm.weight, la.norm.eps).astype(f32)
        out = out.astype(y.dtype)
    else:
        out = la.norm(y, z)
    h = mlp_step(layer, h + la.out_proj(out.reshape(B, T, -1)), fused)
    new_conv = conv_in[:, -(K - 1) :]
    return (h, new_conv, new_ssm, k, g, delta, conv_in) if record else (h, new_conv, new_ssm)


def attention_pre(layer, h: mx.array, pos):
    """An attention layer's work before the KV attend: q, k, v [B, H, T, D]
    and the output gate [B, T, H*D]. RoPE at offset ``pos`` (an int or a
    scalar array), per batch row at offsets ``pos`` [B] (slots), or, with
    B == 1, per token at positions ``pos`` [T] (a tree)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    B, T, _ = x.shape
    nh, nkv = attn.num_attention_heads, attn.num_key_value_heads
    q, gate = mx.split(attn.q_proj(x).reshape(B, T, nh, -1), 2, axis=-1)
    gate = gate.reshape(B, T, -1)
    k = attn.k_proj(x).reshape(B, T, nkv, -1)
    v = attn.v_proj(x).reshape(B, T, nkv, -1).transpose(0, 2, 1, 3)
    q = attn.q_norm(q).transpose(0, 2, 1, 3)
    k = attn.k_norm(k).transpose(0, 2, 1, 3)
    if isinstance(pos, mx.array) and pos.ndim == 1 and B == 1:  # a tree: tokens as the batch, each at its position
        q = attn.rope(q.transpose(2, 1, 0, 3), offset=pos).transpose(2, 1, 0, 3)
        k = attn.rope(k.transpose(2, 1, 0, 3), offset=pos).transpose(2, 1, 0, 3)
    else:
        q = attn.rope(q, offset=pos)
        k = attn.rope(k, offset=pos)
    return q, k, v, gate


def attention_post(layer, h: mx.array, o: mx.array, gate: mx.array, *, fused: bool) -> mx.array:
    """An attention layer's work after the attend (o [B, H, T, D]): gate,
    output projection, residual, MLP sublayer."""
    B, _, T, _ = o.shape
    out = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
    out = out * (sigmoid_fused(gate) if fused else mx.sigmoid(gate))
    return mlp_step(layer, h + layer.self_attn.o_proj(out), fused)


def layer_step(layer, kind: str, record: bool, fused: bool, parents=None):
    """Layer's step ``kind`` ("deltanet", "pre" / "post": an attention
    layer's before / after the attend) as a function of arrays only."""
    if kind == "deltanet":
        return lambda h, conv, ssm: deltanet_step(layer, h, conv, ssm, record=record, fused=fused, parents=parents)
    if kind == "pre":
        return lambda h, pos: attention_pre(layer, h, pos)
    return lambda h, o, gate: attention_post(layer, h, o, gate, fused=fused)


class Target:
    """Wraps an mlx-lm ``qwen3_5`` / ``qwen3_5_moe`` Model with an owned forward."""

    def __init__(self, model, config: Optional[dict] = None):
        self.model = model
        self.config = config or {}
        lm = model.language_model
        self.args = lm.args
        self.lm = lm
        self.layers = lm.model.layers
        self.embed_tokens = lm.model.embed_tokens
        self.norm = lm.model.norm
        self.is_linear = [layer.is_linear for layer in self.layers]
        # Decode-time forwards run each layer as mx.compile'd pieces (fused
        # elementwise ops, one graph per layer and width): on a small or
        # dispatch-bound model that is most of a step. False: plain MLX ops.
        self.compiled = True
        self.compile_widths = 64  # wider verifies are compute-bound: plain ops
        # The compiled attention takes its RoPE offset as an array, which
        # mlx-lm's dynamic-NTK RoPE cannot (it compares the offset in Python).
        self._compilable = all(array_offset_rope(layer.self_attn.rope) for layer in self.layers if not layer.is_linear)
        self._fns = {}

    # --- shape facts -----------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_context(self) -> int:
        return int(self.args.max_position_embeddings)

    def make_cache(self, kv_bits: Optional[int] = None) -> TargetCache:
        """``kv_bits`` 8 or 4: attention K/V stored quantized (cache.QuantizedKVBuffer)."""
        if kv_bits is not None:
            from ..cache import check_kv_bits

            check_kv_bits(kv_bits, self.args.head_dim)
        return TargetCache(self.is_linear, kv_bits=kv_bits)

    # --- pieces shared with the draft --------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def lm_head(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(h)
        return self.lm.lm_head(h)

    def head_rows(self, ids: mx.array):
        """The head restricted to the vocabulary rows ``ids``: a function of h
        giving ``lm_head(h)[..., ids]`` while reading only those rows (a copy
        of them, in the head's own format: float or quantized, each output
        row has its own weights, scales and biases)."""
        tied = self.args.tie_word_embeddings
        module = self.embed_tokens if tied else getattr(self.lm, "lm_head", None)
        if module is None:
            raise ValueError("this model holds no output head (a pipeline stage without it)")
        sub = copy.copy(module)
        for name, value in module.items():
            if isinstance(value, mx.array):
                if value.shape[0] != self.vocab_size:
                    raise ValueError(f"the head's {name} has {value.shape[0]} rows, not one per token")
                sub[name] = mx.contiguous(value[ids])
        mx.eval(sub.parameters())
        return sub.as_linear if tied else sub

    # --- forward -------------------------------------------------------------
    def layers_forward(
        self, h: mx.array, caches, *, capture: Sequence[int] = (), record: bool = False, parents=None, tree=None
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """The decoder layers over embeddings h [B, T, H] with per-layer caches
        (None: no cache, from position 0). Returns the last hidden state and
        the ``capture`` layers' outputs concatenated [B, T, N*H] (or None).
        Callers advance ``cache.offset``."""
        B, T, _ = h.shape
        # Decode-time forwards (a plain step, a recorded verify) run each step
        # compiled; prefill chunks and suffixes come in every length, each a
        # new trace, so they run as plain ops.
        compiled = (
            self.compiled
            and self._compilable
            and tree is None
            and B == 1
            and (T == 1 or (record and T <= self.compile_widths))
            and all(c is not None for c in caches)
        )
        fused = fused_exp_for(record, h.dtype)
        feats = {}
        for i, (layer, c) in enumerate(zip(self.layers, caches)):
            if layer.is_linear:
                st = c if c is not None else DeltaNetState()
                la = layer.linear_attn
                K = la.conv_kernel_size
                if st.conv is None:
                    st.conv = mx.zeros((B, K - 1, la.conv_dim), dtype=h.dtype)
                if st.ssm is None:
                    st.ssm = mx.zeros((B, la.num_v_heads, la.head_v_dim, la.head_k_dim), dtype=mx.float32)
                ssm0 = st.ssm
                out = self._step(i, "deltanet", T, record, fused, compiled, parents)(h, st.conv, st.ssm)
                h, st.conv, st.ssm = out[:3]
                st.tape = (ssm0, *out[3:], K) if record else None
            else:
                offset = c.offset if c is not None else 0
                if tree is None:
                    pos = mx.array(offset, dtype=mx.int32) if compiled else offset
                    mask = "causal" if T > 1 else None  # aligns the T queries with the last T keys
                else:
                    # Node t sits at position offset + depth[t] and sees the
                    # committed context plus its own ancestors.
                    depth, anc = tree
                    pos = offset + depth
                    mask = mx.concatenate([mx.ones((T, offset), dtype=mx.bool_), anc], axis=1)
                q, k, v, gate = self._step(i, "pre", T, record, fused, compiled)(h, pos)
                scale = layer.self_attn.scale
                if c is not None:
                    o = c.attend(q, k, v, scale, mask, record)
                else:
                    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
                h = self._step(i, "post", T, record, fused, compiled)(h, o, gate)
            if i in capture:
                feats[i] = h
        return h, (mx.concatenate([feats[i] for i in capture], axis=-1) if capture else None)

    def _step(self, i: int, kind: str, T: int, record: bool, fused: bool, compiled: bool, parents=None):
        """Layer i's step ``kind`` (:func:`layer_step`) as a function of arrays:
        plain, or compiled once per (layer, width, record) with the layer's
        parameters read as inputs, so later weight updates are seen."""
        if compiled:
            key = (i, T, kind, record, fused)
            fn = self._fns.get(key)
            if fn is None:
                layer = self.layers[i]
                fn = self._fns[key] = mx.compile(layer_step(layer, kind, record, fused), inputs=[layer.state])
            return fn
        return layer_step(self.layers[i], kind, record, fused, parents)

    def forward(
        self,
        tokens,
        cache: TargetCache,
        *,
        capture: Sequence[int] = (),
        record: bool = False,
        logits: str = "all",
        parents: Optional[Sequence[int]] = None,
    ) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """Run ``tokens`` (1-D ids) at positions cache.offset.. and extend the cache.

        capture: layer ids whose outputs (residual stream after the layer) are
            concatenated, in order, into features [T, len(capture) * H].
        record: keep what :meth:`TargetCache.rollback` needs (verify).
        logits: "all" -> [T, V]; "last" -> [1, V]; "none" -> None.
        parents: tree verify. Token t's parent row (-1: the root, whose
            parent is the last committed token); token t sits at position
            offset + depth[t]. Needs ``record``; roll back to a path after.
        """
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
        T = tokens.shape[0]
        tree = None
        if parents is not None:
            if not record:
                raise ValueError("a tree forward must be recorded (it is always rolled back)")
            parents = list(parents)
            tree = tree_inputs(parents)
        h, features = self.layers_forward(
            self.embed_tokens(tokens[None]), cache.layers, capture=capture, record=record, parents=parents, tree=tree
        )
        cache.offset += T
        cache.block = T if record else 0
        if features is not None:
            features = features[0]
        if logits == "none":
            return None, features
        if logits == "last":
            h = h[:, -1:]
        return self.lm_head(self.norm(h))[0], features

    def forward_slots(
        self,
        tokens: mx.array,
        batch: SlotBatch,
        *,
        capture: Sequence[int] = (),
        record: bool = False,
        parents: Optional[Sequence[Sequence[int]]] = None,
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """:meth:`forward` of a block of the same width W for every slot of
        ``batch``, each at its own offset: tokens [S, W]. Returns logits
        [S, W, V] and features [S, W, N*H] (or None); slot b's rows are its
        solo forward's. Row-wise work runs on all slots' rows at once;
        attention runs per slot over its own KV (the solo call); DeltaNet
        layers run with the slots stacked (the same W for all, so the same
        recurrence per slot). ``record``: roll back with ``batch.rollback``.
        ``parents``: a tree per slot (``parents[b]``, W nodes each, as
        :meth:`forward` takes one; needs ``record``; roll back along each
        slot's path with ``batch.rollback(ns, paths)``): the DeltaNet tree
        kernels take one tree per batch row."""
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
        S, T = tokens.shape
        caches = batch.caches
        if len(caches) != S:
            raise ValueError(f"{S} rows of tokens for {len(caches)} slots")
        trees = None
        if parents is not None:
            if not record:
                raise ValueError("a tree forward must be recorded (it is always rolled back)")
            if len(parents) != S or any(len(p) != T for p in parents):
                raise ValueError(f"a tree of {T} nodes per slot needs {S} parent lists of {T}")
            parents = [list(p) for p in parents]
            trees = [tree_inputs(p) for p in parents]
        compiled = (
            self.compiled and self._compilable and trees is None and (T == 1 or (record and T <= self.compile_widths))
        )
        h = self.embed_tokens(tokens)
        fused = fused_exp_for(record, h.dtype)
        offsets = [c.offset for c in caches]
        if S == 1:
            pos = mx.array(offsets[0], dtype=mx.int32) if compiled else offsets[0]
        elif self._compilable:
            pos = mx.array(offsets, dtype=mx.int32)
        else:
            pos = None  # a RoPE that takes no array offsets: each slot's at its own int
        mask = "causal" if T > 1 else None
        feats, tapes = {}, {}
        for i, layer in enumerate(self.layers):
            sts = [c.layers[i] for c in caches]
            if layer.is_linear:
                ssm0 = mx.concatenate([st.ssm for st in sts], axis=0)
                conv = mx.concatenate([st.conv for st in sts], axis=0)
                out = self._step(i, "deltanet", T, record, fused, compiled, parents)(h, conv, ssm0)
                h, conv, ssm = out[:3]
                K = layer.linear_attn.conv_kernel_size
                for b, st in enumerate(sts):
                    st.conv, st.ssm = conv[b : b + 1], ssm[b : b + 1]
                    st.tape = (ssm0[b : b + 1], *(x[b : b + 1] for x in out[3:]), K) if record else None
                if record:
                    tapes[i] = (ssm0, *out[3:], K, ssm)
            else:
                masks = [mask] * S
                if trees is not None:  # node t at offset + depth[t], seeing the context and its ancestors
                    pre = [
                        self._step(i, "pre", T, record, fused, False)(h[b : b + 1], off + trees[b][0])
                        for b, off in enumerate(offsets)
                    ]
                    q, k, v, gate = (mx.concatenate(x, axis=0) for x in zip(*pre))
                    masks = [
                        mx.concatenate([mx.ones((T, off), dtype=mx.bool_), anc], axis=1)
                        for off, (_, anc) in zip(offsets, trees)
                    ]
                elif pos is not None:
                    q, k, v, gate = self._step(i, "pre", T, record, fused, compiled)(h, pos)
                else:
                    pre = [
                        self._step(i, "pre", T, record, fused, False)(h[b : b + 1], off)
                        for b, off in enumerate(offsets)
                    ]
                    q, k, v, gate = (mx.concatenate(x, axis=0) for x in zip(*pre))
                scale = layer.self_attn.scale
                o = [
                    st.attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], scale, masks[b], record)
                    for b, st in enumerate(sts)
                ]
                h = self._step(i, "post", T, record, fused, compiled)(h, mx.concatenate(o, axis=0), gate)
            if i in capture:
                feats[i] = h
        for c in caches:
            c.offset += T
        batch.recorded(T if record else 0, tapes)
        features = mx.concatenate([feats[i] for i in capture], axis=-1) if capture else None
        return self.lm_head(self.norm(h)), features

    def batch_forward(self, tokens: mx.array, capture: Sequence[int] = ()):
        """No-cache forward of a batch [Bt, T] from position 0 (training, feature
        extraction). Returns logits [Bt, T, V] and features [Bt, T, n*H] or None.
        Differentiable."""
        h, features = self.layers_forward(self.embed_tokens(tokens), [None] * self.num_layers, capture=capture)
        return self.lm_head(self.norm(h)), features

    def prefill(
        self,
        tokens: List[int],
        cache: TargetCache,
        *,
        capture: Sequence[int] = (),
        chunk_size: int = 512,
        capture_from: int = 0,
        consume: Optional[Callable[[mx.array], List[mx.array]]] = None,
        points: Sequence[int] = (),
        at_point: Optional[Callable[[int], List[mx.array]]] = None,
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """Chunked prefill of ``tokens`` at positions cache.offset... Chunks
        end every ``chunk_size`` tokens and at each position of ``points``,
        where ``at_point(position)`` is called once the cache holds it (the
        prefix store takes its snapshots there). ``consume(features)``: takes
        each chunk's captured features as they come (a draft reading its
        context) instead of returning them. Both callbacks return arrays to
        materialise with the cache. Returns last-row logits [1, V] and
        features of rows ``capture_from``.. (the rows a windowed draft will
        read; None with ``consume``)."""
        *_, out = self.prefill_steps(
            tokens,
            cache,
            capture=capture,
            chunk_size=chunk_size,
            capture_from=capture_from,
            consume=consume,
            points=points,
            at_point=at_point,
        )
        return out

    def prefill_steps(
        self,
        tokens: List[int],
        cache: TargetCache,
        *,
        capture: Sequence[int] = (),
        chunk_size: int = 512,
        capture_from: int = 0,
        consume: Optional[Callable[[mx.array], List[mx.array]]] = None,
        points: Sequence[int] = (),
        at_point: Optional[Callable[[int], List[mx.array]]] = None,
    ) -> Iterator[Optional[Tuple[mx.array, Optional[mx.array]]]]:
        """:meth:`prefill` one chunk per step, so a caller can run other work
        between chunks: yields None after each chunk but the last, then what
        :meth:`prefill` returns."""
        start = cache.offset
        end = start + len(tokens)
        stops = set(range(start + chunk_size, end, chunk_size)) | {end}
        cuts = sorted(stops | {p for p in points if start < p < end})
        points = set(points)
        feats = []
        logits = None
        s = start
        for e in cuts:
            logits, f = self.forward(
                tokens[s - start : e - start],
                cache,
                capture=capture if s - start + chunk_size > capture_from else (),
                logits="last" if e == end else "none",
            )
            extra = []
            if f is not None:
                if consume is not None:
                    extra += consume(f)
                else:
                    feats.append(f[max(capture_from - (s - start), 0) :])
            if at_point is not None and e in points:
                extra += at_point(e)
            # Bound the lazy graph: materialise each chunk's cache.
            mx.eval(cache.state(), *feats[-1:], extra)
            s = e
            if e != end:
                yield None
        features = mx.concatenate(feats, axis=0) if feats else None
        yield logits, features

    def __call__(self, tokens, cache: Optional[TargetCache] = None) -> mx.array:
        """Plain logits [T, V] (a fresh cache when none is given)."""
        cache = cache if cache is not None else self.make_cache()
        return self.forward(tokens, cache)[0]
