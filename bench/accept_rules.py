"""Acceptance at temperature > 0: the equality rule vs the speculative-sampling rule.

    python bench/accept_rules.py --draft2 DIR [--out bench/results/accept-rules.md]

For the embedded pair's v1 draft and a second draft (a DFlash 2 head), on every
prompt in bench/prompts, at each temperature and seed: tau (committed tokens
per cycle) and decode tok/s of a chain with each rule. The two rules take
turns within each (prompt, temperature, seed), so drift in the machine's
speed hits both alike.
"""

import argparse
import statistics
import sys
from pathlib import Path

from mlx_dflash import blas

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--draft2",
        type=Path,
        default=ROOT / "bench" / "drafts" / "dflash2",
        help="a second draft folder for the embedded target",
    )
    ap.add_argument(
        "--temps", type=float, nargs="+", default=[0.7, 1.0], help="sampling temperatures to compare the two rules at"
    )
    ap.add_argument("--seeds", type=int, default=2, help="sampling seeds (0 to N-1) per prompt and temperature")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "accept-rules.md", help="the markdown result file"
    )
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)

    import mlx.core as mx

    import mlx_dflash
    from mlx_dflash.benchmark import read_prompts
    from mlx_dflash.loading import load_draft

    eng = mlx_dflash.load()
    drafts = {"v1 (embedded)": eng.draft, "second": load_draft(args.draft2, eng.target, dtype=mx.float32)}
    prompts = read_prompts(ROOT / "bench" / "prompts")
    rules = ("equality", "speculative")
    rows = {}
    for name, text in prompts.items():
        for T in args.temps:
            for seed in range(args.seeds):
                for dname, d in drafts.items():
                    eng.draft = d
                    for rule in rules:
                        r = mlx_dflash.generate(
                            eng, text, max_tokens=args.max_tokens, temperature=T, seed=seed, accept_rule=rule
                        )
                        rows.setdefault((dname, T, rule), []).append((r.stats.tau, r.stats.decode_tps))
                print(
                    f"{name} T={T} seed={seed}: "
                    + ", ".join(f"{k[0]}/{k[2]} tau {v[-1][0]:.2f}" for k, v in rows.items() if k[1] == T),
                    flush=True,
                )
    lines = [
        "# Acceptance at temperature > 0: equality vs speculative-sampling rule",
        "",
        f"- BLAS: {blas.describe()}; embedded target; drafts: the embedded v1 draft and `{args.draft2}` "
        f"({drafts['second'].config.kind}); {len(prompts)} prompts from bench/prompts x {args.seeds} seeds, "
        f"{args.max_tokens} tokens each, chain with the draft's block size; mean over runs",
        "",
        "| draft | temperature | rule | tau | decode tok/s |",
        "|---|---:|---|---:|---:|",
    ]
    for (dname, T, rule), v in sorted(rows.items()):
        lines.append(
            f"| {dname} | {T} | {rule} | {statistics.mean(t for t, _ in v):.2f} | "
            f"{statistics.mean(s for _, s in v):.1f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
