"""DeltaNet kernels used by the target forward and the decode loop.

One function per kernel. Each has an MLX-ops body (the "twin") that is the
reference and runs on every backend; Metal bodies with the same signatures
arrive with the kernels issue and are chosen at call time.

Dispatch: each public function takes ``force_twin``; without it, the Metal
kernel (``metal/*.metal``) runs when ``mx.metal.is_available()`` and the
default device is the GPU, decided at call time. The launch of each kernel
(inputs, template, grid) is described once by a ``*_launch`` function, used
both for the real dispatch and by the CPU test harness that executes the
Metal sources on Linux (tests/metal_harness.py). A custom Metal kernel has no
VJP in MLX, so every Metal call is an ``mx.custom_function`` whose VJP is the
twin's: training and anything else differentiated through the target work
on the GPU path too (:func:`_metal_or_twin`).

Rollback design (docs/math.md §2-3): *tape*. The verify recurrence records, per token,
`delta_t = beta_t * (v_t - (g_t S_{t-1}) k_t)`. With the pre-verify state S_0
and the inputs k_t, g_t already at hand, rollback to n accepted tokens applies
`S_n = g_n...g_1 S_0 + sum_{t<=n} (g_n...g_{t+1}) delta_t k_t^T`: no q, no
output, Hv*Dv floats of memory per token instead of a full Hv*Dv*Dk state per
token (per-position capture) and no re-run of the projections (recompute).
Rolling back to the whole block keeps the forward's own final state.
"""

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np


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


def _chunk(q, k, v, logg, beta, S, anc=None):
    """One chunk in closed form. Layout [B, H, T, D]; S [B, H, Dv, Dk].

    ``anc`` [T, T] bool: anc[t, s] = token s is on token t's path (ancestor or
    itself); None = a chain (lower triangle). With L_t = sum of log g over t's
    path and D_ts = exp(L_t - L_s) for s on that path:
      delta = (I + A)^-1 beta * (v - exp(L) * (S k)),  A_ts = beta_t D_ts k_t.k_s (s strictly before t)
      y_t   = exp(L_t) S q_t + sum_{s on path(t)} D_ts (q_t.k_s) delta_s
    which is S_t = g_t S_parent(t) + delta_t k_t^T unrolled. Returns y, the
    state after the last token's path, and delta.
    """
    T = q.shape[2]
    tree = anc is not None
    if not tree:
        anc = mx.tril(mx.ones((T, T), dtype=mx.bool_))
        L = mx.cumsum(logg, axis=-1)  # [B, H, T]
    else:
        L = logg @ anc.astype(logg.dtype).T
    diff = L[..., :, None] - L[..., None, :]
    decay = mx.where(anc, mx.exp(mx.where(anc, diff, 0.0)), 0.0)
    strict = anc & ~mx.eye(T, dtype=mx.bool_)
    St = S.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    eL = mx.exp(L)[..., None]
    A = mx.where(strict, beta[..., None] * decay * (k @ k.swapaxes(-1, -2)), 0.0)
    rhs = beta[..., None] * (v - eL * (k @ St))
    delta = _unit_lower_inverse(A) @ rhs
    y = eL * (q @ St) + (decay * (q @ k.swapaxes(-1, -2))) @ delta
    S = _path_state(S, k, L, delta, anc[-1]) if tree else _advance(S, k, L, delta, T)
    return y, S, delta


def _path_state(S, k, L, delta, on_path):
    """State after the last token of a tree, summing its path only."""
    w = mx.where(on_path, mx.exp(L[..., -1:] - L), 0.0)[..., None]
    upd = (delta * w).swapaxes(-1, -2) @ k
    return mx.exp(L[..., -1])[..., None, None] * S + upd


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


def _steps(q, k, v, g, beta, state, parents, record):
    """A block token by token, each token the ops of :func:`_single_step`
    (tree: from its parent's state), so each row equals a single step's to
    the bit. Returns y, the state after the last token, and the tape."""
    ys, deltas, states = [], [], []
    S = state
    for t in range(q.shape[1]):
        if parents is not None:
            S = state if parents[t] < 0 else states[parents[t]]
        y, S, d = _single_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                               beta[:, t:t + 1], S, True)
        ys.append(y)
        deltas.append(d)
        if parents is not None:
            states.append(S)
    return mx.concatenate(ys, axis=1), S, mx.concatenate(deltas, axis=1) if record else None


def _replay(state0, k, g, delta, n):
    """State after the first ``n`` tokens of a stepwise tape: each step's
    state update of :func:`_single_step` again, with the recorded delta, so
    the rolled-back state is the one plain steps would have reached."""
    k = _repeat_heads(k, delta.shape[2])
    S = state0
    for t in range(n):
        S = S * g[:, t][..., None, None]
        S = S + k[:, t][..., None, :] * delta[:, t][..., None]
    return S


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
    force_twin: bool = False,
    stepwise: bool = False,
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
    few state-sized passes instead of 80. ``stepwise`` (a :func:`row_exact`
    verify): token by token instead, each row what a single step computes.
    """
    if use_metal(force_twin):
        extra = () if mask is None else (mask,)
        y, S, *tape = _metal_or_twin("chain", (bool(record),), (q, k, v, g, beta, state), extra)
        return y, S, tape[0] if record else None
    dtype = q.dtype
    T = q.shape[1]
    if T == 1 and mask is None:
        return _single_step(q, k, v, g, beta, state, record)
    if stepwise and mask is None:
        return _steps(q, k, v, g, beta, state, None, record)
    q, k, v, logg, beta = _prep(q, k, v, g, beta, mask)
    ys, deltas = [], []
    S = state
    for s in range(0, T, CHUNK):
        e = min(s + CHUNK, T)
        y, S, d = _chunk(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], logg[..., s:e], beta[..., s:e], S)
        ys.append(y)
        deltas.append(d)
    y = mx.concatenate(ys, axis=2) if len(ys) > 1 else ys[0]
    y = y.transpose(0, 2, 1, 3)
    if mask is not None:
        y = mx.where(mask[:, :, None, None], y, 0.0)  # padded tokens output 0
    y = y.astype(dtype)
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
    *,
    force_twin: bool = False,
    stepwise: bool = False,
) -> mx.array:
    """State after the first ``n`` tokens of a recorded block.

    ``state0`` is the state before the block; ``k`` [B, T, Hk, Dk] and ``g``
    [B, T, Hv] are what the forward used, ``delta`` [B, T, Hv, Dv] what it
    recorded. Applies S_n = exp(L_n) S_0 + sum_{s<n} exp(L_n - L_s) delta_s k_s^T:
    no q, no output, one matmul per chunk. ``stepwise``: a stepwise tape,
    replayed step by step (:func:`_replay`).
    """
    if n == 0:
        return state0
    if mask is None and use_metal(force_twin):
        return _metal_or_twin("rollback", (int(n),), (state0, k, g, delta))[0]
    if stepwise and mask is None:
        return _replay_compiled(int(n))(state0, k, g, delta)
    if mask is None:
        return _rollback_compiled(int(n))(state0, k, g, delta)
    return _rollback_twin(state0, k, g, delta, n, mask)


@lru_cache(maxsize=None)
def _rollback_compiled(n: int):
    """The twin rollback for a chain, compiled per n (a verify's one-line
    rollback is a dozen small ops: fused, they cost a fraction)."""
    return mx.compile(lambda state0, k, g, delta: _rollback_twin(state0, k, g, delta, n))


@lru_cache(maxsize=None)
def _replay_compiled(n: int):
    return mx.compile(lambda state0, k, g, delta: _replay(state0, k, g, delta, n))


def gated_delta_rollback_layers(tapes: Sequence[Tuple[mx.array, mx.array, mx.array, mx.array]], n: int,
                                *, force_twin: bool = False, stepwise: bool = False) -> List[mx.array]:
    """:func:`gated_delta_rollback` of several layers' chain tapes
    ``(state0, k, g, delta)`` to the same ``n``. Without the Metal kernels, layers of one
    shape are stacked along the batch and rolled back by one compiled
    function: a dozen small kernels for all of them instead of per layer
    (on a CPU most of a rollback's time is those launches)."""
    shapes = {tuple(tuple(x.shape) for x in tape) for tape in tapes}
    if use_metal(force_twin) or len(shapes) != 1 or n == 0 or stepwise:
        return [gated_delta_rollback(*tape, n, force_twin=force_twin, stepwise=stepwise) for tape in tapes]
    return _rollback_layers_compiled(int(n), len(tapes))(*(x for tape in tapes for x in tape))


@lru_cache(maxsize=None)
def _rollback_layers_compiled(n: int, count: int):
    def run(*xs):
        state0, k, g, delta = (mx.concatenate(xs[i::4], axis=0) for i in range(4))
        return mx.split(_rollback_twin(state0, k, g, delta, n), count, axis=0)
    return mx.compile(run)


def _rollback_twin(state0, k, g, delta, n: int, mask=None) -> mx.array:
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


def ancestor_matrix(parents: Sequence[int]) -> mx.array:
    """anc[t, s] = s is on the path from the root to t (t itself included).
    ``parents[t]`` < t, or -1 for a root. Cached: every layer of one tree
    verify asks for the same tree."""
    return _ancestor_matrix(tuple(parents))


MAX_TREE_DEPTH = 64  # deeper trees (never drafted: depth <= block size) take the twin


def tree_order(parents: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Depth-first preorder of a tree and each node's depth (0 for a root).

    Validates ``parents`` (each -1 or an earlier node), so the tree kernel,
    which reads states by depth, never indexes outside its stack."""
    return _tree_order(tuple(int(p) for p in parents))


@lru_cache(maxsize=16)
def _tree_order(parents: Tuple[int, ...]) -> Tuple[List[int], List[int]]:
    children: List[List[int]] = [[] for _ in parents]
    roots, depth = [], []
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"parent {p} of node {t} must be -1 or an earlier node")
        depth.append(0 if p < 0 else depth[p] + 1)
        (roots if p < 0 else children[p]).append(t)
    order, todo = [], roots[::-1]
    while todo:
        t = todo.pop()
        order.append(t)
        todo.extend(children[t][::-1])
    return order, depth


@lru_cache(maxsize=16)
def _ancestor_matrix(parents: Tuple[int, ...]) -> mx.array:
    T = len(parents)
    anc = np.zeros((T, T), dtype=bool)
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"parent {p} of node {t} must precede it")
        if p >= 0:
            anc[t] = anc[p]
        anc[t, t] = True
    return mx.array(anc)


def gated_delta_tree(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    parents: Sequence[int],
    *,
    record: bool = False,
    force_twin: bool = False,
    stepwise: bool = False,
) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """The gated delta rule over a tree of T tokens (tree verify).

    Token t starts from the state after its parent ``parents[t]`` (a root,
    parent -1, from ``state``). Shapes as :func:`gated_delta_chain`. Returns y,
    the state after the last token's path, and the tape ``delta``; restore any
    node with :func:`gated_delta_rollback` on its path's rows
    (:func:`path_rows`).
    """
    if q.shape[1] != len(parents):
        raise ValueError(f"{q.shape[1]} tokens but {len(parents)} parents")
    _, depth = tree_order(parents)
    if use_metal(force_twin) and max(depth) < MAX_TREE_DEPTH:
        static = (tuple(int(p) for p in parents), bool(record))
        y, S, *tape = _metal_or_twin("tree", static, (q, k, v, g, beta, state))
        return y, S, tape[0] if record else None
    if stepwise:
        return _steps(q, k, v, g, beta, state, [int(p) for p in parents], record)
    dtype = q.dtype
    q, k, v, logg, beta = _prep(q, k, v, g, beta, None)
    y, S, delta = _chunk(q, k, v, logg, beta, state, ancestor_matrix(parents))
    y = y.transpose(0, 2, 1, 3).astype(dtype)
    return y, S, delta.transpose(0, 2, 1, 3) if record else None


def path_rows(parents: Sequence[int], node: int) -> List[int]:
    """Token rows from the root to ``node``, root first."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def conv_windows(parents: Sequence[int], kernel_size: int) -> np.ndarray:
    """Row indices into ``concat(conv_state, block)`` of each token's K-row
    window, oldest first, gathered along the parent chain (chain: the usual
    sliding window). Rows 0..K-2 are the conv state, row K-1+t is token t.
    Cached per tree like :func:`ancestor_matrix`."""
    return _conv_windows(tuple(parents), kernel_size)


@lru_cache(maxsize=16)
def _conv_windows(parents: Tuple[int, ...], kernel_size: int) -> np.ndarray:
    K = kernel_size
    idx = np.zeros((len(parents), K), dtype=np.int32)
    for t in range(len(parents)):
        cur, back = t, 0  # back = rows taken from the conv state so far
        for j in range(K - 1, -1, -1):
            if cur >= 0:
                idx[t, j] = K - 1 + cur
                cur = parents[cur]
            else:
                back += 1
                idx[t, j] = K - 1 - back
    return idx


def causal_conv1d_silu(conv_in: mx.array, weight: mx.array,
                       parents: Optional[Sequence[int]] = None, *, force_twin: bool = False,
                       fused_exp: bool = False) -> mx.array:
    """Depthwise causal conv1d + SiLU.

    ``conv_in`` [B, K-1+T, C] is the conv state (the last K-1 pre-conv rows)
    followed by the block's T rows; ``weight`` [C, K, 1] (MLX layout).
    ``parents`` (tree mode): each token's window follows its parent chain.
    Returns [B, T, C]. K shifted multiply-adds: about twice as fast on a CPU
    as MLX's grouped conv1d for depthwise kernels. ``fused_exp``: the SiLU
    by :func:`silu_fused` (a verify block on a CPU).
    """
    K = weight.shape[1]
    T = conv_in.shape[1] - K + 1
    if use_metal(force_twin):
        static = None if parents is None else tuple(int(p) for p in parents)
        return _metal_or_twin("conv", (static,), (conv_in, weight))[0]
    dtype = conv_in.dtype
    x = conv_in.astype(mx.float32)  # accumulate in fp32, like the kernel
    w = weight[:, :, 0].astype(dtype).astype(mx.float32)
    if parents is not None:
        idx = conv_windows(parents, K)
        rows = [x[:, mx.array(idx[:, j])] for j in range(K)]
    else:
        rows = [x[:, j : j + T] for j in range(K)]
    out = rows[0] * w[:, 0]
    for j in range(1, K):
        out = out + rows[j] * w[:, j]
    # Round the conv to the input dtype, then SiLU in that dtype, as mlx-lm's
    # nn.silu(conv1d(x)) does (its conv accumulates in fp32 like this loop).
    return (silu_fused if fused_exp else nn.silu)(out.astype(dtype))


def conv_state_rollback(conv_in: mx.array, n: int, kernel_size: int) -> mx.array:
    """Conv state after the first ``n`` block tokens: rows n .. n+K-2 of
    ``concat(conv_state_prev, block)``."""
    return conv_in[:, n : n + kernel_size - 1]


# --- attention over a cache, on a CPU ------------------------------------------------
#
# MLX's CPU backend has no fused attention: mx.fast.scaled_dot_product_attention
# falls back to matmul, softmax, matmul, and its softmax computes one scalar
# exp per score (about 10 ns each here). A verify block of T rows over L
# cached keys pays H * T * L of them: at 3k keys that is most of the
# attention and a good part of the whole verify. The exp below is a fused,
# vectorisable one (Cody-Waite reduction to e^r, |r| <= ln2/2, and Cephes'
# expf polynomial: within 1 ulp of the exact exp), so the scores cost a few
# elementwise passes instead.

_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split: n * _LN2_HI is exact
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)  # e^r = 1 + r + r^2 * poly(r)


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


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None, *,
              decode_block: bool = False) -> mx.array:
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


# --- Metal kernels ----------------------------------------------------------------

METAL_DIR = Path(__file__).parent / "metal"


@dataclass
class Launch:
    """One mx.fast.metal_kernel call: what to bind and how many threads."""

    name: str  # metal/<name>.metal
    inputs: List[Tuple[str, object]]  # (name, mx.array or python scalar)
    outputs: List[Tuple[str, Tuple[int, ...], mx.Dtype]]
    template: List[Tuple[str, object]]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]


def metal_source(name: str) -> str:
    return (METAL_DIR / f"{name}.metal").read_text()


def use_metal(force_twin: bool = False) -> bool:
    return (not force_twin) and mx.metal.is_available() and mx.default_device() == mx.gpu


@lru_cache(maxsize=None)
def _compiled(name: str, inputs: Tuple[str, ...], outputs: Tuple[str, ...]):
    return mx.fast.metal_kernel(
        name=f"dflash_{name}", input_names=list(inputs), output_names=list(outputs),
        source=metal_source(name),
    )


def run_metal(launch: Launch) -> List[mx.array]:
    kern = _compiled(launch.name, tuple(n for n, _ in launch.inputs), tuple(n for n, _, _ in launch.outputs))
    return kern(
        inputs=[a for _, a in launch.inputs],
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[s for _, s, _ in launch.outputs],
        output_dtypes=[d for _, _, d in launch.outputs],
    )


def _twin_outputs(outs):
    return [o for o in outs if o is not None]


# kind -> (the Launch, the twin's outputs): functions of (static, *arrays).
def _conv_launch(static, conv_in, weight):
    (parents,) = static
    T = conv_in.shape[1] - weight.shape[1] + 1
    idx = conv_windows(parents if parents is not None else list(range(-1, T - 1)), weight.shape[1])
    return conv_launch(conv_in, weight, idx)


_KINDS = {
    "chain": (lambda st, *a: chain_launch(*a[:6], a[6] if len(a) > 6 else None, record=st[0]),
              lambda st, *a: _twin_outputs(gated_delta_chain(*a[:6], a[6] if len(a) > 6 else None, record=st[0],
                                                             force_twin=True))),
    "tree": (lambda st, *a: tree_launch(*a, st[0], record=st[1]),
             lambda st, *a: _twin_outputs(gated_delta_tree(*a, st[0], record=st[1], force_twin=True))),
    "rollback": (lambda st, *a: rollback_launch(*a, range(st[0])),
                 lambda st, *a: [gated_delta_rollback(*a, st[0], force_twin=True)]),
    "conv": (_conv_launch, lambda st, *a: [causal_conv1d_silu(*a, st[0], force_twin=True)]),
}


def _n_outputs(kind: str, static: tuple) -> int:
    if kind in ("chain", "tree"):
        return 3 if static[-1] else 2  # the tape only when recording
    return 1


@lru_cache(maxsize=64)
def _with_twin_vjp(kind: str, static: tuple, n_diff: int):
    """The Metal call of ``kind`` as an mx.custom_function whose VJP is the
    twin's; the first ``n_diff`` arguments are differentiable, the rest (a
    mask) are not. Cached: making one costs more than calling it."""
    launch, twin = _KINDS[kind]
    n_out = _n_outputs(kind, static)

    @mx.custom_function
    def f(*xs):
        return tuple(run_metal(launch(static, *xs))[:n_out])

    @f.vjp
    def f_vjp(xs, cotangents, outputs):
        cot = list(cotangents) if isinstance(cotangents, (list, tuple)) else [cotangents]
        rest = list(xs[n_diff:])
        grads = mx.vjp(lambda *a: twin(static, *a, *rest), list(xs[:n_diff]), cot)[1]
        return tuple(grads) + tuple(mx.zeros_like(x) for x in rest)

    return f


def _metal_or_twin(kind: str, static: tuple, primals: tuple, extra: tuple = ()) -> List[mx.array]:
    """Run the Metal kernel of ``kind``; differentiate through its twin.

    MLX has no VJP for a custom kernel (``[Primitive::vjp] Not implemented for
    CustomKernel``), as mlx-lm avoids by using its ops path when training. Here
    the forward stays the kernel and the gradient is the twin's, at the same
    inputs: ``nn.value_and_grad`` through the target works on a Mac GPU.
    ``static``: the call's Python arguments; ``extra``: arrays with no gradient.
    """
    return list(_with_twin_vjp(kind, static, len(primals))(*primals, *extra))


def packed_eligible(Dk: int, Dv: int) -> bool:
    """The packed layout (gated_delta_packed.metal) serves Dk = 128, the
    Qwen3.5 head size, as mlx-lm's packed prefill kernel does."""
    return Dk == 128 and Dv % 8 == 0


def chain_launch(q, k, v, g, beta, state, mask=None, *, record: bool = True,
                 packed: Optional[bool] = None) -> Launch:
    """``packed``: None = the packed layout where :func:`packed_eligible`."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if mask is None:
        mask = mx.ones((B, T), dtype=mx.bool_)
    if packed is None:
        packed = packed_eligible(Dk, Dv)
    inputs = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_in", state), ("T", T),
              ("mask", mask)]
    if packed:
        if Dk % 4 or Dv % 8:
            raise ValueError(f"the packed kernel needs Dk % 4 == 0 and Dv % 8 == 0, got Dk {Dk}, Dv {Dv}")
        name, grid, tg = "gated_delta_packed", (32, Dv // 8, B * Hv), (32, 2, 1)
    else:
        name, grid, tg = "gated_delta_chain", (32, Dv, B * Hv), (32, 4, 1)
    return Launch(
        name, inputs,
        [("y", (B, T, Hv, Dv), q.dtype), ("state_out", state.shape, state.dtype),
         ("delta", (B, T, Hv, Dv) if record else (1,), mx.float32)],
        [("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
         ("Record", bool(record))],
        grid, tg,
    )


def tree_launch(q, k, v, g, beta, state, parents, *, record: bool = True) -> Launch:
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    order, depth = tree_order(parents)
    max_depth = 1 << max(depth).bit_length()  # > deepest depth; one kernel per power of two
    return Launch(
        "gated_delta_tree",
        [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_in", state),
         ("order", mx.array(order, dtype=mx.int32)), ("depth", mx.array(depth, dtype=mx.int32)), ("T", T)],
        [("y", (B, T, Hv, Dv), q.dtype), ("state_out", state.shape, state.dtype),
         ("delta", (B, T, Hv, Dv) if record else (1,), mx.float32)],
        [("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
         ("MaxDepth", max_depth), ("Record", bool(record))],
        (32, Dv, B * Hv), (32, 4, 1),
    )


def rollback_launch(state0, k, g, delta, rows) -> Launch:
    B, T, Hk, Dk = k.shape
    Hv, Dv = delta.shape[2:]
    return Launch(
        "gated_delta_rollback",
        [("state0", state0), ("k", k), ("g", g), ("delta", delta),
         ("rows", mx.array(list(rows), dtype=mx.int32)), ("n", len(rows)), ("T", T)],
        [("state", state0.shape, state0.dtype)],
        [("InT", k.dtype), ("StT", state0.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        (Dk, Dv, B * Hv), (32, 4, 1),
    )


def conv_launch(conv_in, weight, idx) -> Launch:
    B, R, C = conv_in.shape
    T, K = idx.shape
    return Launch(
        "conv1d_silu",
        [("conv_in", conv_in), ("weight", weight[:, :, 0].astype(conv_in.dtype)),
         ("idx", mx.array(idx, dtype=mx.int32)), ("R", R), ("T", T)],
        [("out", (B, T, C), conv_in.dtype)],
        [("InT", conv_in.dtype), ("K", K), ("C", C)],
        (C, T, B), (min(C, 64), 1, 1),
    )
