"""Time the DeltaNet kernels: Metal kernel vs MLX twin vs mlx-lm, at Qwen3.5-27B shapes.

    python bench/kernels.py [--reps 5]

Shapes: Hk 16, Hv 48, Dk = Dv = 128, T in {1, 4, 8, 16, 23, 512}; fp32 state,
bf16 inputs on Metal, fp32 inputs on a CPU. Columns: our Metal kernel with
the tape (macOS only; the packed Dk = 128 layout), our twin (closed form),
mlx-lm's recurrence as it runs on this machine (on macOS its Metal kernel,
`gated_delta_kernel`, packed at Dk = 128; elsewhere its sequential ops,
`gated_delta_ops`, the only path it has without Metal), and the rollback
replay. Writes bench/results/kernels-<platform>.md. On a Mac,
bench/mac_check.py also checks the kernels and times more variants.
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

from mlx_dflash import blas
from mlx_dflash.kernels import gated_delta

RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, reps):
    mx.eval(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed runs per variant and T after one warm-up; the table shows the median ms",
    )
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    metal = mx.metal.is_available()
    dtype = mx.bfloat16 if metal else mx.float32
    Hk, Hv, D = 16, 48, 128
    rows = []
    for T in (1, 4, 8, 16, 23, 512):
        ks = mx.random.split(mx.random.key(T), 6)
        q = (mx.random.normal((1, T, Hk, D), key=ks[0]) * 0.1).astype(dtype)
        k = (mx.random.normal((1, T, Hk, D), key=ks[1]) * 0.1).astype(dtype)
        v = mx.random.normal((1, T, Hv, D), key=ks[2]).astype(dtype)
        g = mx.random.uniform(0.5, 1.0, (1, T, Hv), key=ks[3])
        beta = mx.random.uniform(0.0, 1.0, (1, T, Hv), key=ks[4])
        s0 = mx.random.normal((1, Hv, D, D), key=ks[5]) * 0.1
        r = {"T": T}
        if metal:
            r["metal"] = timeit(lambda: gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True), args.reps)
            r["metal, no tape (prefill)"] = timeit(
                lambda: gated_delta.gated_delta_chain(q, k, v, g, beta, s0)[:2], args.reps
            )
        r["twin"] = timeit(
            lambda: gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)[:2], args.reps
        )
        if metal:  # mlx-lm's real Metal kernel (mlx-lm's own dispatch would pick it on the GPU)
            r["mlx-lm metal kernel"] = timeit(lambda: gated_delta_kernel(q, k, v, g, beta, s0), args.reps)
        else:  # without Metal mlx-lm has only its sequential ops
            r["sequential ops (mlx-lm)"] = timeit(lambda: gated_delta_ops(q, k, v, g, beta, s0), args.reps)
        _, _, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, record=True, force_twin=True)
        n = max(T // 2, 1)
        r["rollback twin (T/2)"] = timeit(
            lambda: gated_delta.gated_delta_rollback(s0, k, g, tape, n, force_twin=True), args.reps
        )
        if metal:
            r["rollback metal (T/2)"] = timeit(lambda: gated_delta.gated_delta_rollback(s0, k, g, tape, n), args.reps)
        rows.append(r)
        print(r, flush=True)
    cols = [c for c in rows[0] if c != "T"]
    lines = [
        "# DeltaNet kernel timings (ms, median)",
        "",
        f"- machine: {platform.platform()} ({platform.machine()}); BLAS: {blas.describe()}",
        f"- shapes: Hk {Hk}, Hv {Hv}, Dk = Dv = {D}; inputs {dtype}, state fp32; one layer, batch 1",
        "",
        "| T | " + " | ".join(cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for r in rows:
        lines.append(f"| {r['T']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"kernels-{sys.platform}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
