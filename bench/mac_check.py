"""One run on Apple silicon that proves what Linux CI cannot: the Metal kernels
compile and run on a real GPU, agree with their MLX twins at Qwen3.5 sizes,
and keep pace with mlx-lm's own kernels.

    python bench/mac_check.py [--reps 10] [--skip-tests] [--out bench/results/mac-check.json]

Steps: (1) the kernel test files (tests/test_metal_kernels.py,
tests/test_msl_strict.py; their real-Metal tests run here) and
tests/test_compiled.py (mx.compile'd forwards, custom kernels inside, equal
to plain ops on the GPU) under pytest;
(2) kernel vs twin at Dk = Dv = 128, Hk = 16, Hv = 48, bf16 inputs, T = 1,
16, 512, packed and SIMD layouts, with and without the tape; (3) the tree
kernel at budgets 22, 64 and 256 against its twin, and the rollback kernel
replaying the forward's state bit for bit; (4) nn.value_and_grad through a
tiny target on the GPU (custom kernels have no VJP: the twins supply it);
(5) timings against mlx-lm's Metal kernels. Writes a JSON report (paste it
into an issue) and exits 0 when every check passed, 1 otherwise; 2 on a
machine without Apple silicon.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def apple_silicon() -> bool:
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    import mlx.core as mx

    return mx.metal.is_available()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per kernel (median reported)")
    ap.add_argument("--skip-tests", action="store_true", help="skip step 1 (the pytest run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mac-check.json"), help="JSON report path")
    args = ap.parse_args()
    if not apple_silicon():
        print(
            f"error: bench/mac_check.py needs Apple silicon (macOS on arm64 with a Metal GPU); this is "
            f"{platform.system()} {platform.machine()}. On Linux, CI runs the Metal sources in "
            f"tests/metal_harness.py and the strict MSL check instead.",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx

    mx.set_default_device(mx.gpu)
    report = {
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "device_info": {k: str(v) for k, v in (getattr(mx, "device_info", None) or mx.metal.device_info)().items()},
        },
        "checks": {},
        "timings_ms": [],
    }

    def check(name, fn):
        t = time.perf_counter()
        try:
            detail = fn()
            ok = True
        except Exception:  # a report, not a crash: keep going and record it
            detail, ok = traceback.format_exc(limit=6), False
        report["checks"][name] = {"ok": ok, "seconds": round(time.perf_counter() - t, 2), "detail": detail}
        print(f"[{'ok' if ok else 'FAIL'}] {name}", flush=True)

    if not args.skip_tests:
        check("pytest kernel tests", lambda: _pytest())
    check("kernel vs twin, Qwen3.5 27B shapes (Dk 128, Hk 16, Hv 48, bf16)", _kernel_vs_twin)
    check("tree kernel at budgets 22/64/256, rollback bit-identical", _tree_and_rollback)
    check("value_and_grad through the target on the GPU", _grad)
    check("timings vs mlx-lm", lambda: _timings(report, args.reps))
    # Not a pass/fail check: on the GPU, MLX's own matmul and attention kernels
    # may reduce one row in another order than several (the DeltaNet kernels
    # do not; tests/test_metal_kernels.py), and its float32 matmuls of several
    # rows may round through TF32 (MLX_ENABLE_TF32, on unless set to 0), which
    # is what this measures.
    report["verify_rows_vs_single_steps"] = {
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32", "unset (on)"),
        "bfloat16": _verify_rows(mx.bfloat16),
        "float32": _verify_rows(mx.float32),
    }
    report["all_ok"] = all(c["ok"] for c in report["checks"].values())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v["ok"] for k, v in report["checks"].items()}, indent=1))
    for r in report["timings_ms"]:
        print(r)
    print(f"report: {out}")
    sys.exit(0 if report["all_ok"] else 1)


def _verify_rows(dtype):
    """A tiny target in ``dtype``: an 8-row verify against single steps
    (bench/row_exact.py; 0 = bit-exact, so speculative greedy output equals
    plain output on this GPU)."""

    from bench.row_exact import verify_rows
    from mlx_dflash.models.qwen35 import Target
    from tools import tiny

    cfg = tiny.target_config(hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
    target = Target(tiny.build_target(cfg, seed=1, dtype=dtype))
    rel, differ = verify_rows(target, list(range(3, 300, 7)), 8)
    return {"max_logit_diff_of_spread": rel, "rows_whose_greedy_pick_differs": differ, "exact": rel == 0}


def _pytest():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "tests/test_metal_kernels.py",
            "tests/test_msl_strict.py",
            "tests/test_compiled.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    tail = "\n".join(r.stdout.strip().splitlines()[-15:])
    if r.returncode != 0:
        raise RuntimeError(tail + r.stderr[-2000:])
    return tail


def _qwen_inputs(T, dtype, Hk=16, Hv=48, D=128, seed=0):
    import mlx.core as mx

    ks = mx.random.split(mx.random.key(seed), 6)
    q = (mx.random.normal((1, T, Hk, D), key=ks[0]) * D**-0.5).astype(dtype)
    k = (mx.random.normal((1, T, Hk, D), key=ks[1]) * D**-0.5).astype(dtype)
    v = mx.random.normal((1, T, Hv, D), key=ks[2]).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (1, T, Hv), key=ks[3])
    beta = mx.random.uniform(0.0, 1.0, (1, T, Hv), key=ks[4])
    s0 = mx.random.normal((1, Hv, D, D), key=ks[5]) * 0.1
    return q, k, v, g, beta, s0


def _rel(a, b):
    import mlx.core as mx

    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-6))


def _kernel_vs_twin():
    import mlx.core as mx

    from mlx_dflash.kernels import gated_delta, metal

    rows = []
    for T in (1, 16, 512):
        q, k, v, g, beta, s0 = _qwen_inputs(T, mx.bfloat16, seed=T)
        want = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
        for packed in (True, False):
            for record in (True, False):
                got = metal.run_metal(gated_delta.chain_launch(q, k, v, g, beta, s0, record=record, packed=packed))
                errs = [_rel(got[0], want[0]), _rel(got[1], want[1])] + ([_rel(got[2], want[2])] if record else [])
                rows.append({"T": T, "packed": packed, "record": record, "rel_err_y_state_tape": errs})
                # bf16 outputs: 1e-2 of the tensor's scale; fp32 state and tape: 1e-3.
                if errs[0] > 1e-2 or max(errs[1:]) > 1e-3:
                    raise AssertionError(rows[-1])
    return rows


def _tree_and_rollback():
    import mlx.core as mx
    import numpy as np

    from mlx_dflash import ddtree
    from mlx_dflash.kernels import gated_delta, metal

    rows = []
    for budget in (22, 64, 256):
        rng = np.random.default_rng(budget)
        parents, depth = [-1], [0]
        while len(parents) < budget:  # DDTree-like: at most 16 deep
            p = int(rng.integers(0, len(parents)))
            if depth[p] < 15:
                parents.append(p)
                depth.append(depth[p] + 1)
        q, k, v, g, beta, s0 = _qwen_inputs(budget, mx.bfloat16, seed=budget)
        got = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True)
        want = gated_delta.gated_delta_tree(q, k, v, g, beta, s0, parents, record=True, force_twin=True)
        errs = [_rel(a, b) for a, b in zip(got, want)]
        rows.append({"budget": budget, "rel_err_y_state_tape": errs})
        if errs[0] > 1e-2 or max(errs[1:]) > 1e-3:
            raise AssertionError(rows[-1])
        path = ddtree.path_rows(parents, budget - 1)
        replay = metal.run_metal(gated_delta.rollback_launch(s0, k, g, got[2], path))[0]
        if not mx.array_equal(replay, got[1]).item():
            raise AssertionError(f"budget {budget}: rollback differs from the forward state")
    for packed in (True, False):  # chain: state after n of T tokens, forward vs replay
        q, k, v, g, beta, s0 = _qwen_inputs(16, mx.bfloat16, seed=3)
        tape = metal.run_metal(gated_delta.chain_launch(q, k, v, g, beta, s0, packed=packed))[2]
        n = 7
        S_n = metal.run_metal(
            gated_delta.chain_launch(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0, packed=packed)
        )[1]
        R_n = metal.run_metal(gated_delta.rollback_launch(s0, k, g, tape, range(n)))[0]
        if not mx.array_equal(S_n, R_n).item():
            raise AssertionError(f"packed={packed}: rollback differs from the forward state")
    return rows


def _grad():
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_dflash.models.qwen35 import Target
    from tools import tiny

    model = tiny.build_target(tiny.target_config(), seed=3)
    tokens = mx.array([[1, 5, 9, 33, 2, 7, 11, 4]])

    def loss(m):
        logits, _ = Target(m).batch_forward(tokens)
        return nn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:]).mean()

    v, grads = nn.value_and_grad(model, loss)(model)
    mx.eval(v, grads)
    return {"loss": float(v)}


def _timeit(fn, reps):
    import mlx.core as mx

    mx.eval(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 3)


def _timings(report, reps):
    import mlx.core as mx
    from mlx_lm.models import gated_delta as gd

    from mlx_dflash.kernels import gated_delta, metal

    for T in (1, 16, 64, 512):
        q, k, v, g, beta, s0 = _qwen_inputs(T, mx.bfloat16, seed=T)
        run = metal.run_metal
        r = {
            "T": T,
            "ours packed": _timeit(lambda: run(gated_delta.chain_launch(q, k, v, g, beta, s0, record=False))[:2], reps),
            "ours packed + tape": _timeit(lambda: run(gated_delta.chain_launch(q, k, v, g, beta, s0))[:3], reps),
            "ours simd": _timeit(
                lambda: run(gated_delta.chain_launch(q, k, v, g, beta, s0, record=False, packed=False))[:2], reps
            ),
            "mlx-lm kernel": _timeit(lambda: gd.gated_delta_kernel(q, k, v, g, beta, s0), reps),
            "mlx-lm unpacked kernel": _timeit(lambda: gd.gated_delta_kernel_unpacked(q, k, v, g, beta, s0), reps),
            "twin": _timeit(lambda: gated_delta.gated_delta_chain(q, k, v, g, beta, s0, force_twin=True)[:2], reps),
        }
        report["timings_ms"].append(r)
    return "see timings_ms"


if __name__ == "__main__":
    main()
