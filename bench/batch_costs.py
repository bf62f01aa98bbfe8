"""Batch cycle costs on the embedded pair: what the batch width policy's cost
model measures (BatchCosts: S slots at each ladder width), and what the
per-cycle restacking of the DeltaNet states costs against a cycle.

    python bench/batch_costs.py [--reps 20] [--blas auto|openblas|bundled]

Writes bench/results/batch-costs.md. Everything in one process; the cycle
and the restack alone take turns, so a busy machine skews them alike.
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_dflash import blas  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def scratch_slots(target, S):
    import mlx.core as mx

    from mlx_dflash.cache import SlotBatch

    V = target.vocab_size
    caches = []
    for b in range(S):
        c = target.make_cache()
        target.prefill([(7 * i + 3 + b) % V for i in range(64)], c)
        caches.append(c)
    mx.eval([c.state() for c in caches])
    return SlotBatch(caches)


def restack_share(target, S, W, reps):
    """(cycle, restack) seconds, min and median over ``reps`` turns: one
    forward_slots of width W (+ rollback to one token), and the
    concatenation of every DeltaNet layer's conv and ssm states from the S
    slots alone (what forward_slots does first per layer)."""
    import mlx.core as mx

    slots = scratch_slots(target, S)
    linear = [i for i, layer in enumerate(target.layers) if layer.is_linear]

    def cycle():
        logits, _ = target.forward_slots(mx.full((S, W), 5, dtype=mx.int32), slots, record=W > 1)
        mx.argmax(logits, axis=-1).tolist()
        if W > 1:
            slots.rollback([1] * S)
        mx.eval(slots.state())

    def restack():
        out = []
        for i in linear:
            sts = [c.layers[i] for c in slots.caches]
            out += [mx.concatenate([st.ssm for st in sts]), mx.concatenate([st.conv for st in sts])]
        mx.eval(out)

    tc, tr = [], []
    for r in range(reps + 1):
        for fn, ts in ((cycle, tc), (restack, tr)):
            t = time.perf_counter()
            fn()
            if r:
                ts.append(time.perf_counter() - t)
    tc.sort()
    tr.sort()
    return tc[0], tc[len(tc) // 2], tr[0], tr[len(tr) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--reps",
        type=int,
        default=20,
        help="timed turns of the cycle and of the restack alone per (S, W), after a warm-up; min and median reported",
    )
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    import mlx.core as mx

    import mlx_dflash
    from mlx_dflash.batch import BatchCosts

    e = mlx_dflash.load()
    target, draft = e.target, e.draft
    costs = BatchCosts(target, draft, cache_dir="/nonexistent")  # measured here, not read from a cache
    sizes = (1, 2, 4, 8)
    tables = {S: costs.measure(S) for S in sizes}
    widths = sorted(tables[1])
    lines = [
        "# Batch cycle costs: embedded pair",
        "",
        f"- machine: {platform.platform()}, {os.cpu_count()} cores; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end",
        f"- BLAS: {blas.describe()}; mlx {mx.__version__}",
        "",
        "## BatchCosts: one batch cycle of S slots at width W (ms, fastest of 3 after a warm-up)",
        "",
        "Draft for all slots at the full block, one forward_slots, the host reading the picks, the "
        "rollback to one kept token; W = 1: a plain step for every slot. In brackets: the cost per "
        "slot relative to S = 1 at that width (1.00 = no gain from batching; 1/S = free).",
        "",
        "| W | " + " | ".join(f"S={S}" for S in sizes) + " |",
        "|---:|" + "---:|" * len(sizes),
    ]
    for W in widths:
        row = [f"{tables[S][W] * 1e3:.2f} ({tables[S][W] / S / tables[1][W]:.2f})" for S in sizes]
        lines.append(f"| {W} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Restacking the DeltaNet states per cycle",
        "",
        f"forward_slots (+ rollback) against the concatenation of every DeltaNet layer's conv and ssm "
        f"states from the S slots alone; {args.reps} turns each, alternating. ms, min / median.",
        "",
        "| S | W | cycle | restack | restack / cycle (min) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for S in (4, 8):
        for W in (1, 8, 16):
            c0, cm, r0, rm = restack_share(target, S, W, args.reps)
            lines.append(
                f"| {S} | {W} | {c0 * 1e3:.2f} / {cm * 1e3:.2f} | {r0 * 1e3:.3f} / {rm * 1e3:.3f} | "
                f"{r0 / c0 * 100:.1f}% |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch-costs.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
