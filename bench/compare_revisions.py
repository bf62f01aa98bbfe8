"""Two revisions of this engine side by side on the 12-row bench (issue 24's acceptance).

    python bench/compare_revisions.py --base fb98f3a [--after REV] [--rounds 6]

``--base`` (and ``--after``, default: this working tree as it is, uncommitted
edits included) are checked out as detached git worktrees in a temporary
folder, removed at the end. Each round runs every row in one fresh process
per revision, the revisions taking turns (AB, then BA, then AB, ...: a
machine drifting over the run shifts both alike); within a process each
(row, mode) gets a warm-up, one timed run and one run synchronised after
each phase (``profile``). Rows: the prompts of ``mlx-dflash bench`` (the
package's ``bench_prompts``, chat template on) at ``--max-tokens`` 128 and
512, on the embedded pair, OpenBLAS preloaded when installed (as ``mlx-dflash
bench``: see docs/cpu.md).

Reported per row and mode: tok/s before and after (medians over rounds) and
after/before (the median over rounds of the ratio within a round); the
median ratio over rows; the cycle's non-forward time before and after:
from the synchronised run, the decode time per cycle less the draft and
verify phases (each ends in a host sync, so they are the forwards and their
sampling), i.e. GenerationStats' rollback_time + other_time per cycle:
accept, commit, cache rollback and the loop's host work. Greedy decoding:
every run's tokens must equal the base's plain decoding (checked, reported).
Writes bench/results/redesign-compare.md (``--out``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "redesign-compare.md"
MODES = ("dflash", "dflash-pinned", "baseline")  # dflash: the adaptive width policy (the default)
TOLERANCE = 0.03  # a row within 3% of the base is noise on this machine


# --- the worker: runs inside one revision's tree (imports that revision's package) ----------


def worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from mlx_dflash import blas

    blas.ensure_openblas(spec["blas"])  # re-executes this process once with OpenBLAS preloaded
    import mlx_dflash
    from mlx_dflash import GenerationStats, generate_tokens

    engine = mlx_dflash.load()
    chat = engine.tokenizer.chat_template is not None
    config = getattr(mlx_dflash, "GenerationConfig", None)  # revisions before it took keywords only

    def run(ids, n, mode, profile):
        st = GenerationStats()
        draft = None if mode == "baseline" else engine.draft
        options = dict(max_tokens=n, adaptive=mode != "dflash-pinned", profile=profile)
        args, options = ((config(**options),), {}) if config is not None else ((), options)
        toks = []
        for t in generate_tokens(
            engine.target, ids, *args, draft=draft, eos_token_ids=engine.tokenizer.eos_token_ids, stats=st, **options
        ):
            toks.extend(t)
        c = max(st.cycles, 1)
        return toks, {
            "tps": st.decode_tps,
            "cycles": st.cycles,
            "tau": st.tau,
            "ms_per_cycle": st.decode_time / c * 1e3,
            "draft_ms": st.draft_time / c * 1e3,
            "verify_ms": st.verify_time / c * 1e3,
            "non_forward_ms": (st.decode_time - st.draft_time - st.verify_time) / c * 1e3,
        }

    rows = []
    for name, text, n in spec["rows"]:
        ids = engine.encode(text, chat_template=chat)
        row = {"prompt": name, "max_tokens": n, "prompt_ids": ids, "modes": {}}
        for mode in spec["modes"]:
            run(ids, n, mode, False)  # warm-up (compiles this row's shapes)
            toks, timed = run(ids, n, mode, False)
            # The phase split (the run synchronised per phase) for the drafted modes.
            ptoks, prof = run(ids, n, mode, True) if mode != "baseline" else (toks, None)
            row["modes"][mode] = {
                "tokens": toks,
                "profiled_tokens_equal": ptoks == toks,
                "tps": timed["tps"],
                "cycles": timed["cycles"],
                "tau": timed["tau"],
                "ms_per_cycle": timed["ms_per_cycle"],
                "profiled": prof,
            }
        rows.append(row)
    Path(out_path).write_text(json.dumps({"blas": blas.describe(), "rows": rows}))


# --- the comparison: pure functions of the workers' results ------------------------------------


def summarize(before, after, modes=MODES) -> dict:
    """``before`` / ``after``: one worker result per round (same rows, same
    order). Per row and mode: median tok/s of each side, the median over
    rounds of the within-round ratio after/before, the median non-forward
    ms per cycle of each side, and whether every run's tokens (both sides,
    every round, timed and profiled) equal the base's plain decoding."""
    if not before or len(before) != len(after):
        raise ValueError("one result per round and side, as many rounds on each side")
    med = statistics.median
    rows = []
    for i, first in enumerate(before[0]["rows"]):
        out = {"prompt": first["prompt"], "max_tokens": first["max_tokens"], "modes": {}}
        plain = first["modes"]["baseline"]["tokens"]
        out["same_prompt"] = all(r["rows"][i]["prompt_ids"] == first["prompt_ids"] for r in before + after)
        for m in modes:
            b = [r["rows"][i]["modes"][m] for r in before]
            a = [r["rows"][i]["modes"][m] for r in after]
            out["modes"][m] = {
                "before_tps": med(x["tps"] for x in b),
                "after_tps": med(x["tps"] for x in a),
                "ratio": med(y["tps"] / x["tps"] if x["tps"] else 0.0 for x, y in zip(b, a)),
                "identical_tokens": all(x["tokens"] == plain and x["profiled_tokens_equal"] for x in b + a),
            }
            if m != "baseline":
                out["modes"][m]["before_non_forward_ms"] = med(x["profiled"]["non_forward_ms"] for x in b)
                out["modes"][m]["after_non_forward_ms"] = med(x["profiled"]["non_forward_ms"] for x in a)
        rows.append(out)
    medians = {m: med(r["modes"][m]["ratio"] for r in rows) for m in modes}
    nf = {
        m: (
            med(r["modes"][m]["before_non_forward_ms"] for r in rows),
            med(r["modes"][m]["after_non_forward_ms"] for r in rows),
        )
        for m in modes
        if m != "baseline"
    }
    slow = {
        m: [f"{r['prompt']}/{r['max_tokens']}" for r in rows if r["modes"][m]["ratio"] < 1 - TOLERANCE] for m in modes
    }
    return {
        "rows": rows,
        "modes": list(modes),
        "rounds": len(before),
        "median_ratio": medians,
        "non_forward_ms": nf,
        "rows_below_tolerance": slow,
        "identical_tokens": all(
            r["same_prompt"] and all(x["identical_tokens"] for x in r["modes"].values()) for r in rows
        ),
    }


def to_markdown(s: dict, header) -> str:
    modes = s["modes"]
    drafted = [m for m in modes if m != "baseline"]
    lines = ["# Before/after: two revisions on the 12-row bench", ""] + [f"- {h}" for h in header]
    lines += [
        f"- rounds: {s['rounds']}, the revisions taking turns (AB, BA, ...), a fresh process per revision and round; "
        "tok/s: the median over rounds; after/before: the median over rounds of the ratio within a round",
        f"- every run's tokens (both revisions, every mode and round) equal the base's plain decoding: "
        f"{s['identical_tokens']}",
        "",
        "| prompt | max | "
        + " | ".join(f"{m} before tok/s | {m} after tok/s | {m} after/before" for m in modes)
        + " |",
        "|---|---:|" + "---:|---:|---:|" * len(modes),
    ]
    for r in s["rows"]:
        cells = [r["prompt"], str(r["max_tokens"])]
        for m in modes:
            x = r["modes"][m]
            cells += [f"{x['before_tps']:.1f}", f"{x['after_tps']:.1f}", f"{x['ratio']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""]
    for m in modes:
        slow = s["rows_below_tolerance"][m]
        lines.append(
            f"- {m}: median after/before {s['median_ratio'][m]:.3f}; rows below {1 - TOLERANCE:.2f}: "
            + (", ".join(slow) if slow else "none")
        )
    lines += [
        "",
        "The cycle's non-forward time, ms per cycle (from the run synchronised after each phase: decode time "
        "less the draft and verify phases, i.e. accept, commit, cache rollback and the loop's host work; "
        "a plain step counts as a cycle):",
        "",
        "| prompt | max | " + " | ".join(f"{m} before | {m} after" for m in drafted) + " |",
        "|---|---:|" + "---:|---:|" * len(drafted),
    ]
    for r in s["rows"]:
        cells = [r["prompt"], str(r["max_tokens"])]
        for m in drafted:
            x = r["modes"][m]
            cells += [f"{x['before_non_forward_ms']:.2f}", f"{x['after_non_forward_ms']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""]
    for m in drafted:
        b, a = s["non_forward_ms"][m]
        lines.append(f"- {m}: median over rows {b:.2f} ms before, {a:.2f} ms after")
    return "\n".join(lines) + "\n"


# --- driving it ---------------------------------------------------------------------------------


def git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def describe_tree(tree: Path, rev) -> str:
    sha = git("rev-parse", "--short", "HEAD", cwd=tree)
    if rev is not None:
        return f"{rev} ({sha})"
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    return f"working tree at {sha}" + (" with uncommitted changes" if dirty else "")


def run_worker(tree: Path, spec: Path, out: Path, log) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec), str(out)], cwd=tree, env=env, check=True
    )
    log(f"  {tree}: {time.perf_counter() - t:.0f} s")
    return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the revision before (any git revision)")
    ap.add_argument("--after", default=None, help="the revision after (default: this working tree as it is)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="rounds, each running every row once per revision (even: as many AB as BA)",
    )
    ap.add_argument("--max-tokens", "-n", type=int, action="append", help="generation lengths (default: 128 and 512)")
    ap.add_argument("--rows", type=int, default=None, help="only the first N prompts (a quick check)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of: {', '.join(MODES)}")
    ap.add_argument("--blas", default="auto", choices=["auto", "openblas", "bundled"], help="as mlx-dflash bench")
    ap.add_argument("--out", type=Path, default=OUT, help="the markdown result file")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    if not args.base:
        ap.error("--base REV is required")
    modes = tuple(args.modes.split(","))
    if set(modes) - set(MODES) or "baseline" not in modes or args.rounds < 1:
        ap.error(f"--modes: a comma list of {', '.join(MODES)} including baseline; --rounds >= 1")
    sys.path.insert(0, str(ROOT))  # this tree's package, for the prompt set
    from mlx_dflash.benchmark import read_prompts

    prompts = list(read_prompts().items())[: args.rows]
    lengths = args.max_tokens or [128, 512]
    rows = [(name, text, n) for name, text in prompts for n in lengths]
    tic, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="compare-revisions-") as tmp:
        tmp = Path(tmp)
        spec = tmp / "spec.json"
        spec.write_text(json.dumps({"rows": rows, "modes": modes, "blas": args.blas}))
        trees = {}
        try:
            for side, rev in (("before", args.base), ("after", args.after)):
                if rev is None:
                    trees[side] = ROOT
                else:
                    trees[side] = tmp / side
                    git("worktree", "add", "--detach", str(trees[side]), rev)
            results = {"before": [], "after": []}
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                print(f"round {r + 1}/{args.rounds}", flush=True)
                for side in order:
                    results[side].append(run_worker(trees[side], spec, tmp / f"{side}{r}.json", print))
            header = [
                f"before: {describe_tree(trees['before'], args.base)}; after: {describe_tree(trees['after'], args.after)}",
                f"BLAS: {results['before'][0]['blas']}",
                f"rows: {len(rows)} (prompts {', '.join(p for p, _ in prompts)} at {', '.join(map(str, lengths))} "
                f"tokens), embedded pair, greedy; modes: {', '.join(modes)} (dflash = the adaptive width policy, "
                "dflash-pinned = the full-width chain)",
            ]
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    git("worktree", "remove", "--force", str(tree))
    s = summarize(results["before"], results["after"], modes)
    header.append(
        f"wall time: {time.perf_counter() - tic:.0f} s; load average (1 min) at the start {load:.1f}, "
        f"at the end {os.getloadavg()[0]:.1f} (this run's own process counts 1; more: other work shared the CPU)"
    )
    text = to_markdown(s, header)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    if not s["identical_tokens"]:
        sys.exit("tokens differ between revisions (see the table's header)")


if __name__ == "__main__":
    main()
