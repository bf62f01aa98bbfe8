"""Exponentials for a CPU: a fused, vectorisable exp with the sigmoid, SiLU
and attention softmax built on it, and the rules for when a forward uses it
(:func:`fused_exp_for`) or must keep single-step rows (:func:`row_exact`).

MLX's CPU backend has no fused attention: mx.fast.scaled_dot_product_attention
falls back to matmul, softmax, matmul, and its softmax computes one scalar
exp per score (about 10 ns each here). A verify block of T rows over L
cached keys pays H * T * L of them: at 3k keys that is most of the
attention and a good part of the whole verify. The exp below is a fused,
vectorisable one (Cody-Waite reduction to e^r, |r| <= ln2/2, and Cephes'
expf polynomial: within 1 ulp of the exact exp), so the scores cost a few
elementwise passes instead.
"""

from typing import Sequence, Tuple

import mlx.core as mx

_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split: n * _LN2_HI is exact
_EXP_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)  # e^r = 1 + r + r^2 * poly(r)


def _exp_parts(x):
    """e^x = 2^n e^r for x in [-87.3, 88.3] (2^n a normal float): the factor
    e^r and 2^n's float bits, to be reinterpreted (a view cannot be traced
    shapelessly, so the softmax does that outside its compiled part)."""
    n = mx.floor(x * 1.4426950408889634 + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _EXP_POLY[0]
    for c in _EXP_POLY[1:]:
        p = p * r + c
    return p * (r * r) + r + 1.0, mx.left_shift(n.astype(mx.int32) + 127, 23)


def exp_fused(x: mx.array) -> mx.array:
    """e^x in float32 by the polynomial above (saturating beyond the float range)."""
    p, bits = _exp_parts(mx.clip(x.astype(mx.float32), -87.3, 88.3))
    return p * bits.view(mx.float32)


def sigmoid_fused(x: mx.array) -> mx.array:
    return (1.0 / (1.0 + exp_fused(-x))).astype(x.dtype)


def silu_fused(x: mx.array) -> mx.array:
    return (x.astype(mx.float32) / (1.0 + exp_fused(-x))).astype(x.dtype)


def _softmax_parts(s, m, keep):
    """e^(s - m) as _exp_parts gives it, the factor zero where ``keep`` is
    False. ``m`` is the maximum over the kept scores; a masked score may lie
    above it, so s - m is clipped to [-87.3, 0] (2^n stays a finite float:
    its factor 0 must not meet an inf)."""
    p, bits = _exp_parts(mx.clip(s - m, -87.3, 0.0))
    return mx.where(keep, p, 0.0), bits


_softmax_parts_fused = mx.compile(_softmax_parts, shapeless=True)
# Scores per head below which the fused path's extra passes cost more than
# the exps they save (measured side by side: even at about 1k, e.g. 16 rows x 64 keys).
FUSED_SOFTMAX_MIN = 1024
# Cached rows a block attends over at a time, the softmax merged across
# stretches: a stretch's scores (and a quantized cache's dequantized rows:
# 1024 x 2 KV heads x 256 is 2 MiB) stay in a core's cache between the ops
# that read them instead of passing through memory. At 32k rows a 16-row
# block took 0.6x the time of one pass (bench/results/kv-attention.md).
STRETCH_ROWS = 1024


def row_exact(dtype) -> bool:
    """Whether a target's verify rows must be computed as single steps
    compute them, bit for bit: half-precision activations. There a float32
    sum taken in another order (the closed form of a DeltaNet block, the
    fused exp) rounds to another bf16/fp16 value now and then, and greedy
    speculative output would part from plain decoding's. In float32 such
    differences stay in the last bits, and verify keeps its faster forms."""
    return dtype in (mx.bfloat16, mx.float16)


def fused_exp_for(record: bool, dtype=None) -> bool:
    """Whether a forward's activations take their exponentials from the fused
    exp: recorded (verify, draft) blocks on a CPU, unless ``dtype`` (a
    target's activations) makes its rows :func:`row_exact`. Plain steps and
    prefills keep MLX's ops, which are mlx-lm's; on the GPU the exp is no
    bottleneck."""
    return record and mx.default_device() != mx.gpu and not (dtype is not None and row_exact(dtype))


def attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None, *, decode_block: bool = False
) -> mx.array:
    """mx.fast.scaled_dot_product_attention for q [1, H, T, D] over keys,
    values [1, Hkv, L, D]; mask None, "causal" (the T queries are the last T
    keys) or bool [T, L].

    ``decode_block``: the rows of a verify or draft block. On a CPU, T > 1
    such rows compute their softmax with the fused exp above (same math, the
    exp within 1 ulp, float32), unless q is half precision (:func:`row_exact`). Everything else (prefill, single rows, the
    GPU) is that call, op for op what mlx-lm runs: plain decoding stays
    mlx-lm's token stream, in bf16 too."""
    T, L = q.shape[2], keys.shape[2]
    if not fused_exp_for(decode_block, q.dtype) or T == 1 or T * L < FUSED_SOFTMAX_MIN:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return attention_stretches(q, stretches(keys, values), scale, mask)


def stretches(keys: mx.array, values: mx.array, rows: int = STRETCH_ROWS):
    """Consecutive stretches of ``rows`` rows of keys, values [B, Hkv, L, D]."""
    if keys.shape[2] <= rows:
        return [(keys, values)]
    return [(keys[:, :, a : a + rows], values[:, :, a : a + rows]) for a in range(0, keys.shape[2], rows)]


_softmax_parts_all = mx.compile(lambda s, m: _exp_parts(mx.clip(s - m, -87.3, 0.0)), shapeless=True)


def attention_stretches(q: mx.array, parts: Sequence[Tuple[mx.array, mx.array]], scale: float, mask=None) -> mx.array:
    """Attention with the fused exp (float32) of q [B, H, T, D] over keys and
    values given as consecutive stretches of rows, (keys, values) pairs
    [B, Hkv, n, D], L rows in all; mask None, "causal" or bool [T, L] as
    :func:`attention` takes it.

    One stretch is the plain softmax. Several are merged as an online
    softmax merges them (each stretch's sums rescaled by e^(its max - the
    overall max)): the same attention up to float rounding, computed a
    stretch at a time, so that rows a caller makes per stretch (quantized
    rows dequantized) stay in a core's cache between the ops that use them."""
    B, H, T, D = q.shape
    Hkv = parts[0][0].shape[1]
    rep = H // Hkv
    L = sum(k.shape[2] for k, _ in parts)
    qs = (q.astype(mx.float32) * scale).reshape(B, Hkv, rep * T, D)  # query heads grouped by their KV head
    if mask is not None and not isinstance(mask, str):
        mask = mask.reshape(T, L)
    sums, a = [], 0
    for keys, values in parts:
        n = keys.shape[2]
        if isinstance(mask, str):
            # The T queries are the last T keys; stretches before them are all visible.
            keep = None if a + n <= L - T else (a + mx.arange(n))[None, :] <= mx.arange(L - T, L)[:, None]
        else:
            keep = None if mask is None else mask[:, a : a + n]
        s = qs @ keys.astype(mx.float32).swapaxes(-1, -2)
        if keep is None:
            m = mx.max(s, axis=-1, keepdims=True)
            p, bits = _softmax_parts_all(s, m)
        else:
            keep = mx.tile(keep, (rep, 1))
            m = mx.max(mx.where(keep, s, -mx.inf), axis=-1, keepdims=True)
            p, bits = _softmax_parts_fused(s, m, keep)
        e = p * bits.view(mx.float32)
        sums.append((e @ values.astype(mx.float32), m, e.sum(axis=-1, keepdims=True)))
        a += n
    if len(sums) == 1:
        o, _, total = sums[0]
    else:
        # A stretch none of whose keys a row sees has m = -inf: weight 0.
        top = sums[0][1]
        for _, m, _ in sums[1:]:
            top = mx.maximum(top, m)
        o = total = 0.0
        for oc, m, sc in sums:
            w = mx.exp(m - top)
            o, total = o + w * oc, total + w * sc
    return (o / total).reshape(B, H, T, D).astype(q.dtype)
