"""Every Metal kernel, as MLX wraps it, through a strict MSL front end (msl_check.py).

The sources are captured from the real dispatch (mx.export_function traces
mx.fast.metal_kernel on any backend) at Qwen3.5 sizes and at the test shapes,
including inputs small enough for MLX to bind them as `constant`, and
compiled with clang under MSL's rules; mutations show each rule bites.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("clang.cindex", reason="the strict MSL check needs the libclang wheel (test extra)")

import msl_check as M  # noqa: E402

from mlx_dflash.kernels import conv, gated_delta, metal  # noqa: E402

DTYPES = [mx.bfloat16, mx.float16, mx.float32]


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype):
    # Shapes and dtypes are all a trace needs: zeros, nothing is evaluated.
    z = lambda *s: mx.zeros(s, dtype=dtype)  # noqa: E731
    return (
        z(B, T, Hk, Dk),
        z(B, T, Hk, Dk),
        z(B, T, Hv, Dv),
        z(B, T, Hv),
        z(B, T, Hv),
        mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32),
    )


def _tree(n):
    """A DDTree-shaped tree of n nodes: each depth holds up to four children of the one before."""
    parents = [-1]
    while len(parents) < n:
        parents.append(max(0, (len(parents) - 1) // 4))
    return parents


def launches(B, Hk, Hv, Dk, Dv, T, dtype, budgets):
    q, k, v, g, beta, s0 = _inputs(B, T, Hk, Hv, Dk, Dv, dtype)
    out = {}
    for record in (True, False):
        out[f"chain record={record}"] = gated_delta.chain_launch(q, k, v, g, beta, s0, record=record)
        out[f"chain simd record={record}"] = gated_delta.chain_launch(q, k, v, g, beta, s0, record=record, packed=False)
    out["rollback"] = gated_delta.rollback_launch(s0, k, g, mx.zeros((B, T, Hv, Dv)), range(max(T // 2, 1)))
    ragged = [(T * b) // max(B - 1, 1) for b in range(B)]  # 0 .. T: none, partial, the whole block
    out["rollback slots"] = gated_delta.rollback_slots_launch(s0, k, g, mx.zeros((B, T, Hv, Dv)), s0, ragged)
    C = 2 * Hk * Dk + Hv * Dv
    out["conv"] = conv.conv_launch(
        mx.zeros((B, 3 + T, C), dtype=dtype),
        mx.zeros((C, 4, 1), dtype=dtype),
        conv.conv_windows(list(range(-1, T - 1)), 4),
    )
    for n in budgets:
        tq, tk, tv, tg, tb, ts = _inputs(B, n, Hk, Hv, Dk, Dv, dtype)
        out[f"tree {n}"] = gated_delta.tree_launch(tq, tk, tv, tg, tb, ts, _tree(n))
        if B > 1:  # a tree per slot: the chain of n nodes for one, DDTree shapes for the rest
            trees = [list(range(-1, n - 1))] + [_tree(n)] * (B - 1)
            out[f"tree {n} per slot"] = gated_delta.tree_launch(tq, tk, tv, tg, tb, ts, trees)
            out[f"conv tree {n} per slot"] = conv.conv_launch(
                mx.zeros((B, 3 + n, C), dtype=dtype),
                mx.zeros((C, 4, 1), dtype=dtype),
                np.stack([conv.conv_windows(p, 4) for p in trees]),
            )
    return out


def _sweep(cases):
    seen, failures, n = {}, [], 0
    for shape in cases:
        for name, launch in launches(*shape).items():
            src = M.capture(launch)
            n += 1
            if src not in seen:
                seen[src] = M.check(src)
            if seen[src]:
                failures.append((shape, name, seen[src][:3]))
    return n, len(seen), failures


# Qwen3.5: Dk = Dv = 128, Hk = 16, Hv 32 (9B), 48 (27B), 64 (larger MoE).
QWEN = [
    (1, 16, hv, 128, 128, T, dt, (22, 256) if T == 16 else ())
    for hv, T, dt in itertools.product((32, 48, 64), (1, 16, 512), DTYPES)
]
# Batched decoding: the slots stacked along B, at a verify width (16) and a
# plain step (1); at B = 2 and 4 MLX binds the per-slot counts as `constant`.
QWEN_SLOTS = [
    (b, 16, hv, 128, 128, T, dt, (22,) if T == 16 else ())
    for b, hv, T, dt in itertools.product((2, 4, 8), (32, 48, 64), (1, 16), DTYPES)
]
TESTS = [  # the shapes of test_metal_kernels.py, and one small enough that
    (1, 1, 1, 32, 4, 1, mx.float32, (1, 9)),  # MLX binds state, v, g and mask as `constant`
    (1, 2, 4, 64, 8, 16, mx.bfloat16, (13,)),
    (2, 1, 3, 40, 5, 7, mx.float16, ()),
    (1, 1, 2, 128, 8, 5, mx.float32, ()),
    (1, 1, 1, 4, 1, 2, mx.bfloat16, (3,)),
    (2, 1, 1, 4, 1, 2, mx.bfloat16, (3,)),  # slots: counts, order and depth bound as `constant`
]


def test_every_kernel_passes_at_qwen35_sizes():
    n, unique, failures = _sweep(QWEN)
    assert n >= 3 * 3 * 3 * 6 and unique >= 20
    assert not failures, failures


def test_every_kernel_passes_at_qwen35_sizes_with_slots():
    n, unique, failures = _sweep(QWEN_SLOTS)
    assert n >= 3 * 3 * 2 * 3 * 6
    assert not failures, failures


def test_every_kernel_passes_at_the_test_shapes():
    n, unique, failures = _sweep(TESTS)
    assert not failures, failures


def test_capture_is_the_wrapper_mlx_generates():
    q, k, v, g, beta, s0 = _inputs(1, 2, 1, 1, 4, 1, mx.bfloat16)
    src = M.capture(gated_delta.chain_launch(q, k, v, g, beta, s0))
    assert "template <typename InT, typename StT, int Dk, int Dv, int Hk, int Hv, bool Record>" in src
    assert "const constant float* state_in [[buffer(5)]]" in src  # 4 elements: MLX binds it as constant
    assert "device float* state_out" in src and "[[host_name(" in src
    assert metal.metal_source("gated_delta_chain").strip() in src


def _tiny_chain():
    q, k, v, g, beta, s0 = _inputs(1, 2, 1, 1, 4, 1, mx.float32)
    return M.capture(gated_delta.chain_launch(q, k, v, g, beta, s0, packed=False))


ANCHOR = "for (int t = 0; t < T; ++t) {"
MUTATIONS = {  # what MSL rejects -> an edit that introduces it
    "device/constant mix-up": ("auto s_in = state_in", "const device float* s_in = state_in"),
    "variable-length array": (ANCHOR, "float scratch[T];\n" + ANCHOR),
    "double": (ANCHOR, "double acc = 0;\n" + ANCHOR),
    "std::": (ANCHOR, "float e = std::exp(1.0f);\n" + ANCHOR),
    "exceptions": (ANCHOR, "if (T < 0) { throw 1; }\n" + ANCHOR),
    "C++17 if constexpr": ("if (Record) {", "if constexpr (Record) {"),
    "GNU statement expression": (ANCHOR, "int w = ({ 1; });\n" + ANCHOR),
}


@pytest.mark.parametrize("what", list(MUTATIONS))
def test_the_check_catches(what):
    src = _tiny_chain()
    assert M.check(src) == []
    old, new = MUTATIONS[what]
    assert old in src
    problems = M.check(src.replace(old, new, 1))
    assert problems, what


def test_the_check_catches_recursion():
    src = _tiny_chain()
    helper = "inline float walk(int n) { return n > 0 ? walk(n - 1) : 0.0f; }\n"
    bad = helper + src.replace(ANCHOR, "s[0] += walk(2);\n" + ANCHOR, 1)
    problems = M.check(bad)
    assert problems and "recursion" in problems[0]
    fine = "inline float once(int n) { return n + 1.0f; }\n" + src.replace(ANCHOR, "s[0] += once(2);\n" + ANCHOR, 1)
    assert M.check(fine) == []


def test_mlx_lm_kernels_pass_the_check(monkeypatch):
    """The check is not stricter than Metal: mlx-lm's gated-delta kernels
    (which compile on every Mac) pass it."""
    from mlx_lm.models import gated_delta as gd

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)  # build the kernel objects on Linux
    made = [gd._make_gated_delta_kernel(has_mask=m, vectorized=vec) for m in (False, True) for vec in (False, True)]
    made += [gd._make_gated_delta_packed_kernel()]
    B, T, Hk, Hv, D = 1, 4, 2, 4, 128
    q, k, v, _, beta, s0 = _inputs(B, T, Hk, Hv, D, D, mx.bfloat16)
    for i, kern in enumerate(made):
        vec = i in (1, 3)
        g = mx.zeros((B, T, Hv, D) if vec else (B, T, Hv), dtype=mx.float32)
        ins = [q, k, v, g, beta, s0, T] + ([mx.ones((B, T), dtype=mx.bool_)] if i >= 2 and i < 4 else [])

        def run(*xs, kern=kern):
            it = iter(xs)
            args = [next(it) if isinstance(a, mx.array) else a for a in ins]
            return kern(
                inputs=args,
                template=[("InT", mx.bfloat16), ("StT", mx.float32), ("Dk", D), ("Dv", D), ("Hk", Hk), ("Hv", Hv)],
                grid=(32, D, B * Hv),
                threadgroup=(32, 4, 1),
                output_shapes=[(B, T, Hv, D), s0.shape],
                output_dtypes=[mx.bfloat16, mx.float32],
            )

        src = M.capture_fn(run, [a for a in ins if isinstance(a, mx.array)])
        assert M.check(src) == [], (i, M.check(src)[:3])


def test_the_check_catches_too_many_buffers():
    def kernel_with(n):
        names = [f"a{i}" for i in range(n)]
        kern = mx.fast.metal_kernel(
            name=f"many{n}",
            input_names=names,
            output_names=["out"],
            source="out[0] = " + " + ".join(f"{x}[0]" for x in names) + ";",
        )
        arrays = [mx.zeros((16,)) for _ in names]
        return M.capture_fn(
            lambda *xs: kern(
                inputs=list(xs), grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32]
            ),
            arrays,
        )

    assert M.check(kernel_with(30)) == []  # 31 buffers with the output
    assert "buffer arguments" in M.check(kernel_with(31))[0]
