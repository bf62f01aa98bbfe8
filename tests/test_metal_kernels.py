"""The Metal kernels against their MLX twins.

On Linux every kernel's Metal source is executed by the CPU harness
(metal_harness.py), its threads in several orders; on macOS the real kernels
also run on the GPU. tests/test_msl_strict.py checks the sources as MLX
wraps them against a strict MSL front end.
"""

import subprocess
from pathlib import Path

import metal_harness as H
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash import ddtree
from mlx_dflash.kernels import conv, gated_delta, metal

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    ks = mx.random.split(mx.random.key(seed), 6)
    q = (mx.random.normal((B, T, Hk, Dk), key=ks[0]) * 0.3).astype(dtype)
    k = (mx.random.normal((B, T, Hk, Dk), key=ks[1]) * 0.3).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
    g = mx.random.uniform(0.3, 1.0, (B, T, Hv), key=ks[3]).astype(dtype)
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=ks[4]).astype(dtype)
    s0 = mx.random.normal((B, Hv, Dv, Dk), key=ks[5]) * 0.5
    return q, k, v, g, beta, s0


def close(got, want, dtype=mx.float32):
    """fp32: 1e-5 relative to the tensor's scale; fp16/bf16 inputs: 1e-3, and one
    unit in the last place of a low-precision output (rounding of near-ties)."""
    got = np.array(got.astype(mx.float32))
    want = np.array(want.astype(mx.float32))
    scale = max(1.0, float(np.abs(want).max()))
    tol = 1e-5 if dtype == mx.float32 else 1e-3
    ulp = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    err = np.abs(got - want)
    return bool(np.all(err <= tol * scale + ulp * np.abs(want)))


SHAPES = [  # B, T, Hk, Hv, Dk, Dv
    (1, 1, 1, 1, 32, 4),
    (1, 16, 2, 4, 64, 8),
    (2, 7, 1, 3, 40, 5),  # odd T, Dk not a multiple of 32, GQA factor 3
]


def both(a, b):
    return all(close(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_chain_kernel_matches_twin(shape, dtype):
    q, k, v, g, beta, s0 = inputs(*shape, dtype)
    B, T = shape[:2]
    for mask in (None, mx.array(np.random.default_rng(1).random((B, T)) > 0.3)):
        y, S, d = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0, mask, packed=False))
        ry, rS, rd = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, mask, record=True, force_twin=True)
        assert y.dtype == dtype
        assert close(y, ry, dtype) and close(S, rS, dtype) and close(d, rd, dtype), (shape, dtype, mask is None)


PACKED = [  # B, T, Hk, Hv, Dk, Dv: the dispatch's Dk = 128 case, and smaller Dk forced
    (1, 5, 1, 2, 128, 8),
    (2, 9, 2, 4, 32, 16),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PACKED)
def test_packed_kernel_matches_twin(shape, dtype):
    q, k, v, g, beta, s0 = inputs(*shape, dtype, seed=2)
    B, T = shape[:2]
    launch = gated_delta.chain_launch(q, k, v, g, beta, s0, packed=True)
    assert launch.name == "gated_delta_packed" and launch.threadgroup == (32, 2, 1)
    if shape[4] == 128:
        assert gated_delta.chain_launch(q, k, v, g, beta, s0).name == "gated_delta_packed"
    for mask in (None, mx.array(np.random.default_rng(3).random((B, T)) > 0.3)):
        y, S, d = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0, mask, packed=True))
        ry, rS, rd = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, mask, record=True, force_twin=True)
        assert close(y, ry, dtype) and close(S, rS, dtype) and close(d, rd, dtype), (shape, dtype)


@pytest.mark.parametrize("packed", [False, True], ids=["simd", "packed"])
def test_record_flag_writes_the_tape_only_when_recording(packed):
    q, k, v, g, beta, s0 = inputs(1, 6, 1, 2, 32, 8, mx.float32, seed=5)
    y, S, d = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0, record=True, packed=packed))
    launch = gated_delta.chain_launch(q, k, v, g, beta, s0, record=False, packed=packed)
    assert launch.outputs[2][1] == (1,)  # no T x Hv x Dv fp32 buffer when not recording
    y2, S2, d2 = H.run(launch)
    assert np.array_equal(np.array(y), np.array(y2)) and np.array_equal(np.array(S), np.array(S2))
    assert np.isnan(np.array(d2)).all()  # the placeholder is never written (0xff bytes = NaN)


TREES = [
    [-1],
    [-1, 0, 1, 0, 3, 2, 5, 3, 7],
    [-1, 0, 0, 0, 1, 1, 2, 4, 4, 8, 9, 9, 3],
    [-1, 0, -1, 1, 2, 0, 5, 6, 6, 2],  # two roots, the last node not in preorder position
]


def random_tree(n, seed, depth_limit=16):
    """A DDTree-like tree: n nodes, each below an earlier node, depth <= depth_limit."""
    rng = np.random.default_rng(seed)
    parents, depth = [-1], [0]
    while len(parents) < n:
        p = int(rng.integers(0, len(parents)))
        if depth[p] + 1 < depth_limit:
            parents.append(p)
            depth.append(depth[p] + 1)
    return parents


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parents", TREES, ids=len)
def test_tree_kernel_matches_twin(parents, dtype):
    T = len(parents)
    q, k, v, g, beta, s0 = inputs(1, T, 2, 4, 40, 6, dtype, seed=T)
    y, S, d = H.run(gated_delta.tree_launch(q, k, v, g, beta, s0, parents))
    ry, rS, rd = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
    assert close(y, ry, dtype) and close(S, rS, dtype) and close(d, rd, dtype)


def test_tree_kernel_large_budget_keeps_a_bounded_stack():
    parents = random_tree(256, seed=1)
    launch_depth = dict(gated_delta.tree_launch(*inputs(1, 256, 1, 1, 32, 2, mx.float32), parents).template)["MaxDepth"]
    assert launch_depth <= 16  # registers follow the depth, not the 256 nodes
    q, k, v, g, beta, s0 = inputs(1, 256, 1, 1, 32, 2, mx.float32, seed=8)
    got = H.run(gated_delta.tree_launch(q, k, v, g, beta, s0, parents))
    want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
    assert both(got, want)


def test_tree_parents_are_validated(monkeypatch):
    q, k, v, g, beta, s0 = inputs(1, 3, 1, 1, 32, 2, mx.float32)
    for bad in ([-1, 1, 0], [-1, 0, 5], [-1, -2, 0], [0, 0, 1]):
        with pytest.raises(ValueError, match="parent"):
            gated_delta.tree_launch(q, k, v, g, beta, s0, bad)
        with pytest.raises(ValueError, match="parent"):
            gated_delta.gated_delta_tree(q, k, v, g, beta, s0, bad, force_twin=True)
    # A tree deeper than MAX_TREE_DEPTH takes the twin even with Metal selected.
    monkeypatch.setattr(metal, "use_metal", lambda force_twin=False: not force_twin)
    monkeypatch.setattr(metal, "run_metal", lambda launch: pytest.fail("deep tree sent to Metal"))
    T = gated_delta.MAX_TREE_DEPTH + 1
    q, k, v, g, beta, s0 = inputs(1, T, 1, 1, 32, 2, mx.float32)
    gated_delta.gated_delta_tree(q, k, v, g, beta, s0, list(range(-1, T - 1)))


def test_tree_order_is_a_preorder():
    parents = TREES[3]
    order, depth = ddtree.tree_order(parents)
    assert sorted(order) == list(range(len(parents)))
    for r, t in enumerate(order):  # every node after its parent, its parent the last node one level up
        p = parents[t]
        assert depth[t] == (0 if p < 0 else depth[p] + 1)
        if p >= 0:
            above = [u for u in order[:r] if depth[u] == depth[t] - 1]
            assert above[-1] == p


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_rollback_kernel_matches_twin(dtype):
    parents = TREES[2]
    T = len(parents)
    q, k, v, g, beta, s0 = inputs(1, T, 2, 4, 40, 6, dtype, seed=3)
    _, _, tape = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
    for node in (0, 4, 10, 12):
        rows = ddtree.path_rows(parents, node)
        (got,) = H.run(gated_delta.rollback_launch(s0, k, g, tape, rows))
        P = mx.array(rows)
        want = gated_delta.gated_delta_rollback(s0, k[:, P], g[:, P], tape[:, P], len(rows), force_twin=True)
        assert close(got, want, dtype)
    # A chain prefix.
    _, _, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    (got,) = H.run(gated_delta.rollback_launch(s0, k, g, tape, range(7)))
    assert close(got, gated_delta.gated_delta_rollback(s0, k, g, tape, 7, force_twin=True), dtype)


def bits(a):
    return np.array(a.astype(mx.float32)).view(np.uint32)


@pytest.mark.parametrize("packed", [False, True], ids=["simd", "packed"])
def test_rollback_replays_the_forward_state_bit_for_bit(packed):
    """The state after a partial accept, rebuilt from the tape, is the forward's
    own state after those tokens, to the bit (same fma in both kernels)."""
    T, n = 9, 5
    q, k, v, g, beta, s0 = inputs(1, T, 2, 4, 128 if packed else 40, 8, mx.bfloat16, seed=6)
    _, _, tape = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0, packed=packed))
    _, S_n, _ = H.run(gated_delta.chain_launch(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0, packed=packed))
    (R_n,) = H.run(gated_delta.rollback_launch(s0, k, g, tape, range(n)))
    assert np.array_equal(bits(S_n), bits(R_n))
    # Tree: the forward's state after node T-1's path, replayed along that path.
    parents = TREES[1]
    q, k, v, g, beta, s0 = inputs(1, len(parents), 2, 4, 40, 8, mx.bfloat16, seed=7)
    _, S, tape = H.run(gated_delta.tree_launch(q, k, v, g, beta, s0, parents))
    (R,) = H.run(gated_delta.rollback_launch(s0, k, g, tape, ddtree.path_rows(parents, len(parents) - 1)))
    assert np.array_equal(bits(S), bits(R))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parents", [None, TREES[1]], ids=["chain", "tree"])
def test_conv_kernel_matches_twin(parents, dtype):
    K, C, T = 4, 70, 9  # C > one threadgroup of 64: a partial edge group
    conv_in = mx.random.normal((2, K - 1 + T, C), key=mx.random.key(4)).astype(dtype)
    weight = (mx.random.normal((C, K, 1), key=mx.random.key(5)) * 0.5).astype(dtype)
    chain = list(range(-1, T - 1))
    idx = conv.conv_windows(parents if parents is not None else chain, K)
    (got,) = H.run(conv.conv_launch(conv_in, weight, idx))
    want = conv.causal_conv1d_silu(conv_in, weight, parents, force_twin=True)
    assert got.dtype == dtype and close(got, want, dtype)


# --- batched decoding: slots stacked along B, each slot its own count ---------------

# (B, T, Hk, Hv, Dk, Dv) and the kept counts: none, ragged, the whole block. One
# template (B and T are not compiled in), so one harness build per dtype.
SLOT_SHAPES = [
    ((4, 7, 2, 4, 40, 6), [0, 3, 7, 1]),
    ((3, 16, 2, 4, 40, 6), [16, 5, 0]),
]


def bits_equal(a, b):
    return np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,ns", SLOT_SHAPES, ids=["B4-T7", "B3-T16"])
def test_rollback_slots_kernel_matches_twin(shape, ns, dtype):
    """One launch rolls every slot back to its own count: the twins' states
    (closed form and stepwise) in every thread order; a slot keeping
    nothing is its pre-block state and one keeping its whole block the
    forward's own, to the bit."""
    q, k, v, g, beta, s0 = inputs(*shape, dtype, seed=12)
    T = shape[1]
    _, final, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    launch = gated_delta.rollback_slots_launch(s0, k, g, tape, final, ns)
    (got,) = H.run(launch)
    for stepwise in (False, True):
        want = gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, ns, stepwise=stepwise, force_twin=True)
        assert close(got, want, dtype), stepwise
    for b, n in enumerate(ns):
        solo = gated_delta.gated_delta_rollback(s0[b : b + 1], k[b : b + 1], g[b : b + 1], tape[b : b + 1], n)
        assert close(got[b : b + 1], solo, dtype), b
        if n in (0, T):
            assert bits_equal(got[b], s0[b] if n == 0 else final[b]), b
    for order in H.ORDERS[1:]:
        assert bits_equal(H.run(launch, order=order)[0], got), order


@pytest.mark.parametrize("packed", [False, True], ids=["simd", "packed"])
def test_rollback_slots_replays_each_slots_forward_bit_for_bit(packed):
    """The slots' chain forward (B = 4) gives each slot the rows and state
    its solo forward gives, to the bit; rolled back to ragged counts, each
    slot's state is its solo forward's after those tokens, to the bit."""
    B, T, ns = 4, 9, [5, 0, 9, 1]
    q, k, v, g, beta, s0 = inputs(B, T, 2, 4, 128 if packed else 40, 8, mx.bfloat16, seed=13)
    y, final, tape = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0, packed=packed))
    (R,) = H.run(gated_delta.rollback_slots_launch(s0, k, g, tape, final, ns))
    for b, n in enumerate(ns):
        one = lambda x, n=T: x[b : b + 1, :n]  # noqa: E731
        y_b, S_b, _ = H.run(gated_delta.chain_launch(one(q), one(k), one(v), one(g), one(beta), s0[b : b + 1]))
        assert bits_equal(y_b, y[b : b + 1]) and bits_equal(S_b, final[b : b + 1]), b
        if n:
            S_b = H.run(
                gated_delta.chain_launch(one(q, n), one(k, n), one(v, n), one(g, n), one(beta, n), s0[b : b + 1])
            )[1]
        else:
            S_b = s0[b : b + 1]
        assert bits_equal(R[b : b + 1], S_b), (b, n)


@pytest.mark.parametrize(
    "mutation",
    [
        ("const int n = counts[b];", "const int n = counts[0];"),  # every slot takes slot 0's count
        ("state[at] = state_final[at];", "state[at] = state_final[at % (Hv * Dv * Dk)];"),  # slot 0's final
        ("g[(b * T + t) * Hv + hv]", "g[t * Hv + hv]"),  # slot 0's decay for every slot
    ],
)
def test_harness_rejects_a_rollback_slots_kernel_with_broken_slot_indexing(mutation):
    shape, ns = SLOT_SHAPES[0]
    q, k, v, g, beta, s0 = inputs(*shape, mx.float32, seed=14)
    _, final, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    launch = gated_delta.rollback_slots_launch(s0, k, g, tape, final, ns)
    want = gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, ns, stepwise=False, force_twin=True)
    src = metal.metal_source("gated_delta_rollback_slots")
    old, new = mutation
    assert old in src
    assert close(H.run(launch)[0], want)
    assert not close(H.run(launch, source=src.replace(old, new))[0], want)


def test_rollback_slots_dispatches_to_the_kernel_when_metal_is_selected(monkeypatch):
    shape, ns = SLOT_SHAPES[0]
    q, k, v, g, beta, s0 = inputs(*shape, mx.float32, seed=15)
    _, final, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    want = gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, ns, stepwise=False, force_twin=True)
    ran = []
    monkeypatch.setattr(metal, "use_metal", lambda force_twin=False: not force_twin)
    monkeypatch.setattr(metal, "run_metal", lambda launch: ran.append(launch.name) or H.run(launch))
    got = gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, ns, stepwise=False)
    assert ran == ["gated_delta_rollback_slots"] and close(got, want)


SLOT_TREES = [TREES[3], random_tree(10, seed=3), list(range(-1, 9))]  # ten nodes each, three shapes of tree


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_kernel_with_a_tree_per_slot_matches_twin(dtype):
    """Each batch row (slot) verifies its own tree in one launch: the twin's
    outputs in every thread order, and each slot's rows, state and tape
    are its solo launch's, to the bit."""
    B, T = len(SLOT_TREES), len(SLOT_TREES[0])
    q, k, v, g, beta, s0 = inputs(B, T, 2, 4, 40, 6, dtype, seed=16)
    launch = gated_delta.tree_launch(q, k, v, g, beta, s0, SLOT_TREES)
    got = H.run(launch)
    want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, SLOT_TREES, record=True, force_twin=True)
    assert all(close(a, b, dtype) for a, b in zip(got, want))
    for b, parents in enumerate(SLOT_TREES):
        one = [x[b : b + 1] for x in (q, k, v, g, beta, s0)]
        solo = H.run(gated_delta.tree_launch(*one, parents))
        assert all(bits_equal(a[b : b + 1], s) for a, s in zip(got, solo)), b
        twin = gated_delta.gated_delta_tree(*one, parents, record=True, force_twin=True)
        assert all(bits_equal(a[b : b + 1], s) for a, s in zip(want, twin)), b
    for order in H.ORDERS[1:]:
        assert all(bits_equal(a, b) for a, b in zip(H.run(launch, order=order), got)), order


def test_per_slot_trees_are_validated():
    q, k, v, g, beta, s0 = inputs(2, 3, 1, 1, 32, 2, mx.float32)
    for bad in ([[-1, 0, 1], [-1, 0, 5]], [[-1, 0, 1], [-1, 0]], [[-1, 0, 1]] * 3):
        with pytest.raises(ValueError, match="parent"):
            gated_delta.tree_launch(q, k, v, g, beta, s0, bad)
        with pytest.raises(ValueError, match="parent"):
            gated_delta.gated_delta_tree(q, k, v, g, beta, s0, bad, force_twin=True)
    with pytest.raises(ValueError, match="parent"):
        conv.causal_conv1d_silu(mx.zeros((2, 6, 8)), mx.zeros((8, 4, 1)), [[-1, 0, 1], [-1, 0]], force_twin=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_kernel_with_a_tree_per_slot_matches_twin(dtype):
    K, C, T = 4, 70, len(SLOT_TREES[0])
    conv_in = mx.random.normal((3, K - 1 + T, C), key=mx.random.key(6)).astype(dtype)
    weight = (mx.random.normal((C, K, 1), key=mx.random.key(7)) * 0.5).astype(dtype)
    idx = np.stack([conv.conv_windows(p, K) for p in SLOT_TREES])
    (got,) = H.run(conv.conv_launch(conv_in, weight, idx))
    want = conv.causal_conv1d_silu(conv_in, weight, SLOT_TREES, force_twin=True)
    assert close(got, want, dtype)
    for b, parents in enumerate(SLOT_TREES):
        solo = conv.causal_conv1d_silu(conv_in[b : b + 1], weight, parents, force_twin=True)
        assert bits_equal(want[b : b + 1], solo), b
        (solo_kernel,) = H.run(conv.conv_launch(conv_in[b : b + 1], weight, idx[b]))
        assert bits_equal(got[b : b + 1], solo_kernel), b


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_rollback_slots_along_each_slots_tree_path_bit_for_bit(dtype, monkeypatch):
    """After a tree per slot, each slot rolled back along its own accepted
    path (ragged lengths) in one call: the kernel's state is the solo
    kernel's along that path, the twin's (closed form in fp32, stepwise in
    bf16, as a verify runs) the solo twin's, each to the bit."""
    B, T = len(SLOT_TREES), len(SLOT_TREES[0])
    stepwise = dtype != mx.float32
    q, k, v, g, beta, s0 = inputs(B, T, 2, 4, 40, 8, dtype, seed=17)
    _, final, tape = H.run(gated_delta.tree_launch(q, k, v, g, beta, s0, SLOT_TREES))
    paths = [ddtree.path_rows(p, node) for p, node in zip(SLOT_TREES, (9, 4, 6))]
    ns = [len(p) for p in paths]
    launch = gated_delta.rollback_slots_launch(s0, k, g, tape, final, ns, paths)
    (got,) = H.run(launch)
    twin = gated_delta.gated_delta_rollback_slots(
        s0, k, g, tape, final, ns, stepwise=stepwise, paths=paths, force_twin=True
    )
    for b, path in enumerate(paths):
        one = [x[b : b + 1] for x in (s0, k, g, tape)]
        (solo,) = H.run(gated_delta.rollback_launch(*one, path))
        assert bits_equal(got[b : b + 1], solo), b
        P = mx.array(path)  # what DeltaNetState.rollback does along a path
        solo_twin = gated_delta.gated_delta_rollback(
            one[0], one[1][:, P], one[2][:, P], one[3][:, P], len(path), stepwise=stepwise
        )
        assert bits_equal(twin[b : b + 1], solo_twin), b
    assert close(got, twin, dtype)
    mutated = metal.metal_source("gated_delta_rollback_slots").replace("rows[b * R + r]", "rows[r]")
    assert not bits_equal(H.run(launch, source=mutated)[0], got)
    with pytest.raises(ValueError, match="path"):
        gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, [2, 2, 2], stepwise=False, paths=paths)
    monkeypatch.setattr(metal, "use_metal", lambda force_twin=False: not force_twin)
    monkeypatch.setattr(metal, "run_metal", H.run)
    assert bits_equal(
        gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, ns, stepwise=False, paths=paths), got
    )


@pytest.mark.parametrize(
    "name,mutation",
    [
        ("gated_delta_tree", ("order[b * T + r]", "order[r]")),  # slot 0's visiting order for every slot
        ("gated_delta_tree", ("depth[b * T + t]", "depth[t]")),  # slot 0's depths for every slot
        ("conv1d_silu", ("idx[(b * T + t) * K + j]", "idx[t * K + j]")),  # slot 0's windows for every slot
    ],
)
def test_harness_rejects_per_slot_tree_kernels_reading_slot_zeros_tree(name, mutation):
    B, T = len(SLOT_TREES), len(SLOT_TREES[0])
    if name == "conv1d_silu":
        conv_in = mx.random.normal((B, 3 + T, 70), key=mx.random.key(8))
        weight = mx.random.normal((70, 4, 1), key=mx.random.key(9))
        launch = conv.conv_launch(conv_in, weight, np.stack([conv.conv_windows(p, 4) for p in SLOT_TREES]))
        want = [conv.causal_conv1d_silu(conv_in, weight, SLOT_TREES, force_twin=True)]
    else:
        q, k, v, g, beta, s0 = inputs(B, T, 2, 4, 40, 6, mx.float32, seed=18)
        launch = gated_delta.tree_launch(q, k, v, g, beta, s0, SLOT_TREES)
        want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, SLOT_TREES, record=True, force_twin=True)
    old, new = mutation
    src = metal.metal_source(name)
    assert old in src
    assert both(H.run(launch), want)
    assert not both(H.run(launch, source=src.replace(old, new)), want)


def test_per_slot_trees_dispatch_to_one_launch_when_metal_is_selected(monkeypatch):
    B, T = len(SLOT_TREES), len(SLOT_TREES[0])
    q, k, v, g, beta, s0 = inputs(B, T, 2, 4, 40, 6, mx.float32, seed=19)
    conv_in = mx.random.normal((B, 3 + T, 70), key=mx.random.key(8))
    weight = mx.random.normal((70, 4, 1), key=mx.random.key(9))
    want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, SLOT_TREES, record=True, force_twin=True)
    want_conv = conv.causal_conv1d_silu(conv_in, weight, SLOT_TREES, force_twin=True)
    ran = []
    monkeypatch.setattr(metal, "use_metal", lambda force_twin=False: not force_twin)
    monkeypatch.setattr(metal, "run_metal", lambda launch: ran.append(launch.name) or H.run(launch))
    assert both(gated_delta.gated_delta_tree(q, k, v, g, beta, s0, SLOT_TREES, record=True), want)
    assert close(conv.causal_conv1d_silu(conv_in, weight, SLOT_TREES), want_conv)
    assert ran == ["gated_delta_tree", "conv1d_silu"]


def small_launches():
    q, k, v, g, beta, s0 = inputs(1, 5, 2, 4, 64, 8, mx.float32, seed=9)
    conv_in = mx.random.normal((1, 8, 70), key=mx.random.key(1))
    w = mx.random.normal((70, 4, 1), key=mx.random.key(2))
    _, _, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    return {
        "chain": gated_delta.chain_launch(q, k, v, g, beta, s0, packed=False),
        "packed": gated_delta.chain_launch(q, k, v, g, beta, s0, packed=True),
        "tree": gated_delta.tree_launch(q, k, v, g, beta, s0, [-1, 0, 0, 1, 2]),
        "rollback": gated_delta.rollback_launch(s0, k, g, tape, range(3)),
        "conv": conv.conv_launch(conv_in, w, conv.conv_windows(list(range(-1, 4)), 4)),
    }


def test_real_kernels_do_not_depend_on_thread_order():
    for name, launch in small_launches().items():
        first = H.run(launch)
        for order in H.ORDERS[1:]:
            again = H.run(launch, order=order)
            for a, b in zip(first, again):
                assert np.array_equal(np.array(a), np.array(b), equal_nan=True), (name, order)


# --- the harness catches broken kernels and executes threadgroup semantics ---------


@pytest.mark.parametrize(
    "mutation",
    [
        ("hv / (Hv / Hk)", "hv % Hk"),  # wrong GQA head mapping
        ("kv = simd_sum(kv);", ""),  # a lane-local reduction
        ("s[j] = s[j] * gt;", "s[j] = s[j] * gt * gt;"),  # wrong decay
    ],
)
def test_harness_rejects_a_mutated_kernel(mutation):
    q, k, v, g, beta, s0 = inputs(1, 5, 2, 4, 64, 4, mx.float32)
    src = metal.metal_source("gated_delta_chain")
    old, new = mutation
    assert old in src
    y, S, d = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0), source=src.replace(old, new))
    ry, rS, rd = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    assert not (close(y, ry) and close(S, rS) and close(d, rd))


def caught_in_some_order(launch, source, want):
    """The outputs of ``source`` differ from ``want`` under at least one thread order."""
    results = []
    for order in H.ORDERS:
        got = H.run(launch, source=source, order=order)
        results.append(all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got, want)))
    return not all(results), results


def test_reading_a_neighbours_result_is_caught():
    """A thread that reads a value its neighbour wrote to device memory, with
    nothing ordering the two: right in index order (the neighbour already
    ran), wrong in reverse: only a reordering harness sees it."""
    src = """
    const uint i = thread_position_in_grid.x;
    mid[i] = inp[i] * 2.0f;
    out[i] = i > 0 ? mid[i - 1] : 0.0f;
    """
    x = mx.arange(64, dtype=mx.float32)
    launch = _launch(
        "n", [("inp", x)], [("mid", (64,), mx.float32), ("out", (64,), mx.float32)], (64, 1, 1), (64, 1, 1)
    )
    want = [x * 2, mx.concatenate([mx.zeros(1), x[:-1] * 2])]
    caught, per_order = caught_in_some_order(launch, src, want)
    assert caught and per_order[0], per_order  # index order alone would have passed it


BARRIER_SRC = """
threadgroup float buf[64];
const uint l = thread_position_in_threadgroup.x;
buf[l] = inp[thread_position_in_grid.x];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[thread_position_in_grid.x] = buf[threads_per_threadgroup.x - 1 - l];
"""


def _launch(name, source_inputs, outputs, grid, tg):
    return metal.Launch(name, source_inputs, outputs, [], grid, tg)


def test_harness_threadgroup_memory_and_barrier():
    x = mx.arange(128, dtype=mx.float32)
    launch = _launch("t", [("inp", x)], [("out", (128,), mx.float32)], (128, 1, 1), (64, 1, 1))
    want = np.concatenate([np.arange(63, -1, -1), np.arange(127, 63, -1)])
    for order in H.ORDERS:
        (out,) = H.run(launch, source=BARRIER_SRC, order=order)
        assert np.array_equal(np.array(out), want), order
    # Without the barrier some order reads slots not yet written.
    caught, _ = caught_in_some_order(
        launch,
        BARRIER_SRC.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", ""),
        [mx.array(want.astype(np.float32))],
    )
    assert caught


def test_a_missing_barrier_in_a_real_kernel_layout_is_caught():
    """The chain kernel with its q/k row staged in threadgroup memory (the
    usual optimisation): correct with the barrier in every order; without it,
    wrong in some order."""
    src = metal.metal_source("gated_delta_chain")
    old = "  const float gt = static_cast<float>(g[gb]);\n"
    assert old in src
    staged = (
        old + "  threadgroup float kq[4][Dk];\n"
        "  const uint row = thread_position_in_threadgroup.y;\n"
        "  for (int j = 0; j < NPL; ++j) { const uint i = lane + 32 * j; if (i < Dk) kq[row][i] = k[qk + i]; }\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
    )
    good = src.replace(old, staged).replace(
        "kv += s[j] * static_cast<float>(k[qk + i]);", "kv += s[j] * kq[row][(i + 1) % Dk];"
    )
    q, k, v, g, beta, s0 = inputs(1, 4, 1, 4, 64, 8, mx.float32, seed=11)
    # The staged kernel reads the key of column i + 1: a reference run with the
    # barrier fixes what the right answer of this variant is, in every order.
    launch = gated_delta.chain_launch(q, k, v, g, beta, s0, packed=False)
    want = H.run(launch, source=good)
    for order in H.ORDERS[1:]:
        again = H.run(launch, source=good, order=order)
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(want, again))
    # The barrier is uniform here; dropping it lets a lane read column i + 1
    # before lane i + 1 of the same row wrote it.
    caught, _ = caught_in_some_order(
        launch, good.replace("  threadgroup_barrier(mem_flags::mem_threadgroup);\n", ""), want
    )
    assert caught


def test_harness_simd_shuffle_and_partial_simd_groups():
    src = """
    const uint i = thread_position_in_grid.x;
    const float x = inp[i];
    out[i] = simd_shuffle(x, (thread_index_in_simdgroup + 1) % 32) + 1000.0f * simd_sum(1.0f);
    """
    x = mx.arange(40, dtype=mx.float32)  # one full SIMD group and one of 8 lanes
    (out,) = H.run(_launch("s", [("inp", x)], [("out", (40,), mx.float32)], (40, 1, 1), (64, 1, 1)), source=src)
    out = np.array(out)
    assert np.array_equal(out[:31], np.arange(1, 32) + 32000)
    assert out[31] == 0 + 32000  # lane 31 reads lane 0
    assert np.array_equal(out[32:39], np.arange(33, 40) + 8000)
    assert np.isnan(out[39])  # lane 7's source lane 8 does not exist: undefined, poisoned


def test_harness_simd_operations_in_divergent_branches():
    """On a GPU a SIMD operation inside a branch sees only the lanes that took
    the branch; a shuffle from a lane in the other branch is undefined."""
    src = """
    const uint l = thread_index_in_simdgroup;
    const float x = inp[thread_position_in_grid.x];
    float r;
    if (l < 12) {
      r = simd_sum(x);
    } else {
      r = 1000.0f * simd_sum(x) + simd_shuffle(x, 0);
    }
    out[thread_position_in_grid.x] = r;
    """
    x = mx.arange(32, dtype=mx.float32)
    launch = _launch("d", [("inp", x)], [("out", (32,), mx.float32)], (32, 1, 1), (32, 1, 1))
    for order in H.ORDERS:
        out = np.array(H.run(launch, source=src, order=order)[0])
        assert np.all(out[:12] == sum(range(12))), order
        assert np.all(np.isnan(out[12:])), order  # lane 0 is inactive in the else branch
    (out,) = H.run(launch, source=src.replace("simd_shuffle(x, 0)", "simd_shuffle(x, 12)"))
    assert np.all(np.array(out)[12:] == 1000.0 * sum(range(12, 32)) + 12)


def test_harness_rejects_divergent_barriers():
    src = """
    if (thread_position_in_threadgroup.x < 8) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[thread_position_in_grid.x] = 1.0f;
    """
    with pytest.raises(RuntimeError, match="different barriers"):
        H.run(_launch("b", [("inp", mx.zeros(1))], [("out", (32,), mx.float32)], (32, 1, 1), (32, 1, 1)), source=src)


# --- the harness header on macOS --------------------------------------------------

# The macOS SDK rule, emulated on glibc: <ucontext.h> fails unless the program
# defined _XOPEN_SOURCE itself before its first system header. <features.h>
# is the first header every glibc/libstdc++ header pulls in, before glibc
# derives _XOPEN_SOURCE from _GNU_SOURCE, so it sees what the program defined.
MACOS_FEATURES = """#if defined(__APPLE__) && !defined(_XOPEN_SOURCE) && !defined(MACOS_RULE_SEEN)
#define MACOS_NO_XOPEN_SOURCE 1
#endif
#define MACOS_RULE_SEEN 1
#include_next <features.h>
"""
MACOS_UCONTEXT = """#if defined(MACOS_NO_XOPEN_SOURCE)
#error The deprecated ucontext routines require _XOPEN_SOURCE to be defined
#endif
#include_next <ucontext.h>
"""


@pytest.mark.parametrize("guarded", [True, False], ids=["as-shipped", "guard-removed"])
def test_harness_header_builds_under_the_macos_ucontext_rule(tmp_path, guarded):
    """The macOS SDK's <ucontext.h> refuses to compile without _XOPEN_SOURCE
    (emulated: headers found first that apply that rule, __APPLE__ defined);
    the header as shipped builds, without its guard it does not."""
    sdk = tmp_path / "sdk"
    sdk.mkdir()
    (sdk / "features.h").write_text(MACOS_FEATURES)
    (sdk / "ucontext.h").write_text(MACOS_UCONTEXT)
    header = (Path(H.__file__).parent / "metal_compat.h").read_text()
    guard = "#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)\n#define _XOPEN_SOURCE 600\n#endif\n"
    assert guard in header
    if not guarded:
        header = header.replace(guard, "")
    (tmp_path / "metal_compat.h").write_text(header)
    (tmp_path / "t.cpp").write_text('#include "metal_compat.h"\nint main() { return 0; }\n')
    r = subprocess.run(
        [
            H.compiler(),
            "-std=c++17",
            "-fsyntax-only",
            "-D__APPLE__",
            f"-I{sdk}",
            f"-I{tmp_path}",
            str(tmp_path / "t.cpp"),
        ],
        capture_output=True,
        text=True,
    )
    if guarded:
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        assert r.returncode != 0 and "_XOPEN_SOURCE" in r.stderr


# --- differentiation with the Metal path selected ---------------------------------


def _harness_as_custom_kernel(launch):
    """run_metal on Linux: the harness computes the outputs, and like MLX's
    CustomKernel primitive they have no VJP."""
    arrays = [a for _, a in launch.inputs if isinstance(a, mx.array)]
    outs = H.run(launch)

    @mx.custom_function
    def kernel(*xs):
        return tuple(mx.array(o) for o in outs)

    @kernel.vjp
    def kernel_vjp(primals, cotangents, outputs):
        raise RuntimeError("[Primitive::vjp] Not implemented for CustomKernel")

    return list(kernel(*arrays))


def test_value_and_grad_through_the_target_with_the_metal_path(dense, monkeypatch):
    from mlx_dflash.models.qwen35 import Target

    _, model = dense
    tokens = mx.array([[1, 5, 9, 33, 2, 7]])

    def loss(m):
        logits, _ = Target(m).batch_forward(tokens)
        return nn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:]).mean()

    want_v, want_g = nn.value_and_grad(model, loss)(model)
    monkeypatch.setattr(metal, "use_metal", lambda force_twin=False: not force_twin)
    monkeypatch.setattr(metal, "run_metal", _harness_as_custom_kernel)
    v, grads = nn.value_and_grad(model, loss)(model)
    assert abs(float(v) - float(want_v)) < 1e-5
    got, want = dict(tree_flatten(grads)), dict(tree_flatten(want_g))
    assert got.keys() == want.keys()
    deltanet = [n for n in got if "A_log" in n or "conv1d" in n]
    assert deltanet and all(float(mx.abs(want[n]).max()) > 0 for n in deltanet)
    for n in got:
        assert np.allclose(np.array(got[n]), np.array(want[n]), rtol=1e-3, atol=1e-5), n

    # The control: the kernel called without the twin's VJP fails as on a Mac.
    def without_twin_vjp(launch, twin, static, primals, extra=(), n_out=1):
        return metal.run_metal(launch(static, *primals, *extra))[:n_out]

    monkeypatch.setattr(metal, "run_with_twin_vjp", without_twin_vjp)
    with pytest.raises(RuntimeError, match="CustomKernel"):
        nn.value_and_grad(model, loss)(model)


def test_every_metal_call_differentiates_through_its_twin(monkeypatch):
    """Chain (with a padding mask), tree (one, and one per slot), rollback (solo
    and per slot) and conv: gradients with the
    Metal path selected equal the twins' own."""
    q, k, v, g, beta, s0 = inputs(1, 5, 2, 4, 64, 8, mx.float32, seed=9)
    mask = mx.array([[True, True, False, True, True]])
    conv_in = mx.random.normal((1, 8, 70), key=mx.random.key(1))
    w = mx.random.normal((70, 4, 1), key=mx.random.key(2))
    parents = [-1, 0, 0, 1, 2]
    _, _, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    sq, sk, sv, sg, sb, ss0 = inputs(3, 5, 2, 4, 40, 6, mx.float32, seed=10)  # the slot tests' builds
    SLOT_PATHS = [[0, 2], [0, 1, 3], [0, 1, 2, 3, 4]]
    _, sfinal, stape = gated_delta.gated_delta_chain(sq, sk, sv, sg, sb, ss0, record=True, force_twin=True)

    def total(outs):
        return sum(((o.astype(mx.float32) * (i + 1)) ** 2).sum() for i, o in enumerate(outs) if o is not None)

    cases = {
        "chain": (
            lambda a, tw: total(gated_delta.gated_delta_chain(*a, mask, record=True, force_twin=tw)),
            [q, k, v, g, beta, s0],
        ),
        "tree": (
            lambda a, tw: total(gated_delta.gated_delta_tree(*a, parents, record=True, force_twin=tw)),
            [q, k, v, g, beta, s0],
        ),
        "rollback": (lambda a, tw: total([gated_delta.gated_delta_rollback(*a, 3, force_twin=tw)]), [s0, k, g, tape]),
        "tree per slot": (
            lambda a, tw: total(gated_delta.gated_delta_tree(*a, SLOT_TREES, record=True, force_twin=tw)),
            list(inputs(3, 10, 2, 4, 40, 6, mx.float32, seed=11)),
        ),
        "rollback slots along paths": (
            lambda a, tw: total(
                [
                    gated_delta.gated_delta_rollback_slots(
                        *a, sfinal, [2, 3, 5], stepwise=False, paths=SLOT_PATHS, force_twin=tw
                    )
                ]
            ),
            [ss0, sk, sg, stape],  # along paths the twin replays; final is not read
        ),
        "rollback slots": (
            lambda a, tw: total([gated_delta.gated_delta_rollback_slots(*a, [2, 5, 0], stepwise=False, force_twin=tw)]),
            [ss0, sk, sg, stape, sfinal],
        ),
        "conv": (lambda a, tw: total([conv.causal_conv1d_silu(*a, force_twin=tw)]), [conv_in, w]),
    }
    want = {n: mx.grad(lambda *a, f=f: f(a, True), argnums=tuple(range(len(x))))(*x) for n, (f, x) in cases.items()}
    monkeypatch.setattr(metal, "use_metal", lambda force_twin=False: not force_twin)
    monkeypatch.setattr(metal, "run_metal", _harness_as_custom_kernel)
    for n, (f, x) in cases.items():
        got = mx.grad(lambda *a: f(a, False), argnums=tuple(range(len(x))))(*x)
        for i, (a, b) in enumerate(zip(got, want[n])):
            assert float(mx.abs(b).max()) > 0, (n, i)
            assert np.allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4), (n, i)


# --- real Metal (macOS) ------------------------------------------------------------


@pytest.mark.skipif(
    not mx.metal.is_available(), reason="needs a Metal GPU (Apple silicon); the CPU harness above runs the same sources"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_metal_kernels_match_twins(dtype):
    with mx.stream(mx.gpu):
        q, k, v, g, beta, s0 = inputs(1, 9, 2, 4, 64, 16, dtype)
        parents = TREES[1]
        for tree in (False, True):
            f = gated_delta.gated_delta_tree if tree else gated_delta.gated_delta_chain
            args = (q, k, v, g, beta, s0) + ((parents,) if tree else ())
            got = f(*args, record=True)
            want = f(*args, record=True, force_twin=True)
            for a, b in zip(got, want):
                assert close(a, b, dtype)
        _, _, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True)
        assert close(
            gated_delta.gated_delta_rollback(s0, k, g, tape, 5),
            gated_delta.gated_delta_rollback(s0, k, g, tape, 5, force_twin=True),
            dtype,
        )
        conv_in = mx.random.normal((1, 12, 70)).astype(dtype)
        w = mx.random.normal((70, 4, 1)).astype(dtype)
        assert close(conv.causal_conv1d_silu(conv_in, w), conv.causal_conv1d_silu(conv_in, w, force_twin=True), dtype)


@pytest.mark.skipif(
    not mx.metal.is_available(), reason="needs a Metal GPU (Apple silicon); the CPU harness above runs the same sources"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_metal_packed_record_and_bit_exact_rollback(dtype):
    with mx.stream(mx.gpu):
        q, k, v, g, beta, s0 = inputs(1, 12, 2, 4, 128, 16, dtype, seed=4)
        assert gated_delta.chain_launch(q, k, v, g, beta, s0).name == "gated_delta_packed"
        want = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
        for packed in (True, False):
            y, S, tape = metal.run_metal(gated_delta.chain_launch(q, k, v, g, beta, s0, packed=packed))
            assert close(y, want[0], dtype) and close(S, want[1], dtype) and close(tape, want[2], dtype)
            y2, S2, _ = metal.run_metal(gated_delta.chain_launch(q, k, v, g, beta, s0, record=False, packed=packed))
            assert mx.array_equal(y, y2).item() and mx.array_equal(S, S2).item()
            n = 5
            S_n = metal.run_metal(
                gated_delta.chain_launch(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0, packed=packed)
            )[1]
            R_n = metal.run_metal(gated_delta.rollback_launch(s0, k, g, tape, range(n)))[0]
            assert mx.array_equal(S_n, R_n).item()
        parents = random_tree(64, seed=2)
        q, k, v, g, beta, s0 = inputs(1, 64, 2, 4, 128, 16, dtype, seed=5)
        got = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True)
        want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
        assert all(close(a, b, dtype) for a, b in zip(got, want))


@pytest.mark.skipif(
    not mx.metal.is_available(), reason="needs a Metal GPU (Apple silicon); the CPU harness above runs the same sources"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_metal_slots(dtype):
    """Slots on the GPU: a tree per slot against the twin, and the chain
    rolled back to ragged counts, each slot's state its solo forward's to the bit."""
    with mx.stream(mx.gpu):
        B, T = len(SLOT_TREES), len(SLOT_TREES[0])
        q, k, v, g, beta, s0 = inputs(B, T, 2, 4, 128, 16, dtype, seed=20)
        got = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, SLOT_TREES, record=True)
        want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, SLOT_TREES, record=True, force_twin=True)
        assert all(close(a, b, dtype) for a, b in zip(got, want))
        ns = [0, 4, T]
        _, final, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True)
        R = gated_delta.gated_delta_rollback_slots(s0, k, g, tape, final, ns, stepwise=False)
        for b, n in enumerate(ns):
            one = [x[b : b + 1, :n] for x in (q, k, v, g, beta)]
            S_b = gated_delta.gated_delta_chain(*one, s0[b : b + 1])[1] if n else s0[b : b + 1]
            assert mx.array_equal(R[b : b + 1], S_b).item(), (b, n)


@pytest.mark.skipif(
    not mx.metal.is_available(),
    reason="needs a Metal GPU (Apple silicon); the Linux test above runs the kernels in the harness",
)
def test_real_metal_value_and_grad_through_the_target(dense):
    from mlx_dflash.models.qwen35 import Target

    _, model = dense
    tokens = mx.array([[1, 5, 9, 33, 2, 7]])

    def loss(m):
        logits, _ = Target(m).batch_forward(tokens)
        return nn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:]).mean()

    with mx.stream(mx.gpu):
        v, grads = nn.value_and_grad(model, loss)(model)
    with mx.stream(mx.cpu):
        want_v, want_g = nn.value_and_grad(model, loss)(model)
    assert abs(float(v) - float(want_v)) < 1e-4
    want = dict(tree_flatten(want_g))
    for n, a in tree_flatten(grads):
        assert np.allclose(np.array(a), np.array(want[n]), rtol=1e-2, atol=1e-4), n


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the refusal on a machine without Metal")
def test_mac_check_says_it_needs_apple_silicon():
    import sys

    script = Path(__file__).resolve().parent.parent / "bench" / "mac_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs Apple silicon" in r.stderr


@pytest.mark.parametrize("packed", [False, True], ids=["simd", "packed"])
def test_verify_rows_equal_single_steps_bit_for_bit(packed):
    """What makes speculative output equal plain output in half precision on
    a Mac: a verified block's rows are the rows single steps give, to the
    bit (the chain and tree kernels run the recurrence in a single step's
    order), and so is the state after them."""
    T = 6
    q, k, v, g, beta, s0 = inputs(1, T, 2, 4, 128 if packed else 40, 8, mx.bfloat16, seed=8)
    y, S, _ = H.run(gated_delta.chain_launch(q, k, v, g, beta, s0, packed=packed))
    St = s0
    for t in range(T):
        sl = slice(t, t + 1)
        yt, St, _ = H.run(
            gated_delta.chain_launch(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], St, packed=packed)
        )
        assert np.array_equal(bits(yt[:, 0]), bits(y[:, t])), t
    assert np.array_equal(bits(St), bits(S))
    if packed:
        return
    # Tree: each node's row is a single step from its parent's state.
    parents = TREES[1]
    q, k, v, g, beta, s0 = inputs(1, len(parents), 2, 4, 40, 8, mx.bfloat16, seed=9)
    y, _, _ = H.run(gated_delta.tree_launch(q, k, v, g, beta, s0, parents))
    states = {}
    for t, p in enumerate(parents):
        sl = slice(t, t + 1)
        yt, states[t], _ = H.run(
            gated_delta.chain_launch(
                q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s0 if p < 0 else states[p], packed=False
            )
        )
        assert np.array_equal(bits(yt[:, 0]), bits(y[:, t])), t
