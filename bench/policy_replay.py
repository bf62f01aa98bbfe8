"""The width policy's regret without timing noise: replayed acceptance, modelled costs.

    python bench/policy_replay.py [-n 128,512] [--sweep 128,192,...] [--widths 4,8,16]
                                  [--draft DIR ...] [--out bench/results/policy-replay.md]

For each pair (the embedded pair in float32, then each ``--draft`` with the
embedded target) and each bench prompt: one plain greedy decoding with the
draft proposing from every anchor (tools/replay.record: a greedy draft's
proposal depends only on the committed tokens, so this is what any policy
would see), then the default policy replayed against it
(tools/replay.drive, shadow drafts included) and every pinned width and
plain decoding priced by the pair's measured cost model
(``mlx_dflash.policy.load_costs``, as the policy itself prices widths).
Regret ratio = the better of (best pinned width, plain) seconds / default's
seconds (tokens per second alike). This isolates what the policy's choices
cost from the noise of a shared machine; ``bench/regret.py`` measures the
real thing (timed, quiet and busy). ``--sweep``: the worst ratio per pair at
more lengths (a policy's exploration is a fixed cost, so regret shrinks as
generations grow). ``--offsets K``: each prompt is also replayed from K
start offsets (its record's first k tokens taken as more prompt, k < K).
Where the first looks fall decides much of a short generation (a warm-up
cycle that lands on a miss sends it plain), so one start is partly luck;
the median over starts is the policy's, the lowest its bad luck. But the
prompt's own start is the one every real generation has, and it is not
like the others: the first few tokens after a prompt are where these
drafts miss most (docs/policy.md, "What was tried", stop 57), so a later
start reads the plain steps the policy takes there as pure cost.

``--curve bench/results/real-shapes.md`` prices the replay at the cost
ratios a ``bench/real_shapes.py`` run measured (its "/ T_plain" column:
T_verify(B), T_draft at the pair's block, T_rollback there) in place of the
pair's own curve: what the policy would choose, and lose, on the same recorded
acceptance where a cycle costs what it does at a real Qwen3.5 shape rather than
at the 8M target's, whose cycles are mostly dispatch. (The draft's cost per
context row read stays the pair's own.)

``--assume draft=0.15,row=0.03`` prices the replay at assumed ratios
instead (a draft forward at 0.15 plain steps, a verify of B rows at
1 + 0.03(B - 1)): a what-if for a device whose forwards read weights rather
than compute, as a GPU does at real shapes, where this CPU computes. The
result says the figures are assumed.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--max-tokens", default="128,512", help="tokens per generation (comma list)")
    ap.add_argument("--sweep", default="128,192,256,384,512", help="lengths of the worst-ratio summary (comma list)")
    ap.add_argument("--widths", default="4,8,16", help="pinned widths compared (up to each draft's block)")
    ap.add_argument(
        "--offsets",
        type=int,
        default=8,
        help="start offsets each prompt is also replayed from (1: its own start only)",
    )
    ap.add_argument("--draft", action="append", default=[], help="another draft for the embedded target")
    ap.add_argument(
        "--curve",
        type=Path,
        help="a bench/real_shapes.py result (.md): price every pair by its cost ratios to a plain step",
    )
    ap.add_argument(
        "--assume",
        metavar="draft=D,row=R[,rollback=X]",
        help="price every pair by assumed ratios to a plain step, not measured ones: a draft forward at D, "
        "a verify of B rows at 1 + R*(B-1), a rollback at X (default 0.02); what-if figures for a device "
        "whose forwards read weights rather than compute (a GPU at real shapes)",
    )
    ap.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "policy-replay.md", help="the markdown result file"
    )
    args = ap.parse_args()
    if args.curve and args.assume:
        ap.error("--curve and --assume both say what to price by: give one")
    if args.offsets < 1:
        ap.error("--offsets must be at least 1")
    ratios = read_curve(args.curve) if args.curve else assumed(args.assume, ap) if args.assume else None
    blas.ensure_openblas("auto")
    import mlx.core as mx

    from mlx_dflash.api import DEFAULT_MODEL, load
    from mlx_dflash.benchmark import read_prompts

    t0 = time.time()
    engine = load()
    pairs = [("embedded pair", engine.draft)]
    for d in args.draft:
        pairs.append((f"embedded target + {d}", load(DEFAULT_MODEL, d, dtype=mx.float32).draft))
    prompts = read_prompts()
    lines = [
        "# Width policy regret, replayed: recorded acceptance, modelled costs",
        "",
        f"- command: `python bench/policy_replay.py {' '.join(sys.argv[1:])}`",
        f"- machine: {platform.platform()} ({platform.machine()}, {os.cpu_count()} cores); BLAS: {blas.describe()}",
        f"- {args.max_tokens} tokens per prompt (each length its own tables), greedy; each prompt decoded once with the draft proposing from "
        "every anchor, every mode replayed against that record and priced by the pair's cost model (no timing)",
        "- regret ratio = seconds of the better of (best pinned width, plain) / seconds of the default policy",
    ]
    if args.curve:
        lines.append(
            f"- costs: the ratios to a plain step that `{args.curve}` measured, in place of each pair's own "
            "curve (plain step in seconds and the draft's cost per context row: the pair's)"
        )
    elif args.assume:
        lines.append(
            f"- costs: ASSUMED, not measured (`--assume {args.assume}`): ratios to a plain step in place of each "
            "pair's own curve (plain step in seconds and the draft's cost per context row: the pair's)"
        )
    lines.append("")
    lengths = [int(x) for x in args.max_tokens.split(",")]
    sweep = [int(x) for x in args.sweep.split(",") if x]
    longest = max(lengths + sweep) + args.offsets - 1  # every start offset gets the full length
    records = {}  # (pair, prompt) -> right per block, recorded once at the longest length
    worst = {}  # (pair, length) -> (the worst ratio over the prompts, the worst prompt's median over starts)
    for n_tokens in sorted(set(lengths + sweep)):
        for name, draft in pairs:
            part = section(
                engine, name, draft, prompts, n_tokens, longest, args.widths, records, worst, ratios, args.offsets
            )
            if n_tokens in lengths:
                lines += part
    if sweep:
        lines += [
            "## Worst ratio over the prompts, by generation length",
            "",
            "The same records replayed at each length (a prompt's first N tokens): from each prompt's own start, "
            f"and the worst prompt's median over {args.offsets} start offsets.",
            "",
            "| pair | start | " + " | ".join(str(n) for n in sweep) + " |",
            "|---|---|" + "---:|" * len(sweep),
        ]
        for name, _ in pairs:
            lines.append(f"| {name} | own | " + " | ".join(f"{worst[name, n][0]:.3f}" for n in sweep) + " |")
            if args.offsets > 1:
                lines.append(
                    f"| {name} | median of {args.offsets} | "
                    + " | ".join(f"{worst[name, n][1]:.3f}" for n in sweep)
                    + " |"
                )
        lines.append("")
    lines.append(f"Run took {(time.time() - t0) / 60:.1f} min.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def read_curve(path: Path) -> dict:
    """The ``| T_name(B) | ms | ratio |`` rows of a bench/real_shapes.py result:
    term -> its ratio to the engine's plain step (the first model's column)."""
    import re

    if not path.is_file():
        sys.exit(f"error: --curve {path}: no such file")
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\|\s*(T_(?:verify|draft|rollback)\(\d+\))\s*\|\s*[\d.]+\s*\|\s*([\d.]+)\s*\|", line)
        if m:
            out.setdefault(m.group(1), float(m.group(2)))
    if not any(k.startswith("T_verify") for k in out) or not any(k.startswith("T_draft") for k in out):
        sys.exit(f"error: --curve {path}: no 'T_verify(B)' and 'T_draft(B)' rows with a '/ T_plain' column")
    return out


def assumed(spec: str, ap) -> dict:
    """``--assume draft=D,row=R[,rollback=X]`` as :func:`read_curve`'s ratios
    (verifies of 2..64 rows; :func:`priced` keeps those up to each block)."""
    try:
        given = {k.strip(): float(v) for k, v in (part.split("=") for part in spec.split(","))}
    except ValueError:
        ap.error(f"--assume {spec!r}: expected draft=D,row=R[,rollback=X] with numbers")
    unknown = set(given) - {"draft", "row", "rollback"}
    if unknown or not {"draft", "row"} <= set(given) or any(v < 0 for v in given.values()):
        ap.error(f"--assume {spec!r}: expected draft=D,row=R[,rollback=X], each >= 0")
    out = {f"T_verify({B})": 1.0 + given["row"] * (B - 1) for B in range(2, 65)}
    out["T_draft(1)"] = given["draft"]
    out["T_rollback(1)"] = given.get("rollback", 0.02)
    return out


def priced(costs, block: int, ratios: dict):
    """``costs`` with its parts replaced by ``ratios`` (to its own plain step):
    verifies at every width measured up to ``block``, and the draft and
    rollback at the block (or the nearest width measured below it)."""
    import dataclasses

    def at(kind, B):
        widths = [int(k[len(kind) + 1 : -1]) for k in ratios if k.startswith(kind + "(")]
        below = [w for w in widths if w <= B]
        return ratios[f"{kind}({max(below) if below else min(widths)})"]

    verify = {
        int(k[9:-1]): v * costs.plain for k, v in ratios.items() if k.startswith("T_verify(") and int(k[9:-1]) <= block
    }
    draft = at("T_draft", block) * costs.plain
    rollback = at("T_rollback", block) * costs.plain if any(k.startswith("T_rollback(") for k in ratios) else 0.0
    return dataclasses.replace(
        costs, verify=verify, draft={B: draft for B in verify}, rollback=rollback, tree={}, fixes=[], warm=set()
    )


def section(engine, name, draft, prompts, n_tokens, longest, widths_arg, records, worst_of, ratios=None, offsets=1):
    """One pair at one generation length: its table's lines (its worst ratio,
    and its worst prompt's median over ``offsets`` starts, into
    ``worst_of``). Each prompt is recorded once, at the ``longest`` length;
    shorter runs and later starts replay part of it."""
    from mlx_dflash.policy import Policy, load_costs
    from tools.replay import record, regret_row, widths_used

    costs, _ = load_costs(engine.target, draft)
    if ratios:
        costs = priced(costs, draft.block_size, ratios)
    widths = [w for w in (int(x) for x in widths_arg.split(",")) if 2 <= w <= draft.block_size]
    ratios = " ".join(f"B{B}:{costs.cycle(B) / costs.plain:.2f}" for B in sorted(costs.verify))
    starts = f" | over {offsets} starts: median | lowest" if offsets > 1 else ""
    lines = [
        f"## {name} (block {draft.block_size}), {n_tokens} tokens",
        "",
        f"Cost model: plain step {costs.plain * 1e3:.2f} ms; cycle / plain step {ratios}; a shadow draft "
        f"{costs.full_draft() / costs.plain:.2f} plain steps.",
        "",
        "| prompt | default tok/s | " + " | ".join(f"pinned {w}" for w in widths) + " | plain | better | "
        f"default / better | shadows | default's widths{starts} |",
        "|---|" + "---:|" * (len(widths) + 2) + "---|---:|---:|---|" + "---:|---:|" * (offsets > 1),
    ]
    modes = [f"pinned {w}" for w in widths] + ["plain"]
    worst, medians, tps = [], [], {m: [] for m in ["default"] + modes}
    for prompt, text in prompts.items():
        key = (name, prompt)
        if key not in records:
            blocks = sorted(set(widths) | {draft.block_size})
            ids = engine.encode(text)
            records[key] = record(engine.target, draft, ids, longest, blocks, engine.tokenizer.eos_token_ids)
        out, right = records[key]
        each = []
        for k in range(offsets):
            # From start k: the record's first k tokens taken as more prompt.
            total = min(n_tokens, len(out) - k)  # an EOS may end the text sooner
            if total < 2:
                break
            row = regret_row(
                lambda: Policy(draft.block_size, costs),
                {B: r[k : k + total] for B, r in right.items()},
                total,
                costs,
                widths,
            )
            each.append(min(row[m] for m in modes) / row["default"])
            if k == 0:
                first, n = row, total - 1  # the first token comes from the prefill in every mode
        row = first
        better = min(modes, key=lambda m: row[m])
        ratio = each[0]
        worst.append(ratio)
        medians.append(statistics.median(each))
        for m in tps:
            tps[m].append(n / row[m])
        cells = " | ".join(f"{n / row[m]:.1f}" for m in modes)
        over = f" | {medians[-1]:.3f} | {min(each):.3f}" if offsets > 1 else ""
        lines.append(
            f"| {prompt} | {n / row['default']:.1f} | {cells} | {better} | {ratio:.3f} | {row['shadows']} | "
            f"{widths_used(row['plans'], row['kept'])}{over} |"
        )
        print(f"{name}, {n_tokens} tokens, {prompt}: default / better {ratio:.3f}", flush=True)
    med = {m: statistics.median(v) for m, v in tps.items()}
    lines.append(
        "| **median** | "
        + " | ".join(f"{med[m]:.1f}" for m in ["default"] + modes)
        + " | | | | |"
        + " | |" * (offsets > 1)
    )
    above = all(med["default"] > v for m, v in med.items() if m != "default")
    worst_of[name, n_tokens] = (min(worst), min(medians))
    lines += [
        "",
        f"Worst ratio {min(worst):.3f} (goal >= 0.97); default's median {'above' if above else 'NOT above'} every "
        "pinned width's and plain's."
        + (
            f" Over {offsets} start offsets, the worst prompt's median ratio {min(medians):.3f}." if offsets > 1 else ""
        ),
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
