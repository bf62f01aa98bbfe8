"""DeltaNet kernels used by the target forward and the decode loop.

One function per kernel. Each has an MLX-ops body (the "twin") that is the
reference and runs on every backend; Metal bodies with the same signatures
arrive with the kernels issue and are chosen at call time.

Rollback design (SPEC §4): *tape*. The verify recurrence records, per token,
`delta_t = beta_t * (v_t - (g_t S_{t-1}) k_t)`. With the pre-verify state S_0
and the inputs k_t, g_t already at hand, rollback to n accepted tokens replays
`S = g_t * S + k_t delta_t^T` for t < n: no q, no output, Hv*Dv floats per token
of memory instead of a full Hv*Dv*Dk state per token. The replay performs the
same elementwise operations on the same operands as the forward, so the
restored state is bit-identical to the state the forward passed through.
"""

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


def _repeat_heads(x: mx.array, hv: int) -> mx.array:
    hk = x.shape[-2]
    return x if hk == hv else mx.repeat(x, hv // hk, axis=-2)


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

    Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
    state [B, Hv, Dv, Dk] (fp32); mask [B, T] bool (False = padding, state
    unchanged). Value head h reads key head h // (Hv / Hk).

    Returns y [B, T, Hv, Dv] (dtype of q), the state after the block, and,
    when ``record``, the tape ``delta`` [B, T, Hv, Dv] (fp32) that
    :func:`gated_delta_rollback` replays.
    """
    T = q.shape[1]
    hv = v.shape[2]
    q = _repeat_heads(q, hv)
    k = _repeat_heads(k, hv)
    ys, deltas = [], []
    for t in range(T):
        kt = k[:, t]
        old = state
        state = state * g[:, t][..., None, None]
        kv_mem = (state * kt[..., None, :]).sum(axis=-1)
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        state = state + kt[..., None, :] * delta[..., None]
        ys.append((state * q[:, t][..., None, :]).sum(axis=-1))
        if mask is not None:
            m = mask[:, t]
            state = mx.where(m[:, None, None, None], state, old)
            # A padded token must replay as a no-op: decay 1, delta 0.
            delta = mx.where(m[:, None, None], delta, 0)
        if record:
            deltas.append(delta)
    y = mx.stack(ys, axis=1).astype(q.dtype)
    tape = mx.stack(deltas, axis=1) if record else None
    return y, state, tape


def gated_delta_rollback(
    state0: mx.array,
    k: mx.array,
    g: mx.array,
    delta: mx.array,
    n: int,
    mask: Optional[mx.array] = None,
) -> mx.array:
    """State after the first ``n`` tokens of a recorded block.

    ``state0`` is the state before the block; ``k`` [B, T, Hk, Dk], ``g``
    [B, T, Hv] and ``delta`` [B, T, Hv, Dv] are what the forward used and
    recorded. Replays the rank-1 updates only.
    """
    hv = delta.shape[2]
    k = _repeat_heads(k, hv)
    state = state0
    for t in range(n):
        new = state * g[:, t][..., None, None]
        new = new + k[:, t][..., None, :] * delta[:, t][..., None]
        if mask is not None:
            new = mx.where(mask[:, t][:, None, None, None], new, state)
        state = new
    return state


def causal_conv1d_silu(conv_in: mx.array, weight: mx.array) -> mx.array:
    """Depthwise causal conv1d + SiLU.

    ``conv_in`` [B, K-1+T, C] is the conv state (the last K-1 pre-conv rows)
    followed by the block's T rows; ``weight`` [C, K, 1] (MLX layout).
    Returns [B, T, C].
    """
    return nn.silu(mx.conv1d(conv_in, weight, groups=conv_in.shape[-1]))


def conv_state_rollback(conv_in: mx.array, n: int, kernel_size: int) -> mx.array:
    """Conv state after the first ``n`` block tokens: rows n .. n+K-2 of
    ``concat(conv_state_prev, block)``."""
    return conv_in[:, n : n + kernel_size - 1]
