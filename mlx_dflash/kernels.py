"""DeltaNet kernels used by the target forward and the decode loop.

One function per kernel. Each has an MLX-ops body (the "twin") that is the
reference and runs on every backend; Metal bodies with the same signatures
arrive with the kernels issue and are chosen at call time.

Rollback design (SPEC §4): *tape*. The verify recurrence records, per token,
`delta_t = beta_t * (v_t - (g_t S_{t-1}) k_t)`. With the pre-verify state S_0
and the inputs k_t, g_t already at hand, rollback to n accepted tokens applies
`S_n = g_n...g_1 S_0 + sum_{t<=n} (g_n...g_{t+1}) delta_t k_t^T`: no q, no
output, Hv*Dv floats of memory per token instead of a full Hv*Dv*Dk state per
token (per-position capture) and no re-run of the projections (recompute).
Rolling back to the whole block keeps the forward's own final state.
"""

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


def _repeat_heads(x: mx.array, hv: int) -> mx.array:
    hk = x.shape[-2]
    return x if hk == hv else mx.repeat(x, hv // hk, axis=-2)


CHUNK = 64  # tokens per closed-form chunk (bounds the T x T matrices)


def _log_decay(g: mx.array) -> mx.array:
    # g = exp(-x) may underflow to 0; clamp so differences of cumulative logs stay finite.
    return mx.log(mx.maximum(g.astype(mx.float32), 1e-30))


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., T, T].

    A is nilpotent, so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... exactly:
    log2(T) matmuls and no linalg op (those are CPU-only in MLX).
    """
    T = A.shape[-1]
    eye = mx.eye(T, dtype=A.dtype)
    N = -A
    P = eye + N
    p = 2
    while p < T:
        N = N @ N
        P = P @ (eye + N)
        p *= 2
    return P


def _chunk(q, k, v, logg, beta, S):
    """One chunk in closed form. Layout [B, H, T, D]; S [B, H, Dv, Dk].

    With L_t = sum_{s<=t} log g_s and D_ts = exp(L_t - L_s) (s <= t):
      delta = (I + A)^-1 beta * (v - exp(L) * (S k)),  A_ts = beta_t D_ts k_t.k_s (s < t)
      y_t   = exp(L_t) S q_t + sum_{s<=t} D_ts (q_t.k_s) delta_s
      S_T   = exp(L_T) S + sum_s D_Ts delta_s k_s^T
    which is the recurrence S_t = g_t S_{t-1} + delta_t k_t^T unrolled.
    """
    T = q.shape[2]
    L = mx.cumsum(logg, axis=-1)  # [B, H, T]
    diff = L[..., :, None] - L[..., None, :]
    lower = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    decay = mx.where(lower, mx.exp(mx.where(lower, diff, 0.0)), 0.0)
    strict = mx.tril(mx.ones((T, T), dtype=mx.bool_), k=-1)
    St = S.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    eL = mx.exp(L)[..., None]
    A = mx.where(strict, beta[..., None] * decay * (k @ k.swapaxes(-1, -2)), 0.0)
    rhs = beta[..., None] * (v - eL * (k @ St))
    delta = _unit_lower_inverse(A) @ rhs
    y = eL * (q @ St) + (decay * (q @ k.swapaxes(-1, -2))) @ delta
    S = _advance(S, k, L, delta, T)
    return y, S, delta


def _advance(S, k, L, delta, n):
    """State after the first n tokens of a chunk (layout [B, H, T, D])."""
    w = mx.exp(L[..., n - 1 : n] - L[..., :n])[..., None]  # [B, H, n, 1]
    upd = (delta[..., :n, :] * w).swapaxes(-1, -2) @ k[..., :n, :]  # [B, H, Dv, Dk]
    return mx.exp(L[..., n - 1])[..., None, None] * S + upd


def _prep(q, k, v, g, beta, mask):
    hv = v.shape[2]
    f32 = mx.float32
    q = _repeat_heads(q, hv).astype(f32).transpose(0, 2, 1, 3)
    k = _repeat_heads(k, hv).astype(f32).transpose(0, 2, 1, 3)
    v = v.astype(f32).transpose(0, 2, 1, 3)
    logg = _log_decay(g).transpose(0, 2, 1)
    beta = beta.astype(f32).transpose(0, 2, 1)
    if mask is not None:
        # A padded token leaves the state unchanged: decay 1, no update.
        m = mask[:, None, :]
        logg = mx.where(m, logg, 0.0)
        beta = mx.where(m, beta, 0.0)
    return q, k, v, logg, beta


def _single_step(q, k, v, g, beta, S, record):
    """T == 1 (plain decoding): the recurrence directly, fewest ops."""
    hv = v.shape[2]
    q = _repeat_heads(q, hv)[:, 0]
    k = _repeat_heads(k, hv)[:, 0]
    S = S * g[:, 0][..., None, None]
    delta = (v[:, 0] - (S * k[..., None, :]).sum(-1)) * beta[:, 0][..., None]
    S = S + k[..., None, :] * delta[..., None]
    y = (S * q[..., None, :]).sum(-1)[:, None].astype(q.dtype)
    return y, S, delta[:, None] if record else None


def gated_delta_chain(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
    *,
    record: bool = False,
) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """Gated delta rule over a block of T tokens.

    Per token and value head: S = g S; delta = beta (v - S k); S = S + delta k^T;
    y = S q. Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
    state [B, Hv, Dv, Dk] (fp32); mask [B, T] bool (False = padding: state
    unchanged). Value head h reads key head h // (Hv / Hk).

    Returns y [B, T, Hv, Dv] (dtype of q), the state after the block and, when
    ``record``, the tape ``delta`` [B, T, Hv, Dv] (fp32) that
    :func:`gated_delta_rollback` uses.

    The twin evaluates chunks of up to CHUNK tokens in closed form (matmuls
    instead of T sequential state updates): on a CPU a 16-token verify costs a
    few state-sized passes instead of 80.
    """
    dtype = q.dtype
    T = q.shape[1]
    if T == 1 and mask is None:
        return _single_step(q, k, v, g, beta, state, record)
    q, k, v, logg, beta = _prep(q, k, v, g, beta, mask)
    ys, deltas = [], []
    S = state
    for s in range(0, T, CHUNK):
        e = min(s + CHUNK, T)
        y, S, d = _chunk(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], logg[..., s:e], beta[..., s:e], S)
        ys.append(y)
        deltas.append(d)
    y = mx.concatenate(ys, axis=2) if len(ys) > 1 else ys[0]
    y = y.transpose(0, 2, 1, 3).astype(dtype)
    tape = None
    if record:
        tape = mx.concatenate(deltas, axis=2) if len(deltas) > 1 else deltas[0]
        tape = tape.transpose(0, 2, 1, 3)
    return y, S, tape


def gated_delta_rollback(
    state0: mx.array,
    k: mx.array,
    g: mx.array,
    delta: mx.array,
    n: int,
    mask: Optional[mx.array] = None,
) -> mx.array:
    """State after the first ``n`` tokens of a recorded block.

    ``state0`` is the state before the block; ``k`` [B, T, Hk, Dk] and ``g``
    [B, T, Hv] are what the forward used, ``delta`` [B, T, Hv, Dv] what it
    recorded. Applies S_n = exp(L_n) S_0 + sum_{s<n} exp(L_n - L_s) delta_s k_s^T:
    no q, no output, one matmul per chunk.
    """
    if n == 0:
        return state0
    hv = delta.shape[2]
    k = _repeat_heads(k[:, :n], hv).astype(mx.float32).transpose(0, 2, 1, 3)
    logg = _log_decay(g[:, :n]).transpose(0, 2, 1)
    if mask is not None:
        logg = mx.where(mask[:, None, :n], logg, 0.0)
    d = delta[:, :n].transpose(0, 2, 1, 3)
    S = state0
    for s in range(0, n, CHUNK):
        e = min(s + CHUNK, n)
        L = mx.cumsum(logg[..., s:e], axis=-1)
        S = _advance(S, k[:, :, s:e], L, d[:, :, s:e], e - s)
    return S


def causal_conv1d_silu(conv_in: mx.array, weight: mx.array) -> mx.array:
    """Depthwise causal conv1d + SiLU.

    ``conv_in`` [B, K-1+T, C] is the conv state (the last K-1 pre-conv rows)
    followed by the block's T rows; ``weight`` [C, K, 1] (MLX layout).
    Returns [B, T, C]. K shifted multiply-adds: about twice as fast on a CPU
    as MLX's grouped conv1d for depthwise kernels.
    """
    K = weight.shape[1]
    T = conv_in.shape[1] - K + 1
    w = weight[:, :, 0].astype(conv_in.dtype)
    out = conv_in[:, 0:T] * w[:, 0]
    for j in range(1, K):
        out = out + conv_in[:, j : j + T] * w[:, j]
    return nn.silu(out)


def conv_state_rollback(conv_in: mx.array, n: int, kernel_size: int) -> mx.array:
    """Conv state after the first ``n`` block tokens: rows n .. n+K-2 of
    ``concat(conv_state_prev, block)``."""
    return conv_in[:, n : n + kernel_size - 1]
