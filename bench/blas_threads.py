"""OpenBLAS threads on Linux: decoding and prefill with one thread per core
against one core left to the Python thread (what the command line sets).

    python bench/blas_threads.py [--repeats 8] [--tokens 200]

On the embedded pair, for two prompts (a shipped code prompt, and 3072
tokens of argparse.py): mlx-lm, this engine's plain decoding
and DFlash (adaptive), decode ms per token; and a 3072-token prefill. The
thread counts take turns within each repeat in one process (set through
OpenBLAS's own openblas_set_num_threads), so both see the same machine;
medians after one warm-up. Needs OpenBLAS (re-executes under it).
Writes bench/results/blas-threads.md.
"""

import argparse
import platform
import statistics
import time
from pathlib import Path

from mlx_dflash import blas

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8, help="timed repeats per configuration (median)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens decoded per run")
    args = ap.parse_args()
    blas.ensure_openblas("openblas")
    import mlx.core as mx

    import mlx_dflash
    from mlx_dflash.benchmark import _run_engine, _run_mlx_lm, context_prompt, read_prompts

    e = mlx_dflash.load()
    prompts = {
        "code_class": e.encode(read_prompts()["code_class"], chat_template=True),
        "context_3072": context_prompt(e, 3072),
    }
    all_cores = blas.cores()
    counts = sorted({blas.decode_threads(), all_cores})

    def mlx_lm(ids):
        return 1e3 / _run_mlx_lm(e, ids, args.tokens)[1]["decode_tps"]

    def ours(ids, draft=None):
        return 1e3 / _run_engine(e, ids, args.tokens, draft, None)[1]["decode_tps"]

    def prefill(ids):
        cache = e.target.make_cache()
        t = time.perf_counter()
        logits, _ = e.target.prefill(ids, cache)
        mx.eval(logits)
        return (time.perf_counter() - t) * 1e3

    runs = {}
    for rep in range(args.repeats + 1):
        for n in counts:
            blas.set_threads(n)
            for name, ids in prompts.items():
                for mode, fn in (("mlx-lm", mlx_lm), ("plain", ours), ("dflash", lambda i: ours(i, e.draft))):
                    runs.setdefault((name, mode, n), []).append(fn(ids))
            runs.setdefault(("context_3072", "prefill", n), []).append(prefill(prompts["context_3072"]))
        print(f"repeat {rep} done", flush=True)
    blas.set_threads()
    med = {k: statistics.median(v[1:]) for k, v in runs.items()}
    lo, hi = counts[0], counts[-1]
    lines = [
        "# OpenBLAS threads",
        "",
        f"- machine: {platform.platform()} ({platform.machine()}), {all_cores} cores for this process; "
        f"OpenBLAS {blas.openblas_path()}",
        f"- embedded pair; {args.tokens} tokens decoded greedily; median of {args.repeats} runs after a warm-up, "
        "the thread counts and modes taking turns within each repeat",
        "",
        f"| prompt | mode | ms per token, {hi} threads | ms per token, {lo} thread(s) | {lo} vs {hi}: speed ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for name in prompts:
        for mode in ("mlx-lm", "plain", "dflash", "prefill"):
            if (name, mode, lo) not in med:
                continue
            a, b = med[(name, mode, hi)], med[(name, mode, lo)]
            unit = " (ms, whole prompt)" if mode == "prefill" else ""
            lines.append(f"| {name} | {mode}{unit} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    lines += [
        "",
        "A ratio above 1: fewer threads ran faster. The command line sets "
        f"{blas.decode_threads()} thread(s) here (blas.decode_threads: the cores less one).",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "blas-threads.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
