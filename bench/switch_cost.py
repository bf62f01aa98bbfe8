"""What a change between plain steps and drafted cycles costs beyond the cost curve.

    python bench/switch_cost.py [--draft DIR] [--prompt NAME] [-n 128] [--reps 6]
                                [--every 16,8,4] [--out bench/results/switch-cost.md]

The width policy and the replays price a generation by the pair's cost curve:
plain runs (a fill, then their steps), drafted cycles, shadow drafts and the
rows the draft reads. Here scripted width sequences run on one prompt, in one
process, taking turns one generation at a time: plain decoding alone, the
full block pinned, and plain runs of k steps alternating with one drafted
cycle (k from ``--every``; no shadow drafts). Each run's wall time is set
against what the curve the policy uses (the on-disk cache's) says its plain
runs and its drafted cycles cost (``tools.replay.parts``). A least-squares
fit over the modes,

    observed = a * plain part + b * drafted part + c * changes

gives the machine's factor against the curve now for plain runs (a) and
for drafted cycles (b), each on its own (the curve may be off between them
as well), and what a change between plain steps and drafted cycles costs
that the curve does not price (c), given in plain steps as plain decoding
ran them in the same run. Greedy: every run's tokens must equal plain
decoding's.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_dflash import blas  # noqa: E402


class Script:
    """A policy stand-in: plain runs of ``every`` steps alternating with one
    drafted cycle of the full block (``every`` 0: the block alone; None: plain
    alone). Records each plan, its committed tokens and the rows the draft read."""

    costs = None
    switches: list = []

    def __init__(self, block: int, every):
        self.block, self.every, self.n = block, every, 0
        self.log = []  # [plan, committed]
        self.read = 0

    def plan(self, room, context=0, unread=0):
        from mlx_dflash.policy import Plan

        self.n += 1
        if room <= 1 or self.every is None:
            p = Plan(1, steps=max(room, 1))
        elif self.every == 0 or self.n % 2 == 0:
            p = Plan(min(self.block, room), block=self.block)
        else:
            p = Plan(1, steps=min(self.every, room))
        self.log.append([p, None])
        return p

    def observe(self, plan, committed):
        self.log[-1][1] = committed

    def timed(self, plan, committed, seconds, read=0):
        self.read += read

    def shadowed(self, *a, **k):
        from mlx_dflash.policy import NEVER

        return NEVER

    def drifted(self):
        return False

    def describe(self):
        return "scripted"


def fit(rows: dict, step: float) -> dict:
    """Least squares over the modes of observed = a * plain + b * drafted +
    c * changes: {"plain": a, "drafted": b, "change": c in plain steps of
    ``step`` seconds, "residual": the largest |observed - fitted| / observed}."""
    import numpy as np

    names = list(rows)
    A = np.array([[rows[m]["plain"], rows[m]["drafted"], rows[m]["changes"]] for m in names], dtype=float)
    y = np.array([rows[m]["observed"] for m in names], dtype=float)
    (a, b, c), *_ = np.linalg.lstsq(A, y, rcond=None)
    worst = float(np.max(np.abs(A @ np.array([a, b, c]) - y) / y))
    return {"plain": float(a), "drafted": float(b), "change": float(c) / step, "residual": worst}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="a draft folder (default: the embedded pair's draft)")
    ap.add_argument("--prompt", default="doc_to_code", help="which bench prompt (mlx_dflash/benchmark.py's set)")
    ap.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per generation")
    ap.add_argument("--reps", type=int, default=6, help="repeats of each mode (the median is reported)")
    ap.add_argument("--every", default="16,8,4", help="plain run lengths between two drafted cycles (comma list)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/switch-cost.md"), help="result file (markdown)")
    args = ap.parse_args()
    blas.ensure_openblas("auto")
    import mlx.core as mx

    from mlx_dflash.api import DEFAULT_MODEL, load
    from mlx_dflash.benchmark import first_difference, read_prompts
    from mlx_dflash.decode import GenerationStats, Hooks, _generate_tokens
    from mlx_dflash.policy import load_costs
    from tools.replay import changes, parts

    engine = load()
    draft = engine.draft if args.draft is None else load(DEFAULT_MODEL, args.draft, dtype=mx.float32).draft
    costs = load_costs(engine.target, draft)[0]
    ids = engine.encode(read_prompts()[args.prompt])
    every = [int(x) for x in args.every.split(",") if x]
    modes = {"plain": None, f"block {draft.block_size}": 0, **{f"plain {k} / cycle": k for k in every}}

    def run(mode):
        policy = Script(draft.block_size, modes[mode])
        st = GenerationStats()
        eos = engine.tokenizer.eos_token_ids
        gen = _generate_tokens(
            engine.target,
            ids,
            hooks=Hooks(policy=policy),
            draft=draft,
            max_tokens=args.max_tokens,
            eos_token_ids=eos,
            stats=st,
        )
        toks = [t for out in gen for t in out]
        log = [(p, n) for p, n in policy.log if n is not None]
        plans, kept = [p for p, _ in log], [n for _, n in log]
        return toks, st.decode_time, parts(plans, kept, costs, len(ids), policy.read), changes(plans)

    ref = run("plain")[0]
    for m in modes:  # a warm-up each (traces, allocations)
        run(m)
    times = {m: [] for m in modes}
    info = {}
    t0 = time.time()
    for _ in range(args.reps):
        for m in modes:
            toks, t, modelled, n = run(m)
            if toks != ref:
                raise SystemExit(f"{m}: differs from plain decoding at token {first_difference(toks, ref)}")
            times[m].append(t)
            info[m] = (modelled, n)
    rows = {
        m: {
            "observed": statistics.median(times[m]),
            "plain": info[m][0][0],
            "drafted": info[m][0][1],
            "changes": info[m][1],
        }
        for m in modes
    }
    step = rows["plain"]["observed"] / max(len(ref) - 1, 1)
    f = fit(rows, step)
    name = "embedded pair" if args.draft is None else f"embedded target + {args.draft}"
    lines = [
        "# What a change between plain steps and drafted cycles costs beyond the curve",
        "",
        "- command: `" + " ".join(["python bench/switch_cost.py"] + sys.argv[1:]) + "`",
        f"- machine: {platform.platform()} ({platform.machine()}, {os.cpu_count()} cores); BLAS: {blas.describe()}",
        f"- pair: {name} (block {draft.block_size}); prompt `{args.prompt}`, {args.max_tokens} tokens, greedy;"
        f" {args.reps} repeats, modes taking turns in one process; every run's tokens equal plain decoding's",
        f"- curve (the policy's, from the cost cache): plain step {costs.plain * 1e3:.2f} ms, fill {costs.plain_fill * 1e3:.2f} ms;"
        f" a plain step as plain decoding ran here {step * 1e3:.2f} ms",
        "",
        "| mode | observed ms | modelled plain part ms | modelled drafted part ms | changes | fitted ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m, r in rows.items():
        fitted = f["plain"] * r["plain"] + f["drafted"] * r["drafted"] + f["change"] * step * r["changes"]
        lines.append(
            f"| {m} | {r['observed'] * 1e3:.1f} | {r['plain'] * 1e3:.1f} | {r['drafted'] * 1e3:.1f} | {r['changes']} | {fitted * 1e3:.1f} |"
        )
    lines += [
        "",
        f"Fit (observed = a * plain part + b * drafted part + c * changes): a = {f['plain']:.3f}, b = {f['drafted']:.3f};"
        f" a change costs **{f['change']:.2f} plain steps** beyond the curve (largest misfit {100 * f['residual']:.1f}% of a run).",
    ]
    lines += ["", f"Run took {(time.time() - t0) / 60:.1f} min."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
