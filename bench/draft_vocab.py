"""What a restricted draft vocabulary (``--draft-vocab``) saves at a published Qwen3.5 shape.

    python bench/draft_vocab.py [--size 0.8b] [--precisions fp32,4bit] [--vocab 65536,32768,16384]

The draft borrows the target's head, and at Qwen3.5's 248320-token vocabulary
that head is most of a draft forward: a block computes it for every slot.
A draft restricted to N token ids reads a copy of those rows alone. Random-
weight target and draft of the published shapes (tools/shapes.py, as
bench/real_shapes.py builds them), loaded through mlx-dflash's loaders, one
draft per vocabulary (the whole one first); measured side by side in this
one run, the modes taking turns:

- the terms: the engine's plain step and each draft's block proposal
  (T_draft(B) at the oracle's width, after 4 new context rows);
- end to end: mlx-lm's plain decoding, and the oracle draft
  (tools/shapes.OracleDraft: the target's greedy continuation, paying each
  draft's forward every cycle) pinned at --width with each draft, tokens
  checked against the engine's plain decoding: ms per cycle.

A cycle costs less; whether a generation gains depends on how many of the
tokens the target writes fall outside the kept ids (each ends an accepted
run where it falls). The report gives the cycle's saving, the tau loss that
would cancel it, and the speedup at the published tau of bench/real_shapes.py
if a share u of the written tokens fell outside (independently of each other:
acceptance per depth alpha becomes alpha * (1 - u)). Writes
bench/results/draft-vocab.md (``--out``).
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/, bench/

import mlx.core as mx  # noqa: E402

from mlx_dflash import blas  # noqa: E402
from mlx_dflash.loading import draft_vocab_ids, load_draft  # noqa: E402
from tools import shapes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUTSIDE = (0.01, 0.02, 0.05)  # shares of written tokens outside the kept ids, for the projection


def tau_with_outside(tau: float, B: int, u: float) -> float:
    """A block-B chain's committed tokens per cycle when each drafted depth's
    acceptance alpha (solved from ``tau`` = (1 - alpha^B) / (1 - alpha)) is
    cut to alpha * (1 - u)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**k for k in range(B)) < tau else (lo, a)
    a = lo * (1 - u)
    return sum(a**k for k in range(B))


def measure(name, folder, draft_folder, args):
    from mlx_lm.utils import get_total_parameters
    from real_shapes import engine_run

    target, _ = shapes.load(folder)
    V = target.vocab_size
    sizes = [0] + [int(x) for x in args.vocab.split(",") if x]
    drafts = {}
    for n in sizes:  # 0: the whole vocabulary
        d = load_draft(draft_folder, target)
        drafts[n] = d.restrict_vocab(draft_vocab_ids(n, V)) if n else d
    model = target.model
    res = {"name": name, "params": get_total_parameters(model) / 1e9, "same": True, "mlx_agree": args.tokens, "V": V}
    prompt = shapes.prompt_ids(args.prompt, V)
    B, n = args.width, args.tokens

    # Warm-up (compiles, first touch of the weights), then the plain run every oracle must equal.
    short, _ = engine_run(target, prompt[:32], B + 1)
    for d in drafts.values():
        engine_run(target, prompt[:32], B + 1, shapes.OracleDraft(prompt[:32] + short, d, strict=False), B)
    shapes.mlx_lm_generate(model, prompt[:32], 4)
    ref, _ = engine_run(target, prompt, n)

    cycles = {k: [] for k in sizes}
    mlx_tps = []
    for _ in range(args.rounds):
        toks, _, td = shapes.mlx_lm_generate(model, prompt, n)
        mlx_tps.append((n - 1) / td)
        res["mlx_agree"] = min(res["mlx_agree"], shapes.matching_prefix(toks, ref))
        for k, d in drafts.items():
            toks, st = engine_run(target, prompt, n, shapes.OracleDraft(prompt + ref, d, strict=False), B)
            res["same"] &= toks == ref
            cycles[k].append(st.decode_time / st.cycles)
        print(name, "ms/cycle", {k: round(v[-1] * 1e3, 1) for k, v in cycles.items()}, flush=True)
    res["mlx_tps"] = statistics.median(mlx_tps)
    res["cycle"] = {k: statistics.median(v) for k, v in cycles.items()}

    # The terms, taking turns in each repeat after a warm-up round.
    cache = target.make_cache()
    capture = drafts[0].target_layer_ids
    _, feats = target.prefill(prompt, cache, capture=capture)
    dcaches = {}
    for k, d in drafts.items():
        dcaches[k] = d.make_cache()
        mx.eval(d.propose(feats, ref[0], len(prompt), B, dcaches[k])[0])
    newf = mx.zeros((4, feats.shape[-1]), dtype=feats.dtype)

    def plain():
        lg, _ = target.forward([5], cache)
        mx.eval(mx.argmax(lg, -1), cache.state())

    def drafting(k):
        def run():
            dc = dcaches[k]
            toks, _ = drafts[k].propose(newf, 9, dc.length + 4, B, dc)
            mx.eval(toks, dc.state())

        return run

    fns = [("T_plain", plain)] + [(k, drafting(k)) for k in sizes]
    times = {name: [] for name, _ in fns}
    for r in range(args.reps + 1):
        for key, fn in fns:
            t = time.perf_counter()
            fn()
            if r:
                times[key].append(time.perf_counter() - t)
    res["terms"] = {k: statistics.median(v) for k, v in times.items()}
    print(name, "terms ms", {k: round(v * 1e3, 1) for k, v in res["terms"].items()}, flush=True)
    return res


def report(results, args) -> str:
    from real_shapes import PUBLISHED_TAU

    lines = [
        f"# Draft vocabulary at the Qwen3.5-{args.size.upper()} shape",
        "",
        f"`python bench/draft_vocab.py --size {args.size} --precisions {args.precisions} --vocab {args.vocab} "
        f"--width {args.width} --tokens {args.tokens} --rounds {args.rounds} --reps {args.reps}`",
        "",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"MLX device {mx.default_device()}; BLAS: {blas.describe()}; every ratio is within this one process, "
        "the modes taking turns",
        "- target and draft: random weights, the published shapes (tools/shapes.py); each draft restricted to "
        "the N lowest token ids (`draft_vocab_ids(N)`), the whole vocabulary first",
        f"- oracle at block {args.width} (tau = {args.width}), prompt {args.prompt} tokens, {args.tokens} generated, "
        f"median of {args.rounds} rounds; terms: median of {args.reps} repeats",
        "",
        "## Cost",
        "",
        "| model | draft vocabulary | T_draft ms | T_draft / T_plain | ms per cycle | cycle vs whole vocabulary "
        "| tau loss that cancels it | oracle speedup vs mlx-lm | speculative = plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        T, cyc, whole = r["terms"], r["cycle"], r["cycle"][0]
        for k, c in cyc.items():
            lines.append(
                f"| {r['name']} | {k or r['V']} | {T[k] * 1e3:.1f} | {T[k] / T['T_plain']:.2f} | {c * 1e3:.1f} | "
                f"{c / whole:.2f} | {1 - c / whole:.0%} | {args.width / c / r['mlx_tps']:.2f}x | {r['same']} |"
            )
    lines += [
        "",
        f"## Speedup over mlx-lm at published tau (block {args.width})",
        "",
        "speedup = tau x T_token(mlx-lm) / T_cycle, T_cycle the oracle's ms per cycle above; with a restricted "
        "vocabulary, tau as it would fall if a share u of the written tokens were outside the kept ids.",
        "",
        "| model | tau source | tau | whole vocabulary | "
        + " | ".join(f"{k}: u = {u:.0%}" for k in [int(x) for x in args.vocab.split(",") if x] for u in OUTSIDE)
        + " |",
        "|---|---|---:|---:|" + "---:|" * (len(OUTSIDE) * len(args.vocab.split(","))),
    ]
    for r in results:
        for src, B, tau in PUBLISHED_TAU:
            if B != args.width:
                continue
            row = f"| {r['name']} | {src} | {tau:.2f} | {tau / r['cycle'][0] / r['mlx_tps']:.2f}x |"
            for k in [int(x) for x in args.vocab.split(",") if x]:
                for u in OUTSIDE:
                    row += f" {tau_with_outside(tau, B, u) / r['cycle'][k] / r['mlx_tps']:.2f}x |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes.shape_arguments(ap, tokens=48, reps=5, out=RESULTS / "draft-vocab.md")
    ap.add_argument("--vocab", default="65536,32768,16384", help="kept token counts compared with the whole")
    ap.add_argument("--width", type=int, default=16, help="the oracle's block (the published draft's is 16)")
    shapes.run_precisions(ap.parse_args(), measure, report)


if __name__ == "__main__":
    main()
