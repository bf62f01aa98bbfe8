"""The Metal kernels against their MLX twins.

On Linux every kernel's Metal source is executed by the CPU harness
(metal_harness.py); on macOS the real kernels also run on the GPU.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash import kernels

import metal_harness as H

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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_chain_kernel_matches_twin(shape, dtype):
    q, k, v, g, beta, s0 = inputs(*shape, dtype)
    B, T = shape[:2]
    for mask in (None, mx.array(np.random.default_rng(1).random((B, T)) > 0.3)):
        y, S, d = H.run(kernels.chain_launch(q, k, v, g, beta, s0, mask))
        ry, rS, rd = kernels.gated_delta_chain(q, k, v, g, beta, s0, mask, record=True, force_twin=True)
        assert y.dtype == dtype
        assert close(y, ry, dtype) and close(S, rS, dtype) and close(d, rd, dtype), (shape, dtype, mask is None)


TREES = [
    [-1],
    [-1, 0, 1, 0, 3, 2, 5, 3, 7],
    [-1, 0, 0, 0, 1, 1, 2, 4, 4, 8, 9, 9, 3],
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parents", TREES, ids=len)
def test_tree_kernel_matches_twin(parents, dtype):
    T = len(parents)
    q, k, v, g, beta, s0 = inputs(1, T, 2, 4, 40, 6, dtype, seed=T)
    y, S, d = H.run(kernels.tree_launch(q, k, v, g, beta, s0, parents))
    ry, rS, rd = kernels.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
    assert close(y, ry, dtype) and close(S, rS, dtype) and close(d, rd, dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_rollback_kernel_matches_twin(dtype):
    parents = TREES[2]
    T = len(parents)
    q, k, v, g, beta, s0 = inputs(1, T, 2, 4, 40, 6, dtype, seed=3)
    _, _, tape = kernels.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
    for node in (0, 4, 10, 12):
        rows = kernels.path_rows(parents, node)
        (got,) = H.run(kernels.rollback_launch(s0, k, g, tape, rows))
        P = mx.array(rows)
        want = kernels.gated_delta_rollback(s0, k[:, P], g[:, P], tape[:, P], len(rows), force_twin=True)
        assert close(got, want, dtype)
    # A chain prefix.
    _, _, tape = kernels.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    (got,) = H.run(kernels.rollback_launch(s0, k, g, tape, range(7)))
    assert close(got, kernels.gated_delta_rollback(s0, k, g, tape, 7, force_twin=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parents", [None, TREES[1]], ids=["chain", "tree"])
def test_conv_kernel_matches_twin(parents, dtype):
    K, C, T = 4, 70, 9  # C > one threadgroup of 64: a partial edge group
    conv_in = mx.random.normal((2, K - 1 + T, C), key=mx.random.key(4)).astype(dtype)
    weight = (mx.random.normal((C, K, 1), key=mx.random.key(5)) * 0.5).astype(dtype)
    chain = list(range(-1, T - 1))
    idx = kernels.conv_windows(parents if parents is not None else chain, K)
    (got,) = H.run(kernels.conv_launch(conv_in, weight, idx))
    want = kernels.causal_conv1d_silu(conv_in, weight, parents, force_twin=True)
    assert got.dtype == dtype and close(got, want, dtype)


# --- the harness catches broken kernels and executes threadgroup semantics ---------


@pytest.mark.parametrize("mutation", [
    ("hv / (Hv / Hk)", "hv % Hk"),  # wrong GQA head mapping
    ("kv = simd_sum(kv);", ""),  # a lane-local reduction
    ("s[j] = s[j] * gt;", "s[j] = s[j] * gt * gt;"),  # wrong decay
])
def test_harness_rejects_a_mutated_kernel(mutation):
    q, k, v, g, beta, s0 = inputs(1, 5, 2, 4, 64, 4, mx.float32)
    src = kernels.metal_source("gated_delta_chain")
    old, new = mutation
    assert old in src
    y, S, d = H.run(kernels.chain_launch(q, k, v, g, beta, s0), source=src.replace(old, new))
    ry, rS, rd = kernels.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
    assert not (close(y, ry) and close(S, rS) and close(d, rd))


def _launch(name, source_inputs, outputs, grid, tg):
    return kernels.Launch(name, source_inputs, outputs, [], grid, tg)


def test_harness_threadgroup_memory_and_barrier():
    src = """
    threadgroup float buf[64];
    const uint l = thread_position_in_threadgroup.x;
    buf[l] = inp[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = buf[threads_per_threadgroup.x - 1 - l];
    """
    x = mx.arange(128, dtype=mx.float32)
    (out,) = H.run(_launch("t", [("inp", x)], [("out", (128,), mx.float32)], (128, 1, 1), (64, 1, 1)), source=src)
    want = np.concatenate([np.arange(63, -1, -1), np.arange(127, 63, -1)])
    assert np.array_equal(np.array(out), want)
    # Without the barrier, early threads read slots not yet written.
    (bad,) = H.run(_launch("t", [("inp", x)], [("out", (128,), mx.float32)], (128, 1, 1), (64, 1, 1)),
                   source=src.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", ""))
    assert not np.array_equal(np.array(bad), want)


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
    assert out[39] == 39 + 8000  # lane 7's source lane 8 does not exist: keeps its own value


# --- real Metal (macOS) ------------------------------------------------------------


@pytest.mark.skipif(not mx.metal.is_available(),
                    reason="needs a Metal GPU (Apple silicon); the CPU harness above runs the same sources")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_metal_kernels_match_twins(dtype):
    with mx.stream(mx.gpu):
        q, k, v, g, beta, s0 = inputs(1, 9, 2, 4, 64, 16, dtype)
        parents = TREES[1]
        for tree in (False, True):
            f = kernels.gated_delta_tree if tree else kernels.gated_delta_chain
            args = (q, k, v, g, beta, s0) + ((parents,) if tree else ())
            got = f(*args, record=True)
            want = f(*args, record=True, force_twin=True)
            for a, b in zip(got, want):
                assert close(a, b, dtype)
        _, _, tape = kernels.gated_delta_chain(q, k, v, g, beta, s0, record=True)
        assert close(kernels.gated_delta_rollback(s0, k, g, tape, 5),
                     kernels.gated_delta_rollback(s0, k, g, tape, 5, force_twin=True), dtype)
        conv_in = mx.random.normal((1, 12, 70)).astype(dtype)
        w = mx.random.normal((70, 4, 1)).astype(dtype)
        assert close(kernels.causal_conv1d_silu(conv_in, w), kernels.causal_conv1d_silu(conv_in, w, force_twin=True), dtype)
