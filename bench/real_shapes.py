"""The engine at the published Qwen3.5 shapes, against mlx-lm in the same process.

    python bench/real_shapes.py [--size 0.8b] [--precisions fp32,4bit] [--scale 1]

Random-weight targets with Qwen/Qwen3.5-0.8B's (or 2B's) published config.json,
written as mlx-lm folders (float32, and 4-bit the way mlx_lm.convert
quantizes), loaded through mlx-dflash's loaders, with a random draft of the
published 0.8B DFlash draft's shape (tools/shapes.py). Measured side by side
in this one run, the modes taking turns:

- plain decoding: the engine without a draft vs mlx-lm's generate_step;
- prefill at each --prefill length: the engine (with the draft's capture,
  as users run it) vs mlx-lm, time to the first token;
- the cost terms (tools/shapes.cycle_terms): T_verify(B)/T_plain for
  B = 2..16, T_draft(B)/T_plain, T_rollback(B);
- the oracle draft (tools/shapes.OracleDraft: the target's own greedy
  continuation, running the published-shape draft's forward each cycle so
  its cost is paid) pinned at each --widths B: tau = B, the ceiling; the
  cycle's time beyond its isolated forwards (draft + verify + rollback).

Random weights make greedy output degenerate (repetition), which changes
nothing here: every cost is per token, and the oracle accepts whatever the
target picks. Writes bench/results/real-shapes.md (``--out``).
"""

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

import mlx.core as mx  # noqa: E402

from mlx_dflash import blas  # noqa: E402
from mlx_dflash.decode import GenerationStats, generate_tokens  # noqa: E402
from tools import shapes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VERIFY_WIDTHS = tuple(range(2, 17))
# Published tau (committed tokens per cycle) for Qwen3.5 drafts, docs/performance.md says where from.
PUBLISHED_TAU = (
    ("Qwen3.5-0.8B DFlash b16 (Moonlight556 card), Math500 offline", 16, 5.71),
    ("Qwen3.5-0.8B DFlash b16 (Moonlight556 card), SGLang serving", 16, 5.34),
    ("Qwen3.5-4B + z-lab draft b16, MLX (dflash-mlx issue 2)", 16, 5.97),
    ("Qwen3.5-2B DFlash2 b8 (rasyosef card), mean of 9 sets", 8, 2.47),
    ("Qwen3.5-2B DFlash2 b8 (rasyosef card), math_reasoning", 8, 3.64),
)


def engine_run(target, prompt, n, draft=None, block=None, cache=None, profile=False):
    st = GenerationStats()
    out = []
    gen = generate_tokens(
        target, prompt, draft=draft, max_tokens=n, stats=st, block_size=block, cache=cache, profile=profile
    )
    for toks in gen:
        out.extend(toks)
    return out, st


def measure(name, folder, draft_folder, args):
    target, draft = shapes.load(folder, draft_folder)
    model = target.model
    from mlx_lm.utils import get_total_parameters

    params = get_total_parameters(model) / 1e9
    V = target.vocab_size
    prompt = shapes.prompt_ids(args.prompt, V)
    n = args.tokens
    res = {"name": name, "params": params, "same": True, "parted": [], "mlx_agree": n}

    # Warm-up (compiles, first-touch of the weights). The oracle follows the
    # engine's own plain decoding, what speculative output must equal; mlx-lm's
    # agreement with it is counted apart (on a GPU their numerics may part).
    widths = [int(w) for w in args.widths.split(",")]
    short, _ = engine_run(target, prompt[:32], max(widths) + 1)
    shapes.mlx_lm_generate(model, prompt[:32], 4)
    for B in widths:
        engine_run(target, prompt[:32], B + 1, shapes.OracleDraft(prompt[:32] + short, draft, strict=False), B)
    ref, _ = engine_run(target, prompt, n)
    seq = prompt + ref

    def oracle_run(B, profile=False, target=target, draft=draft):
        oracle = shapes.OracleDraft(seq, draft, strict=False)
        toks, st = engine_run(target, prompt, n, oracle, B, profile=profile)
        res["same"] &= toks == ref
        if oracle.parted_at is not None:
            res["parted"].append((B, oracle.parted_at - len(prompt)))
        return st

    # End-to-end: mlx-lm, the engine plain, the oracle at each width, taking turns.
    runs = {}
    for _ in range(args.rounds):
        toks, _, td = shapes.mlx_lm_generate(model, prompt, n)
        res["mlx_agree"] = min(res["mlx_agree"], shapes.matching_prefix(toks, ref))
        runs.setdefault("mlx-lm", []).append((n - 1) / td)
        toks, st = engine_run(target, prompt, n)
        res["same"] &= toks == ref
        runs.setdefault("plain", []).append(st.decode_tps)
        for B in widths:
            st = oracle_run(B)
            runs.setdefault(B, []).append(st.decode_tps)
            res.setdefault("oracle", {})[B] = st
        print(name, {k: [round(x, 2) for x in v] for k, v in runs.items()}, flush=True)
    res["tps"] = {k: statistics.median(v) for k, v in runs.items()}
    # The same cycles synchronised after each phase (draft, verify, rollback):
    # what is left of a cycle is the host's own work, measured in those cycles.
    for B in widths:
        res.setdefault("synced", {})[B] = oracle_run(B, profile=True)

    # Cost terms at the prompt's context.
    cache = target.make_cache()
    _, feats = target.prefill(prompt, cache, capture=draft.target_layer_ids)
    dcache = draft.make_cache()
    mx.eval(draft.propose(feats, ref[0], len(prompt), 16, dcache)[0])
    from mlx_lm.models.cache import make_prompt_cache

    mcache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=mcache))
    res["terms"] = shapes.cycle_terms(
        target,
        draft,
        cache,
        dcache,
        verify_widths=VERIFY_WIDTHS,
        draft_widths=widths,
        reps=args.reps,
        model=model,
        mlx_cache=mcache,
    )
    del cache, dcache, mcache, feats
    print(name, {k: round(v * 1e3, 2) for k, v in res["terms"].items()}, flush=True)

    # Prefill: time to the first token, mlx-lm vs the engine with the draft's capture.
    res["prefill"] = {}
    for L in [int(x) for x in args.prefill.split(",") if x]:
        p = shapes.prompt_ids(L, V, seed=L)
        m, e = [], []
        for _ in range(args.prefill_rounds):
            _, tp, _ = shapes.mlx_lm_generate(model, p, 1)
            m.append(L / tp)
            gc.collect()
            _, st = engine_run(target, p, 1, draft, 16)
            e.append(st.prefill_tps)
            gc.collect()
            mx.clear_cache()
        res["prefill"][L] = (statistics.median(m), statistics.median(e))
        print(name, "prefill", L, res["prefill"][L], flush=True)
    del target, draft, model, oracle_run
    gc.collect()
    mx.clear_cache()
    return res


def report(results, args) -> str:
    lines = [
        f"# Real shapes: Qwen3.5-{args.size.upper()}" + (f" scaled down {args.scale}x" if args.scale > 1 else ""),
        "",
        f"`python bench/real_shapes.py --size {args.size} --precisions {args.precisions}"
        f" --tokens {args.tokens} --rounds {args.rounds} --reps {args.reps} --widths {args.widths}"
        f" --prefill {shlex.quote(args.prefill)}`",
        "",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other jobs where it is the 2-core Linux machine: load varies), "
        f"MLX device {mx.default_device()}; every ratio is within this one process, the modes taking turns",
        f"- BLAS: {blas.describe()}",
        "- target: random weights, the published config.json (tools/shapes.py); draft: random weights, "
        "the published Qwen3.5-0.8B DFlash draft's shape (5 layers, taps [3, 7, 11, 15, 19], block 16)",
        f"- prompt {args.prompt} tokens, {args.tokens} generated, greedy; median of {args.rounds} rounds "
        f"(tok/s) and of {args.reps} repeats (terms)",
        "- random weights give degenerate greedy text (repetition); costs do not depend on it",
        "- speculative = plain: every oracle run gave the tokens of the engine's own plain decoding (the "
        "oracle proposes them; a parting is named with its width and token); plain = mlx-lm: how many of "
        "those tokens mlx-lm's greedy decoding gives from the start (the fewest over the rounds)",
        "",
        "## Plain decoding and prefill (engine / mlx-lm)",
        "",
        "| model | params | mlx-lm tok/s | engine plain tok/s | plain ratio | "
        + "".join(f"prefill {L} mlx-lm / engine tok/s | ratio | " for L in results[0]["prefill"])
        + "speculative = plain | plain = mlx-lm (tokens) |",
        "|---|---:|---:|---:|---:|" + "---:|---:|" * len(results[0]["prefill"]) + "---|---:|",
    ]
    for r in results:
        t = r["tps"]
        row = f"| {r['name']} | {r['params']:.3f} B | {t['mlx-lm']:.2f} | {t['plain']:.2f} | {t['plain'] / t['mlx-lm']:.2f}x |"
        for m, e in r["prefill"].values():
            row += f" {m:.0f} / {e:.0f} | {e / m:.2f}x |"
        parted = "".join(f"; B={B} parted at token {t}" for B, t in sorted(set(r["parted"])))
        lines.append(row + f" {r['same']}{parted} | {r['mlx_agree']}/{args.tokens} |")
    lines += [
        "",
        "## Cost terms (ms; ratios to the engine's plain step)",
        "",
        "| term | " + " | ".join(f"{r['name']} ms | / T_plain" for r in results) + " |",
        "|---|" + "---:|---:|" * len(results),
    ]
    for k in results[0]["terms"]:
        row = f"| {k} |"
        for r in results:
            v, tp = r["terms"][k], r["terms"]["T_plain"]
            row += f" {v * 1e3:.1f} | {v / tp:.2f} |"
        lines.append(row)
    lines += [
        "",
        "## Oracle draft (tau = B): speedup over mlx-lm and where a cycle's time goes",
        "",
        "Forwards = isolated T_draft(B) + T_verify(B) + T_rollback(B) from the table above; non-forward = "
        "measured ms per cycle minus that (host work, the draft's proposal handed to verify, "
        "acceptance, bookkeeping; negative: the loop overlaps the next draft with the host's work).",
        "",
        "Synchronised: one more oracle run per width with a host sync after each phase (``profile``); "
        "host = the cycle's time after its draft and verify phases (each ends in a host sync: the forwards "
        "and their sampling): accept, commit, the cache rollback and the loop's bookkeeping "
        "(GenerationStats' rollback_time + other_time, as bench/compare_revisions.py counts it), in the same "
        "cycles, so no term is minutes apart from the cycle it is subtracted from. An upper bound: "
        "unsynchronised, the loop overlaps the next draft with the host's work.",
        "",
        "| model | B | tau | tok/s | speedup vs mlx-lm | ms/cycle | forwards ms | non-forward ms | non-forward % "
        "| synchronised ms/cycle | host ms | host % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        T = r["terms"]
        for B, st in r["oracle"].items():
            cyc = st.decode_time / st.cycles
            fwd = T[f"T_draft({B})"] + T[f"T_verify({B})"] + T[f"T_rollback({B})"]
            sy = r["synced"][B]
            scyc, host = sy.decode_time / sy.cycles, (sy.rollback_time + sy.other_time) / sy.cycles
            lines.append(
                f"| {r['name']} | {B} | {st.tau:.2f} | {r['tps'][B]:.2f} | {r['tps'][B] / r['tps']['mlx-lm']:.2f}x | "
                f"{cyc * 1e3:.1f} | {fwd * 1e3:.1f} | {(cyc - fwd) * 1e3:.1f} | {(cyc - fwd) / cyc * 100:.1f}% | "
                f"{scyc * 1e3:.1f} | {host * 1e3:.1f} | {host / scyc * 100:.1f}% |"
            )
    lines += [
        "",
        "## Speedup at published tau",
        "",
        "speedup = tau x T_token(mlx-lm) / T_cycle(B), T_cycle(B) the oracle's measured ms per cycle at the "
        "draft's block B (its draft, verify, rollback and host work at that width; the cycle's cost does not "
        "depend on how many drafts are accepted, only the rollback slightly). T_token(mlx-lm) = 1 / mlx-lm tok/s.",
        "",
        "| tau source | B | tau | " + " | ".join(r["name"] for r in results) + " |",
        "|---|---:|---:|" + "---:|" * len(results),
    ]
    for src, B, tau in PUBLISHED_TAU:
        row = f"| {src} | {B} | {tau:.2f} |"
        for r in results:
            st = r["oracle"].get(B)
            if st is None:
                row += " - |"
                continue
            cyc = st.decode_time / st.cycles
            row += f" {tau / cyc / r['tps']['mlx-lm']:.2f}x |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes.shape_arguments(ap, tokens=64, reps=5, out=RESULTS / "real-shapes.md")
    ap.add_argument("--widths", default="2,4,8,16", help="oracle widths B")
    ap.add_argument("--prefill", default="1024,8192", help="prefill lengths (comma list; empty: none)")
    ap.add_argument("--prefill-rounds", type=int, default=1, help="prefill runs per length and mode")
    shapes.run_precisions(ap.parse_args(), measure, report)


if __name__ == "__main__":
    main()
