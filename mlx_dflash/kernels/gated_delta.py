"""The gated delta rule (DeltaNet's recurrence): the MLX twin, rollback, the
Metal launches, and the dispatcher that picks the kernel or the twin.

Each public function has an MLX-ops body (the "twin") that is the reference
and runs on every backend; ``force_twin`` aside, the Metal kernel runs when
:func:`metal.use_metal` says so, decided at call time, and is differentiated
through the twin (:func:`metal.run_with_twin_vjp`). The ``*_launch``
functions describe each kernel's launch once, for the real dispatch and the
CPU test harness (tests/metal_harness.py).

Rollback design (docs/math.md §2-3): *tape*. The verify recurrence records, per token,
`delta_t = beta_t * (v_t - (g_t S_{t-1}) k_t)`. With the pre-verify state S_0
and the inputs k_t, g_t already at hand, rollback to n accepted tokens applies
`S_n = g_n...g_1 S_0 + sum_{t<=n} (g_n...g_{t+1}) delta_t k_t^T`: no q, no
output, Hv*Dv floats of memory per token instead of a full Hv*Dv*Dk state per
token (per-position capture) and no re-run of the projections (recompute).
Rolling back to the whole block keeps the forward's own final state.
"""

from functools import cache
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..ddtree import ancestor_matrix, tree_order
from . import metal
from .metal import Launch


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
        y, S, d = _single_step(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], S, True
        )
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
    few state-sized passes instead of 80. ``stepwise`` (a :func:`fused_exp.row_exact`
    verify): token by token instead, each row what a single step computes.
    """
    if metal.use_metal(force_twin):
        extra = () if mask is None else (mask,)
        y, S, *tape = metal.run_with_twin_vjp(
            _chain_kernel,
            _chain_twin_outputs,
            (bool(record),),
            (q, k, v, g, beta, state),
            extra,
            n_out=3 if record else 2,
        )
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
    if mask is None and metal.use_metal(force_twin):
        return metal.run_with_twin_vjp(_rollback_kernel, _rollback_twin_outputs, (int(n),), (state0, k, g, delta))[0]
    if stepwise and mask is None:
        return _replay_compiled(int(n))(state0, k, g, delta)
    if mask is None:
        return _rollback_compiled(int(n))(state0, k, g, delta)
    return _rollback_twin(state0, k, g, delta, n, mask)


@cache
def _rollback_compiled(n: int):
    """The twin rollback for a chain, compiled per n (a verify's one-line
    rollback is a dozen small ops: fused, they cost a fraction)."""
    return mx.compile(lambda state0, k, g, delta: _rollback_twin(state0, k, g, delta, n))


@cache
def _replay_compiled(n: int):
    return mx.compile(lambda state0, k, g, delta: _replay(state0, k, g, delta, n))


def gated_delta_rollback_layers(
    tapes: Sequence[Tuple[mx.array, mx.array, mx.array, mx.array]],
    n: int,
    *,
    force_twin: bool = False,
    stepwise: bool = False,
) -> List[mx.array]:
    """:func:`gated_delta_rollback` of several layers' chain tapes
    ``(state0, k, g, delta)`` to the same ``n``. Without the Metal kernels, layers of one
    shape are stacked along the batch and rolled back by one compiled
    function: a dozen small kernels for all of them instead of per layer
    (on a CPU most of a rollback's time is those launches)."""
    shapes = {tuple(tuple(x.shape) for x in tape) for tape in tapes}
    if metal.use_metal(force_twin) or len(shapes) != 1 or n == 0 or stepwise:
        return [gated_delta_rollback(*tape, n, force_twin=force_twin, stepwise=stepwise) for tape in tapes]
    return _rollback_layers_compiled(int(n), len(tapes))(*(x for tape in tapes for x in tape))


@cache
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


def gated_delta_rollback_slots(
    state0: mx.array,
    k: mx.array,
    g: mx.array,
    delta: mx.array,
    final: mx.array,
    ns: Sequence[int],
    *,
    stepwise: bool,
    paths: Optional[Sequence[Sequence[int]]] = None,
    force_twin: bool = False,
) -> mx.array:
    """:func:`gated_delta_rollback` of a chain tape whose batch rows are
    slots, slot b keeping its first ``ns[b]`` tokens; ``final`` is the
    forward's state after the block. Rows t >= n_b get no decay and no
    update (their delta zeroed, so the sum matches the solo rollback's to the
    bit), and a slot that keeps its whole block keeps the forward's own
    state, as the solo rollback does (the formula need not reproduce its bits).
    ``paths`` (a tree per slot): slot b keeps the block rows ``paths[b]``
    (root first, ``ns[b]`` of them), each slot as the solo rollback along a
    path (gathered rows, never ``final``).
    The Metal kernel (gated_delta_rollback_slots.metal) does all slots in
    one launch, replaying each slot's rows as the solo kernel does (there a
    slot keeping all T rows takes ``final``: the same bits)."""
    n = mx.array(list(ns), dtype=mx.int32)
    rows = None if paths is None else path_rows_array(paths, ns, delta.shape[1])
    if metal.use_metal(force_twin):
        extra = (n,) if rows is None else (n, rows)
        return metal.run_with_twin_vjp(
            _rollback_slots_kernel, _rollback_slots_twin_outputs, (bool(stepwise),), (state0, k, g, delta, final), extra
        )[0]
    return _rollback_slots_twin(bool(stepwise), state0, k, g, delta, final, n, rows, keep=max(ns))


def _rollback_slots_twin(stepwise: bool, state0, k, g, delta, final, n, rows=None, keep=None):
    if rows is None:
        T = delta.shape[1]
        if keep is not None and keep < T:  # rows no slot keeps: skip them (most of a wide block)
            k, g, delta = k[:, :keep], g[:, :keep], delta[:, :keep]
            return _rollback_slots_compiled(keep, stepwise, False)(state0, k, g, delta, final, n)
        return _rollback_slots_compiled(T, stepwise, True)(state0, k, g, delta, final, n)
    k = mx.take_along_axis(k, rows[:, :, None, None], axis=1)
    g = mx.take_along_axis(g, rows[:, :, None], axis=1)
    delta = mx.take_along_axis(delta, rows[:, :, None, None], axis=1)
    return _rollback_slots_compiled(rows.shape[1], stepwise, False)(state0, k, g, delta, final, n)


def path_rows_array(paths: Sequence[Sequence[int]], ns: Sequence[int], T: int) -> mx.array:
    """Each slot's path rows, padded with row 0 (never read) to [B, R]."""
    if len(paths) != len(ns):
        raise ValueError(f"{len(paths)} paths for {len(ns)} slots")
    for p, n in zip(paths, ns):
        if len(p) != n or not all(0 <= int(t) < T for t in p):
            raise ValueError(f"path {list(p)} is not {n} rows of a {T}-row block")
    width = max(1, max(len(p) for p in paths))
    return mx.array([[int(t) for t in p] + [0] * (width - len(p)) for p in paths], dtype=mx.int32)


@cache
def _rollback_slots_compiled(T: int, stepwise: bool, use_final: bool):
    # Compiled as the solo rollbacks are (_rollback_compiled, _replay_compiled):
    # the same fused ops, the same bits.
    def run(state0, k, g, delta, final, n):
        keep = mx.arange(T)[None, :] < n[:, None]  # [S, T]
        if stepwise:
            S = _replay_slots(state0, k, g, delta, keep)
        else:
            delta = mx.where(keep[:, :, None, None], delta, 0.0)
            S = _rollback_twin(state0, k, g, delta, T, keep)
        return mx.where((n == T)[:, None, None, None], final, S) if use_final else S

    return mx.compile(run)


def _replay_slots(state0, k, g, delta, keep):
    """:func:`_replay` with a per-slot stop: rows past a slot's count leave its state alone."""
    k = _repeat_heads(k, delta.shape[2])
    S = state0
    for t in range(delta.shape[1]):
        step = S * g[:, t][..., None, None]
        step = step + k[:, t][..., None, :] * delta[:, t][..., None]
        S = mx.where(keep[:, t][:, None, None, None], step, S)
    return S


MAX_TREE_DEPTH = 64  # deeper trees (never drafted: depth <= block size) take the twin


def slot_trees(parents, batch: int) -> Optional[Tuple[Tuple[int, ...], ...]]:
    """Trees per batch row (slots of batched decoding): ``parents`` given as
    one parents list per row, returned as tuples; None when ``parents`` is
    one tree for every row."""
    if len(parents) == 0 or np.ndim(parents[0]) == 0:
        return None
    if len(parents) != batch:
        raise ValueError(f"{len(parents)} parents lists for a batch of {batch}")
    return tuple(tuple(int(p) for p in row) for row in parents)


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
    (:func:`ddtree.path_rows`). ``parents`` may instead hold one list per
    batch row (slots, each its own tree of T nodes; :func:`slot_trees`): the
    Metal kernel runs all in one launch, the twin each row as a solo call.
    """
    trees = slot_trees(parents, q.shape[0])
    depth = 0
    for p in trees or (parents,):
        if q.shape[1] != len(p):
            raise ValueError(f"{q.shape[1]} tokens but {len(p)} parents")
        depth = max(depth, max(tree_order(p)[1]))
    if metal.use_metal(force_twin) and depth < MAX_TREE_DEPTH:
        static = (trees or tuple(int(p) for p in parents), bool(record))
        y, S, *tape = metal.run_with_twin_vjp(
            _tree_kernel, _tree_twin_outputs, static, (q, k, v, g, beta, state), n_out=3 if record else 2
        )
        return y, S, tape[0] if record else None
    if trees is not None:
        rows = [
            gated_delta_tree(
                *(x[b : b + 1] for x in (q, k, v, g, beta, state)),
                trees[b],
                record=record,
                force_twin=True,
                stepwise=stepwise,
            )
            for b in range(len(trees))
        ]
        ys, states, tapes = zip(*rows)
        return mx.concatenate(ys), mx.concatenate(states), mx.concatenate(tapes) if record else None
    if stepwise:
        return _steps(q, k, v, g, beta, state, [int(p) for p in parents], record)
    dtype = q.dtype
    q, k, v, logg, beta = _prep(q, k, v, g, beta, None)
    y, S, delta = _chunk(q, k, v, logg, beta, state, ancestor_matrix(parents))
    y = y.transpose(0, 2, 1, 3).astype(dtype)
    return y, S, delta.transpose(0, 2, 1, 3) if record else None


def packed_eligible(Dk: int, Dv: int) -> bool:
    """The packed layout (gated_delta_packed.metal) serves Dk = 128, the
    Qwen3.5 head size, as mlx-lm's packed prefill kernel does."""
    return Dk == 128 and Dv % 8 == 0


def chain_launch(q, k, v, g, beta, state, mask=None, *, record: bool = True, packed: Optional[bool] = None) -> Launch:
    """``packed``: None = the packed layout where :func:`packed_eligible`."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if mask is None:
        mask = mx.ones((B, T), dtype=mx.bool_)
    if packed is None:
        packed = packed_eligible(Dk, Dv)
    inputs = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_in", state), ("T", T), ("mask", mask)]
    if packed:
        if Dk % 4 or Dv % 8:
            raise ValueError(f"the packed kernel needs Dk % 4 == 0 and Dv % 8 == 0, got Dk {Dk}, Dv {Dv}")
        name, grid, tg = "gated_delta_packed", (32, Dv // 8, B * Hv), (32, 2, 1)
    else:
        name, grid, tg = "gated_delta_chain", (32, Dv, B * Hv), (32, 4, 1)
    return Launch(
        name,
        inputs,
        [
            ("y", (B, T, Hv, Dv), q.dtype),
            ("state_out", state.shape, state.dtype),
            ("delta", (B, T, Hv, Dv) if record else (1,), mx.float32),
        ],
        [
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("Record", bool(record)),
        ],
        grid,
        tg,
    )


def tree_launch(q, k, v, g, beta, state, parents, *, record: bool = True) -> Launch:
    """``parents``: one tree for every batch row, or one per row (:func:`slot_trees`)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    trees = slot_trees(parents, B) or (parents,) * B
    for p in trees:
        if len(p) != T:
            raise ValueError(f"{T} tokens but {len(p)} parents")
    order, depth = zip(*(tree_order(p) for p in trees))
    max_depth = 1 << max(max(d) for d in depth).bit_length()  # > deepest depth; one kernel per power of two
    return Launch(
        "gated_delta_tree",
        [
            ("q", q),
            ("k", k),
            ("v", v),
            ("g", g),
            ("beta", beta),
            ("state_in", state),
            ("order", mx.array(order, dtype=mx.int32)),
            ("depth", mx.array(depth, dtype=mx.int32)),
            ("T", T),
        ],
        [
            ("y", (B, T, Hv, Dv), q.dtype),
            ("state_out", state.shape, state.dtype),
            ("delta", (B, T, Hv, Dv) if record else (1,), mx.float32),
        ],
        [
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("MaxDepth", max_depth),
            ("Record", bool(record)),
        ],
        (32, Dv, B * Hv),
        (32, 4, 1),
    )


def rollback_launch(state0, k, g, delta, rows) -> Launch:
    B, T, Hk, Dk = k.shape
    Hv, Dv = delta.shape[2:]
    return Launch(
        "gated_delta_rollback",
        [
            ("state0", state0),
            ("k", k),
            ("g", g),
            ("delta", delta),
            ("rows", mx.array(list(rows), dtype=mx.int32)),
            ("n", len(rows)),
            ("T", T),
        ],
        [("state", state0.shape, state0.dtype)],
        [("InT", k.dtype), ("StT", state0.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        (Dk, Dv, B * Hv),
        (32, 4, 1),
    )


def rollback_slots_launch(state0, k, g, delta, final, counts, paths=None) -> Launch:
    """Slot b (batch row b) keeps ``counts[b]`` rows: its chain prefix, or
    with ``paths`` the rows ``paths[b]`` (a tree path, root first; or
    :func:`path_rows_array`'s [B, R]); a count >= T takes ``final``, the
    forward's state."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = delta.shape[2:]
    if paths is None:
        rows = mx.broadcast_to(mx.arange(T, dtype=mx.int32)[None], (B, T))
    elif isinstance(paths, mx.array):
        rows = paths
    else:
        rows = path_rows_array(paths, [len(p) for p in paths], T)
    return Launch(
        "gated_delta_rollback_slots",
        [
            ("state0", state0),
            ("k", k),
            ("g", g),
            ("delta", delta),
            ("state_final", final),
            ("rows", rows),
            ("counts", mx.array(counts, dtype=mx.int32)),
            ("R", rows.shape[1]),
            ("T", T),
        ],
        [("state", state0.shape, state0.dtype)],
        [("InT", k.dtype), ("StT", state0.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        (Dk, Dv, B * Hv),
        (32, 4, 1),
    )


# The Metal calls and their twins, as functions of (static, *arrays) for
# metal.run_with_twin_vjp: ``static`` holds the call's Python arguments.


def _without_none(outs):
    return [o for o in outs if o is not None]


def _chain_kernel(static, q, k, v, g, beta, state, mask=None):
    return chain_launch(q, k, v, g, beta, state, mask, record=static[0])


def _chain_twin_outputs(static, q, k, v, g, beta, state, mask=None):
    return _without_none(gated_delta_chain(q, k, v, g, beta, state, mask, record=static[0], force_twin=True))


def _tree_kernel(static, q, k, v, g, beta, state):
    return tree_launch(q, k, v, g, beta, state, static[0], record=static[1])


def _tree_twin_outputs(static, q, k, v, g, beta, state):
    return _without_none(gated_delta_tree(q, k, v, g, beta, state, static[0], record=static[1], force_twin=True))


def _rollback_kernel(static, state0, k, g, delta):
    return rollback_launch(state0, k, g, delta, range(static[0]))


def _rollback_twin_outputs(static, state0, k, g, delta):
    return [gated_delta_rollback(state0, k, g, delta, static[0], force_twin=True)]


def _rollback_slots_kernel(static, state0, k, g, delta, final, n, rows=None):
    return rollback_slots_launch(state0, k, g, delta, final, n, rows)


def _rollback_slots_twin_outputs(static, state0, k, g, delta, final, n, rows=None):
    return [_rollback_slots_twin(static[0], state0, k, g, delta, final, n, rows)]
