"""The width policy's regret when the cycle times it reads are noisy: replays with a seeded clock.

    python bench/policy_noise.py [--draft DIR ...] [-n 128,256,512] [--seeds 6]
                                 [--out bench/results/policy-noise.md]

``bench/policy_replay.py`` replays the policy against recorded acceptance and
prices every mode by a cost model; there the policy reads no clock. Here it
reads one, as it does when it runs: a drafted cycle takes its modelled cost
times a lognormal factor of the given spread, a run of plain steps its
steps' (the factor's spread shrinking with the run's length, the steps being
independent), and the shadow drafts it carried. Scenarios add stalls (a
tenth of the cycles 2.5x slow, alike for every width) and a curve that is
off (drafted cycles really ``bias`` times what it says, plain steps as it
says). A pair's prompts run one after another on one cost curve, as in one
process, so the correction's samples carry over from prompt to prompt.
Every mode is priced by the true costs.

Cells: each pair at each length, priced by five curves (the pair's own,
``bench/results/real-shapes.md``, ``bench/results/moe-shape.md`` and the
assumed ``draft=0.15,row=0.03`` and ``draft=0.3,row=0.05``, as
``bench/policy_replay.py`` prices them). Per scenario and rule: the mean over
the cells of the worst ratio over the prompts (averaged over seeds), the
mean ratio, the cells whose worst is under 0.97, and the lowest worst ratio
of any seed. Rules: the default, and the previous correction (the median of
the last 5 samples) side by side in the same run.
"""

import argparse
import copy
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mlx_dflash import blas  # noqa: E402

# (name, lognormal spread of a cycle's time, stalls, drafted cycles' true cost over the curve's)
SCENARIOS = [
    ("exact clock", 0.0, False, 1.0),
    ("noise 0.05, curve 1.3x off", 0.05, False, 1.3),
    ("noise 0.15", 0.15, False, 1.0),
    ("noise 0.15, stalls", 0.15, True, 1.0),
    ("noise 0.15, curve 1.3x off", 0.15, False, 1.3),
    ("noise 0.15, stalls, curve 1.3x off", 0.15, True, 1.3),
    ("noise 0.15, curve 0.8x off", 0.15, False, 0.8),
    ("noise 0.25, stalls", 0.25, True, 1.0),
]
CURVES = ["own", "real shape", "MoE shape", "assumed 0.15/0.03", "assumed 0.3/0.05"]


def truth_of(costs, bias: float):
    """What cycles really cost where the curve is off: drafted parts ``bias`` times it."""
    t = copy.copy(costs)
    t.verify = {k: v * bias for k, v in costs.verify.items()}
    t.draft = {k: v * bias for k, v in costs.draft.items()}
    t.rollback = costs.rollback * bias
    return t


def noisy_clock(policy, truth, rng: random.Random, spread: float, stalls: bool):
    """``clock(plan, committed, read)`` for tools.replay.drive: true seconds times noise."""

    def clock(plan, committed, read=0):
        if plan.width == 1:
            base = truth.plain_run(committed, policy.context) + policy.run_shadows * truth.full_draft()
            noise = math.exp(rng.gauss(0.0, spread / math.sqrt(max(committed, 1))))
        else:
            base = truth.cycle(plan.width, policy.context)
            noise = math.exp(rng.gauss(0.0, spread))
        stall = 2.5 if stalls and rng.random() < 0.1 else 1.0
        return (base + truth.read(read)) * noise * stall

    return clock


def cell(make_policy, costs, block, records, tokens, widths, seeds, scenario):
    """(mean over seeds of the worst ratio, mean ratio, lowest worst) for one pair, curve and length."""
    from tools.replay import drive, pinned_seconds, plain_seconds, replayed, seconds

    _, spread, stalls, bias = scenario
    worsts, means = [], []
    for seed in range(seeds):
        curve = copy.copy(costs)
        curve.fixes, curve.warm = [], set(range(2, block + 1))  # traced already: every cycle timed
        truth = truth_of(curve, bias)
        rng = random.Random(seed)
        ratios = []
        for out, right in records:
            total = min(tokens, len(out))
            policy = make_policy(block, curve)
            kept, reads = [], []
            clock = noisy_clock(policy, truth, rng, spread, stalls)
            plans = drive(
                policy, replayed(right[block][:total]), 0, tokens=total - 1, committed=kept, reads=reads, clock=clock
            )
            default = seconds(plans, kept, truth, policy.shadows, read=sum(reads))
            pinned = [pinned_seconds(right[w][:total], w, total - 1, truth)[0] for w in widths]
            ratios.append(min(pinned + [plain_seconds(total - 1, truth)]) / default)
        worsts.append(min(ratios))
        means.append(statistics.mean(ratios))
    return statistics.mean(worsts), statistics.mean(means), min(worsts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--max-tokens", default="128,256,512", help="tokens per generation (comma list)")
    ap.add_argument("--seeds", type=int, default=6, help="noise seeds per cell")
    ap.add_argument("--draft", action="append", default=[], help="another draft for the embedded target")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "policy-noise.md", help="the markdown result file"
    )
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    blas.ensure_openblas("auto")
    import mlx.core as mx
    from policy_replay import assumed, priced, read_curve

    from mlx_dflash.api import DEFAULT_MODEL, load
    from mlx_dflash.benchmark import read_prompts
    from mlx_dflash.policy import Policy, load_costs, recent_median
    from tools.replay import record

    class Median5(Policy):
        """The previous correction: the median of the last 5 samples."""

        def correction(self):
            return recent_median(self.fixes, 5)

    rules = {"default": Policy, "median of 5": Median5}
    t0 = time.time()
    lengths = [int(x) for x in args.max_tokens.split(",")]
    engine = load()
    pairs = [("embedded pair", engine.draft)]
    for d in args.draft:
        pairs.append((f"embedded target + {d}", load(DEFAULT_MODEL, d, dtype=mx.float32).draft))
    prompts = read_prompts()
    ratios = {
        "real shape": read_curve(ROOT / "bench" / "results" / "real-shapes.md"),
        "MoE shape": read_curve(ROOT / "bench" / "results" / "moe-shape.md"),
        "assumed 0.15/0.03": assumed("draft=0.15,row=0.03", ap),
        "assumed 0.3/0.05": assumed("draft=0.3,row=0.05", ap),
    }
    cells = []  # (pair, curve name, costs, block, records, widths)
    for name, draft in pairs:
        own, _ = load_costs(engine.target, draft)
        widths = [w for w in (4, 8, 16) if w <= draft.block_size]
        blocks = sorted(set(widths) | {draft.block_size})
        recs = []
        for prompt, text in prompts.items():
            print(f"recording {name}: {prompt}", flush=True)
            ids = engine.encode(text)
            recs.append(record(engine.target, draft, ids, max(lengths), blocks, engine.tokenizer.eos_token_ids))
        for curve in CURVES:
            costs = own if curve == "own" else priced(own, draft.block_size, ratios[curve])
            cells.append((name, curve, costs, draft.block_size, recs, widths))
    lines = [
        "# Width policy regret under a noisy clock: replayed acceptance, timings with noise",
        "",
        f"- command: `python bench/policy_noise.py {' '.join(sys.argv[1:])}`",
        f"- machine: {platform.platform()} ({platform.machine()}, {os.cpu_count()} cores); BLAS: {blas.describe()}",
        f"- pairs: {', '.join(n for n, _ in pairs)}; {args.max_tokens} tokens; curves: {', '.join(CURVES)}; "
        f"{len(cells) * len(lengths)} cells, {args.seeds} seeds each; the six bench prompts one after another "
        "on one curve per seed",
        "- a cycle's time: its true cost times exp(N(0, spread)) (a plain run: spread / sqrt(steps)); stalls: "
        "a tenth of the cycles 2.5x slow; curve off: drafted cycles really cost that much times the curve",
        "- ratio = seconds of the better of (best pinned width, plain) / the rule's seconds, priced by the true costs",
        "",
        "| scenario | rule | mean worst | mean ratio | cells under 0.97 | lowest worst |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for scenario in SCENARIOS:
        for rule, make in rules.items():
            got = [
                cell(make, costs, block, recs, n, widths, args.seeds, scenario)
                for _, _, costs, block, recs, widths in cells
                for n in lengths
            ]
            worst = statistics.mean(g[0] for g in got)
            mean = statistics.mean(g[1] for g in got)
            under = sum(g[0] < 0.97 for g in got)
            lowest = min(g[2] for g in got)
            lines.append(f"| {scenario[0]} | {rule} | {worst:.4f} | {mean:.4f} | {under} | {lowest:.3f} |")
            print(f"{scenario[0]:36s} {rule:12s} mean worst {worst:.4f} mean {mean:.4f} under {under}", flush=True)
    lines += ["", f"Run took {(time.time() - t0) / 60:.1f} min."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
