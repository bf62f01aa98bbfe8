"""The default width policy against every pinned width and plain decoding, in ONE process.

    python bench/regret.py [-n 128] [--reps 3] [--widths 2,4,8,16] [--load quiet,busy]
                           [--draft DIR ...] [--no-embedded] [--out bench/results/regret.md]

For each pair (the embedded pair, then each ``--draft`` with the embedded
target) and each of the six bench prompts, the modes take turns one
generation at a time (after a warm-up each): ``default`` (the adaptive
policy), ``pinned B`` for each width up to the draft's block, and ``plain``
(``--baseline``), and plain decoding once more as a control. Per prompt: each
mode's median tok/s and the regret ratio, the median over repeats of
default's tok/s over the better of (the best pinned width, plain) in the
same repeat (goal: >= 0.97 on every prompt, and default's median over
prompts above both). The control's ratio to plain, taken the same way,
shows what identical work reads as in this run: a regret ratio no further
from 1 than the control's is within the run's noise. ``busy``: the same, while a
subprocess this script starts keeps one core busy (a pure-Python loop,
pinned to core 0 where the OS allows), as a browser and an editor would.
Greedy: every mode's tokens must equal plain decoding's.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_dflash import blas  # noqa: E402

# Burns core 0 until killed, or until this script is gone (its parent changes).
BURN = (
    "import os, sys\nparent = int(sys.argv[1])\nif hasattr(os, 'sched_setaffinity'):\n"
    "    os.sched_setaffinity(0, {0})\nwhile os.getppid() == parent:\n    for _ in range(1000000):\n        pass\n"
)


CONTROL = "plain again"  # plain decoding once more: what identical work reads as in the same run

# Student's t, 97.5th percentile, by degrees of freedom (beyond: 1.96 + 2.4 / df, within 0.01).
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def interval(ratios) -> tuple:
    """A 95% interval for the ratio paired repeats estimate: Student's t on
    their logarithms (a ratio's noise multiplies). (0, inf) from one repeat."""
    if len(ratios) < 2:
        return 0.0, float("inf")
    logs = [math.log(r) for r in ratios]
    df = len(logs) - 1
    half = T975.get(df, 1.96 + 2.4 / df) * statistics.stdev(logs) / math.sqrt(len(logs))
    mid = statistics.mean(logs)
    return math.exp(mid - half), math.exp(mid + half)


def busy_core():
    """A subprocess that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", BURN, str(os.getpid())])


def run_mode(engine, draft, ids, n, mode):
    from mlx_dflash.benchmark import _run_engine

    if mode in ("plain", CONTROL):
        return _run_engine(engine, ids, n, None, None)
    if mode == "default":
        return _run_engine(engine, ids, n, draft, None)
    return _run_engine(engine, ids, n, draft, int(mode.split()[1]))


def measure(engine, draft, prompts, n, reps, widths):
    """Per prompt: per mode the tok/s of each repeat, the stats of its median run, and the tokens."""
    from mlx_dflash.benchmark import first_difference

    modes = ["default"] + [f"pinned {w}" for w in widths if w <= draft.block_size] + ["plain", CONTROL]
    rows = {}
    for name, text in prompts.items():
        ids = engine.encode(text)
        runs = {m: [] for m in modes}
        for m in modes:  # warm-up (traces, cost curve)
            run_mode(engine, draft, ids, n, m)
        for r in range(reps):
            # The order turns by one each repeat: no mode always runs right after the same one.
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                runs[m].append(run_mode(engine, draft, ids, n, m))
        ref = runs["plain"][0][0]
        for m, rs in runs.items():
            for toks, _ in rs:
                if toks != ref:
                    raise SystemExit(f"{name}: {m} differs from plain decoding at token {first_difference(toks, ref)}")
        rows[name] = row = summarise(runs)
        best = row["best_pinned"]
        print(
            f"  {name:18s} default {row['default']['median']:6.1f}  best pinned ({best}) "
            f"{row[best]['median']:6.1f}  plain {row['plain']['median']:6.1f}  regret {row['regret']:.3f}  "
            f"control {row['control']:.3f}",
            flush=True,
        )
    return modes, rows


def summarise(runs) -> dict:
    """One prompt's row from each mode's repeats (``(tokens, stats)``, the
    repeats in the order they ran): per mode its tok/s, median and the
    widths of its median run; the better of the best pinned width and plain;
    the regret ratio; the fastest repeats' ratio; and the control's ratio to
    plain, paired by repeat as the regret ratio is."""
    row = {}
    for m, rs in runs.items():
        tps = [st["decode_tps"] for _, st in rs]
        mid = sorted(rs, key=lambda r: r[1]["decode_tps"])[len(rs) // 2][1]
        row[m] = {
            "tps": tps,
            "median": statistics.median(tps),
            "widths": mid["widths"],
            "tau": mid["tau"],
            "widths_each": [st["widths"] for _, st in rs],  # a repeat that drafted where its median did not shows
        }
    pinned = [m for m in runs if m.startswith("pinned")]
    best = max(pinned, key=lambda m: row[m]["median"])
    other = best if row[best]["median"] >= row["plain"]["median"] else "plain"
    row["best"] = other
    row["best_pinned"] = best
    paired = [a / b for a, b in zip(row["default"]["tps"], row[other]["tps"])]
    row["regret"] = statistics.median(paired)
    row["interval"] = interval(paired)
    # Interference only slows a run: each mode's fastest repeat is its least disturbed one.
    others = [m for m in runs if m not in ("default", CONTROL)]
    row["regret_best"] = max(row["default"]["tps"]) / max(max(row[m]["tps"]) for m in others)
    row["control"] = statistics.median(a / b for a, b in zip(row[CONTROL]["tps"], row["plain"]["tps"]))
    return row


def table(modes, rows) -> list:
    modes = [m for m in modes if m != CONTROL]
    head = (
        "| prompt | "
        + " | ".join(f"{m} tok/s" for m in modes)
        + " | better of pinned/plain | default / better | its 95% interval | fastest repeats' ratio |"
        + " control: plain again / plain |"
    )
    lines = [head, "|---|" + "---:|" * (len(modes) + 5)]
    for name, row in rows.items():
        cells = [f"{row[m]['median']:.1f}" for m in modes]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {row['best']} | {row['regret']:.3f} | {row['interval'][0]:.2f}-{row['interval'][1]:.2f} |"
            + f" {row['regret_best']:.3f} |"
            + f" {row['control']:.3f} |"
        )
    med = {m: statistics.median(r[m]["median"] for r in rows.values()) for m in modes}
    lines.append("| **median** | " + " | ".join(f"{med[m]:.1f}" for m in modes) + " | | | | | |")
    worst = min(r["regret"] for r in rows.values())
    worst_best = min(r["regret_best"] for r in rows.values())
    above = med["default"] > max(v for m, v in med.items() if m != "default")
    lo, hi = min(r["control"] for r in rows.values()), max(r["control"] for r in rows.values())
    below = sum(r["interval"][1] < 0.97 for r in rows.values())
    unsure = sum(r["interval"][0] < 0.97 <= r["interval"][1] for r in rows.values())
    noise = (
        f" The control (plain decoding against itself, paired the same way) read {lo:.3f}-{hi:.3f}; "
        "a regret ratio no further from 1 than that is within this run's noise. "
        f"Prompts whose 95% interval lies wholly below 0.97 (a miss the noise cannot explain): {below}; "
        f"straddling it (this run cannot tell): {unsure} of {len(rows)}."
    )
    lines += [
        "",
        f"Worst regret ratio {worst:.3f} (goal >= 0.97: {'met' if worst >= 0.97 else 'not met'}); "
        f"default's median over prompts {'above' if above else 'NOT above'} every pinned width's and plain's. "
        f"Worst ratio of fastest repeats {worst_best:.3f}." + noise,
        "",
        "Default's widths (width:cycles, 1 = plain steps) and tau, median run (each repeat's where they differ):",
        "",
    ]

    def widths(w):
        return " ".join(f"{k}:{v}" for k, v in w.items())

    for name, row in rows.items():
        each = [widths(w) for w in row["default"]["widths_each"]]
        also = f"; repeats: {' | '.join(each)}" if len(set(each)) > 1 else ""
        lines.append(f"- {name}: {widths(row['default']['widths'])} (tau {row['default']['tau']:.2f}){also}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per generation (greedy)")
    ap.add_argument(
        "--reps", type=int, default=3, help="repeats: the modes take turns once per repeat; medians are over repeats"
    )
    ap.add_argument("--widths", default="2,4,8,16", help="pinned widths (those up to the draft's block run)")
    ap.add_argument("--load", default="quiet,busy", help="quiet, busy, or both (comma list)")
    ap.add_argument("--draft", action="append", default=[], help="another draft for the embedded target")
    ap.add_argument("--no-embedded", action="store_true", help="only the --draft pairs, not the embedded pair")
    ap.add_argument("--prompts", type=int, default=0, help="only the first N bench prompts (0: all)")
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "results" / "regret.md",
        help="the markdown result file; a .json of the same name is written beside it",
    )
    args = ap.parse_args()
    blas.ensure_openblas("auto")
    import mlx.core as mx

    from mlx_dflash.api import DEFAULT_MODEL, load
    from mlx_dflash.benchmark import read_prompts

    prompts = read_prompts()
    if args.prompts:
        prompts = dict(list(prompts.items())[: args.prompts])
    widths = [int(w) for w in args.widths.split(",")]
    loads = [x.strip() for x in args.load.split(",")]
    # As users run the embedded pair (mlx_dflash.load() casts it to float32;
    # its folders store float16, slow and not what runs on a CPU).
    engine = load()
    pairs = [] if args.no_embedded else [("embedded pair", engine.draft)]
    for d in args.draft:
        pairs.append((f"embedded target + {d}", load(DEFAULT_MODEL, d, dtype=mx.float32).draft))
    t0 = time.time()
    lines = [
        "# Width policy regret: default vs pinned widths vs plain",
        "",
        f"- command: `python bench/regret.py {' '.join(sys.argv[1:])}`",
        f"- machine: {platform.platform()} ({platform.machine()}, {os.cpu_count()} cores); load average "
        "%.1f %.1f %.1f at the start (ratios are within one process, the modes taking turns)" % os.getloadavg(),
        f"- BLAS: {blas.describe()}",
        f"- {args.max_tokens} tokens per generation, greedy; modes take turns one generation at a time "
        f"within each of {args.reps} repeats (after a warm-up each; the order turns by one each repeat), in one process; every mode's tokens equal "
        "plain decoding's",
        "- default = the adaptive policy (shadow drafts while plain, costs corrected only by what plain and "
        "drafted cycles show side by side; docs/policy.md); pinned B = `--block-size B`; plain = `--baseline`",
        "- regret ratio = median over repeats of default's tok/s / the better mode's (best pinned width or "
        "plain, by median) tok/s in the same repeat; its 95% interval = Student's t on the logarithms of those "
        "paired ratios (an interval for their geometric mean); fastest repeats' ratio = default's fastest repeat over the "
        "fastest repeat of any other mode (interference only slows a run: the fastest is the least disturbed); "
        "control = plain decoding run once more as a mode of its own, its ratio to plain taken as the regret "
        "ratio is (identical work: how far from 1 this run's noise alone moves a ratio)",
        "",
    ]
    data = {}
    for pair_name, draft in pairs:
        for ld in loads:
            burner = busy_core() if ld == "busy" else None
            try:
                print(f"{pair_name}, {ld}:", flush=True)
                modes, rows = measure(engine, draft, prompts, args.max_tokens, args.reps, widths)
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
            what = (
                "one core kept busy by a CPU-burning subprocess this script started (a pure-Python loop, pinned "
                "to core 0)"
                if ld == "busy"
                else "no load of this script's own"
            )
            lines += [f"## {pair_name} (block {draft.block_size}), {ld}: {what}", ""] + table(modes, rows) + [""]
            data[f"{pair_name} / {ld}"] = rows
    lines.append(
        f"Run took {(time.time() - t0) / 60:.1f} min; load average %.1f %.1f %.1f at the end." % os.getloadavg()
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
