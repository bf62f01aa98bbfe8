"""Two revisions of the package in ONE process, their runs alternating.

    python bench/compare_inprocess.py --base bf34d5a [--reps 5] [-n 128]

``compare_revisions.py`` runs each revision in its own process for minutes
at a time; on a shared 2-core machine the speed drifts by 2-3x over such
spans, more than the differences it looks for. Here the base revision's
package is extracted (``git archive``) as ``mlx_dflash_base`` next to this
tree's ``mlx_dflash`` (the package imports itself relatively only, so both
load side by side), each loads the embedded pair, and every (row, mode) runs
base, this tree, base, this tree... one generation at a time: drift hits
both alike. Reported per row and mode: the median over repetitions of the
within-pair ratio this/base of tok/s, and of the cycle's non-forward time
(decode time less the draft and verify phases per cycle, from a run
synchronised per phase). Greedy: every run's tokens must equal the base's
plain decoding. Writes bench/results/redesign-inprocess.md.
"""

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "redesign-inprocess.md"
MODES = ("dflash", "dflash-pinned", "baseline")


def extract_base(rev: str, into: Path) -> None:
    """The revision's package, renamed ``mlx_dflash_base``, under ``into``."""
    data = subprocess.run(["git", "archive", rev, "mlx_dflash"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "mlx_dflash").rename(into / "mlx_dflash_base")


def runner(pkg):
    engine = pkg.load()
    config = getattr(pkg, "GenerationConfig", None)

    def run(ids, n, mode, profile):
        st = pkg.GenerationStats()
        options = dict(max_tokens=n, adaptive=mode != "dflash-pinned", profile=profile)
        args, options = ((config(**options),), {}) if config is not None else ((), options)
        draft = None if mode == "baseline" else engine.draft
        toks = []
        for t in pkg.generate_tokens(
            engine.target, ids, *args, draft=draft, eos_token_ids=engine.tokenizer.eos_token_ids, stats=st, **options
        ):
            toks.extend(t)
        c = max(st.cycles, 1)
        return toks, st.decode_tps, (st.decode_time - st.draft_time - st.verify_time) / c * 1e3

    return engine, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision before (any git revision)")
    ap.add_argument("--reps", type=int, default=5, help="alternating pairs per (row, mode)")
    ap.add_argument("--max-tokens", "-n", type=int, action="append", help="generation lengths (default 128 and 512)")
    ap.add_argument("--rows", type=int, default=None, help="only the first N prompts (a quick check)")
    ap.add_argument("--out", type=Path, default=OUT, help="the markdown result file")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlx_dflash import blas

    blas.ensure_openblas("auto")
    tmp = Path(tempfile.mkdtemp(prefix="compare-inprocess-"))
    extract_base(args.base, tmp)
    sys.path.insert(0, str(tmp))
    new_pkg = importlib.import_module("mlx_dflash")
    base_pkg = importlib.import_module("mlx_dflash_base")
    assert Path(new_pkg.__file__).parent == ROOT / "mlx_dflash", new_pkg.__file__
    from mlx_dflash.benchmark import read_prompts

    base_engine, run_base = runner(base_pkg)
    _, run_new = runner(new_pkg)
    chat = base_engine.tokenizer.chat_template is not None
    prompts = list(read_prompts().items())[: args.rows]
    lengths = args.max_tokens or [128, 512]
    med = statistics.median
    rows, all_equal = [], True
    for name, text in prompts:
        ids = base_engine.encode(text, chat_template=chat)
        for n in lengths:
            plain = run_base(ids, n, "baseline", False)[0]
            row = {"prompt": name, "n": n}
            for mode in MODES:
                for run in (run_base, run_new):
                    run(ids, n, mode, False)  # warm-up: this row's shapes compiled
                tps, nf = [], []
                for _ in range(args.reps):
                    (tb, vb, _), (tn, vn, _) = run_base(ids, n, mode, False), run_new(ids, n, mode, False)
                    all_equal &= tb == plain and tn == plain
                    tps.append((vb, vn))
                    if mode != "baseline":
                        (_, _, fb), (_, _, fn) = run_base(ids, n, mode, True), run_new(ids, n, mode, True)
                        nf.append((fb, fn))
                row[mode] = {
                    "base": med(b for b, _ in tps),
                    "new": med(x for _, x in tps),
                    "ratio": med(x / b for b, x in tps),
                    "nf": (med(b for b, _ in nf), med(x for _, x in nf)) if nf else None,
                }
            rows.append(row)
            print(name, n, "  ".join(f"{m} {row[m]['ratio']:.3f}" for m in MODES), flush=True)
    lines = [
        "# The redesign, before and after, in one process",
        "",
        f"`python bench/compare_inprocess.py --base {args.base} --reps {args.reps}`: base `{args.base}` "
        f"(as `mlx_dflash_base`) and this tree's package in one process, runs alternating; embedded pair, "
        f"greedy, {blas.describe()}. Ratios are this/base (median over {args.reps} pairs); non-forward "
        "time is per cycle (ms, base -> this). Tokens equal plain decoding in every run: "
        f"**{all_equal}**.",
        "",
        "| prompt | tokens | " + " | ".join(f"{m} ratio" for m in MODES) + " | non-forward ms (dflash) | (pinned) |",
        "|---|---:|" + "---:|" * (len(MODES) + 2),
    ]
    for r in rows:
        nf = [f"{r[m]['nf'][0]:.2f} -> {r[m]['nf'][1]:.2f}" for m in ("dflash", "dflash-pinned")]
        lines.append(
            f"| {r['prompt']} | {r['n']} | "
            + " | ".join(f"{r[m]['ratio']:.3f}" for m in MODES)
            + f" | {' | '.join(nf)} |"
        )
    meds = {m: med(r[m]["ratio"] for r in rows) for m in MODES}
    nfm = {m: (med(r[m]["nf"][0] for r in rows), med(r[m]["nf"][1] for r in rows)) for m in ("dflash", "dflash-pinned")}
    lines += [
        "",
        "Median ratio over rows: " + ", ".join(f"{m} {v:.3f}" for m, v in meds.items()) + ".",
        "Median non-forward ms per cycle: " + ", ".join(f"{m} {a:.2f} -> {b:.2f}" for m, (a, b) in nfm.items()) + ".",
        "Rows below 0.97: "
        + (
            ", ".join(
                f"{r['prompt']}/{r['n']}/{m} {r[m]['ratio']:.3f}" for r in rows for m in MODES if r[m]["ratio"] < 0.97
            )
            or "none"
        )
        + ".",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all_equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
