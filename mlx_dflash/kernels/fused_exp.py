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
    B, H, _, D = q.shape
    Hkv = keys.shape[1]
    rep = H // Hkv
    # Query heads grouped by their KV head: [B, Hkv, rep * T, D].
    s = (q.astype(mx.float32) * scale).reshape(B, Hkv, rep * T, D) @ keys.astype(mx.float32).swapaxes(-1, -2)
    if isinstance(mask, str):
        keep = mx.arange(L)[None, :] <= mx.arange(L - T, L)[:, None]
    elif mask is None:
        keep = mx.ones((T, L), dtype=mx.bool_)
    else:
        keep = mask.reshape(T, L)
    keep = mx.tile(keep, (rep, 1))
    m = mx.max(mx.where(keep, s, -mx.inf), axis=-1, keepdims=True)
    p, bits = _softmax_parts_fused(s, m, keep)
    e = p * bits.view(mx.float32)
    o = (e @ values.astype(mx.float32)) / e.sum(axis=-1, keepdims=True)
    return o.reshape(B, H, T, D).astype(q.dtype)
