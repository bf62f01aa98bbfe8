"""Chain vs DDTree on the embedded pair: tau and decode tok/s per (budget, top-k).

    python bench/tree_sweep.py [--max-tokens 128] [--repeats 2]

Used to pick the default ``--tree-budget`` / ``--tree-topk``. Every run's
tokens are checked against plain greedy decoding. Writes
bench/results/tree-sweep.md.
"""

import argparse
import statistics
from pathlib import Path

from mlx_dflash import blas

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per prompt and configuration after one warm-up; tok/s and tau are medians",
    )
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    import mlx_dflash
    from mlx_dflash.benchmark import read_prompts
    from mlx_dflash.decode import GenerationStats, generate_tokens

    eng = mlx_dflash.load()
    prompts = read_prompts()
    ids = {k: eng.encode(v, chat_template=True) for k, v in prompts.items()}
    configs = [(0, 1)] + [(b, k) for b in (8, 12, 22) for k in (2, 4)]

    def run(prompt, budget, topk, draft):
        st = GenerationStats()
        out = []
        for t in generate_tokens(
            eng.target,
            prompt,
            draft=draft,
            max_tokens=args.max_tokens,
            tree_budget=budget,
            tree_topk=topk,
            stats=st,
            eos_token_ids=eng.tokenizer.eos_token_ids,
        ):
            out.extend(t)
        return out, st

    ref = {k: run(p, 0, 1, None) for k, p in ids.items()}
    rows = [("plain", statistics.median(ref[k][1].decode_tps for k in ids), 1.0, 1.0)]
    for budget, topk in configs:
        tps, taus, sizes = [], [], []
        for k, p in ids.items():
            run(p, budget, topk, eng.draft)  # warm-up
            for _ in range(args.repeats):
                out, st = run(p, budget, topk, eng.draft)
                assert out == ref[k][0], f"mismatch on {k} (budget {budget}, topk {topk})"
                tps.append(st.decode_tps)
                taus.append(st.tau)
                sizes.append(st.mean_tree_size)
        name = "chain (B=16)" if budget == 0 else f"tree budget {budget}, top-{topk}"
        rows.append((name, statistics.median(tps), statistics.median(taus), statistics.median(sizes)))
        print(rows[-1], flush=True)
    lines = [
        "# Chain vs tree on the embedded pair",
        "",
        f"- BLAS: {blas.describe()}; {len(ids)} prompts from mlx_dflash/bench_prompts, {args.max_tokens} tokens, "
        f"median of {args.repeats} runs per prompt; tokens identical to plain decoding in every run",
        "",
        "| mode | decode tok/s | tau | tokens verified per cycle |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {n} | {t:.1f} | {a:.2f} | {s:.1f} |" for n, t, a, s in rows]
    out = ROOT / "bench" / "results" / "tree-sweep.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
