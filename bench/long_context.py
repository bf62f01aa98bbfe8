"""Oracle-draft speedup over mlx-lm at long contexts, and what grows with context.

    python bench/long_context.py [--contexts 1024,8192,16384,32768] [--precision fp32]

The published Qwen3.5-0.8B shape (random weights, tools/shapes.py) with the
oracle draft (the target's own greedy continuation; it runs the
published-shape DFlash draft's forward every cycle, so the cycle pays the
real draft's cost) pinned at block 16. Per context L, ascending:

1. the engine prefills the prompt once (timed) and the draft reads its
   features once (timed: the draft's own prefill, paid once per prompt);
2. the decoders start from that same state: mlx-lm's generate_step from a
   mlx-lm cache holding the engine's K/V and DeltaNet states (the same
   arrays), the engine's plain decode loop and the oracle from its restored
   cache (the oracle with a fork of the draft's context); they take turns
   for --rounds, each producing --tokens tokens. The oracle must give the
   engine's plain tokens; mlx-lm's agreement with them is counted;
3. the cycle's terms at L (tools/shapes.cycle_terms): mlx-lm's and the
   engine's plain step, T_verify(16) (with capture), T_rollback(16),
   T_draft(16) (its attention over the L context rows);
4. with ``--kv-bits 8`` (or 4), steps 2-3 again from the same prefill with
   the attention rows quantized: mlx-lm with its quantized cache, the
   engine's plain decoding and the oracle with the engine's.

The result file is rewritten after each context, so a run cut short keeps
what it measured. Writes bench/results/long-context.md (``--out``).
"""

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

import mlx.core as mx  # noqa: E402

from mlx_dflash import blas  # noqa: E402
from mlx_dflash.cache import KV_GROUP_SIZE, DeltaNetState, TargetCache  # noqa: E402
from mlx_dflash.config import GenerationConfig  # noqa: E402
from mlx_dflash.decode import Hooks, decode_loop, open_decoder  # noqa: E402
from mlx_dflash.policy import Policy  # noqa: E402
from tools import shapes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


def mlx_cache_from(model, cache, bits=None):
    """A mlx-lm prompt cache holding the full-precision engine cache's state
    (the same arrays), its attention rows quantized to ``bits`` the way
    mlx-lm's QuantizedKVCache stores them when ``bits`` is given."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    mc = make_prompt_cache(model)
    for i, (m, c) in enumerate(zip(mc, cache.layers)):
        if isinstance(c, DeltaNetState):
            m[0], m[1] = c.conv, c.ssm
            continue
        k, v = c.buf.held(c.offset)
        if bits:
            m = mc[i] = QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits)
            k = tuple(mx.quantize(k, group_size=KV_GROUP_SIZE, bits=bits))
            v = tuple(mx.quantize(v, group_size=KV_GROUP_SIZE, bits=bits))
        m.keys, m.values = k, v
        m.offset = c.offset
    return mc


def quantized_cache(cache, bits):
    """The full-precision engine cache's state with its attention rows
    quantized in the engine's format (rotated keys; cache.QuantizedKVBuffer)."""
    q = TargetCache(cache.is_linear, kv_bits=bits)
    for qc, c in zip(q.layers, cache.layers):
        if isinstance(c, DeltaNetState):
            qc.restore_state([c.snapshot_state()])
        else:
            qc.append(*c.buf.held(c.offset))
    q.restored(cache.offset)
    mx.eval(q.state())
    return q


def engine_decode(target, prompt, cache, dcache, draft, anchor: int, n: int):
    """The engine's decode loop from a prefilled ``cache`` (prompt held,
    ``anchor`` its first token) and a draft context ``dcache`` (plain
    decoding when ``draft`` is None): the ``n`` tokens after the anchor, the
    seconds they took, and the stats."""
    c = GenerationConfig.build(None, max_tokens=n + 1, block_size=BLOCK if draft else None)
    d = open_decoder(target, prompt, c, Hooks(), c.sampler(), draft=draft, cache=cache)
    d.dcache = dcache
    d.anchor, d.pos = anchor, len(prompt)
    d.emit([anchor])
    out = []
    d.tic = t0 = time.perf_counter()
    for toks in decode_loop(d, Policy(BLOCK, None, fixed=BLOCK) if draft else Policy(1), False):
        out.extend(toks)
    return out, time.perf_counter() - t0, d.stats


def measure_context(L, target, draft, model, args):
    """Per mode (full-precision KV, then each of ``--kv-bits``), from one
    prefill: the decoders' tok/s, the oracle's tau and the cycle's terms."""
    V = target.vocab_size
    prompt = shapes.prompt_ids(L, V, seed=L)
    cache = target.make_cache()
    t = time.perf_counter()
    logits, feats = target.prefill(prompt, cache, capture=draft.target_layer_ids)
    anchor = int(mx.argmax(logits[-1]).item())
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    dbase = draft.make_cache()
    draft.add_context(feats, dbase)
    mx.eval(dbase.state())
    draft_ctx_s = time.perf_counter() - t
    del feats, logits
    print(f"L={L}: prefill {prefill_s:.1f} s, draft context {draft_ctx_s:.1f} s", flush=True)
    rows = {}
    for bits in [None] + args.kv_bits:
        c = quantized_cache(cache, bits) if bits else cache
        row = rows[bits] = {"L": L, "prefill_s": prefill_s, "draft_ctx_s": draft_ctx_s}
        measure_mode(row, prompt, anchor, c, cache, dbase, bits, target, draft, model, args)
        del c
        gc.collect()
    del cache, dbase
    gc.collect()
    mx.clear_cache()
    return rows


def measure_mode(row, prompt, anchor, cache, fp, dbase, bits, target, draft, model, args):
    """mlx-lm against the oracle from the same ``cache`` state. With quantized
    KV the oracle follows the engine's own plain decoding of that cache (the
    reference it must equal); mlx-lm's cache holds the same rows quantized
    its way (keys not rotated, from the full-precision cache ``fp``), so its
    tokens may differ and are counted."""
    n, tag = args.tokens, f"L={row['L']} kv{bits or '-fp'}"
    snap = cache.snapshot()

    fp_snap = fp.snapshot()

    def mlx_cache():
        fp.restore(fp_snap)
        return mlx_cache_from(model, fp, bits)

    def mlx_run(k):
        return shapes.mlx_lm_generate(model, [anchor], k, prompt_cache=mlx_cache())

    def engine_run(k, ref=None):
        cache.restore(snap)
        oracle = shapes.OracleDraft(prompt + [anchor] + ref, draft, strict=False) if ref else None
        out = engine_decode(target, prompt, cache, dbase.fork() if ref else None, oracle, anchor, k)
        if oracle is not None and oracle.parted_at is not None:
            row.setdefault("parted", oracle.parted_at - len(prompt))
        return out

    m_tps, e_tps, p_tps, same, agree = [], [], [], True, []
    mlx_run(3)  # warm-up at this context's shapes, untimed
    engine_run(3)  # the engine's plain steps likewise
    ref = None
    for _ in range(args.rounds):
        toks, tp, td = mlx_run(n)
        m_tps.append(n / (tp + td))
        gc.collect()
        plain, secs, _ = engine_run(n)
        p_tps.append(len(plain) / secs)
        agree.append(shapes.matching_prefix(plain, toks) / n)
        ref = ref or plain
        same &= plain == ref
        if len(e_tps) == 0:
            engine_run(BLOCK + 1, ref)  # warm-up: one cycle
        toks, secs, st = engine_run(n, ref)
        e_tps.append(len(toks) / secs)
        same &= toks == ref
        row["tau"], row["cycles"] = st.tau, st.cycles
        row["ms_cycle"] = secs / st.cycles * 1e3
        gc.collect()
        print(f"{tag}: mlx-lm {m_tps[-1]:.2f} tok/s, oracle {e_tps[-1]:.2f} tok/s, tau {st.tau:.2f}", flush=True)
    row["mlx_tps"], row["oracle_tps"], row["same"] = statistics.median(m_tps), statistics.median(e_tps), same
    row["plain_tps"], row["agree"] = statistics.median(p_tps), min(agree)

    cache.restore(snap)
    row["terms"] = shapes.cycle_terms(
        target,
        draft,
        cache,
        dbase.fork(),
        verify_widths=(BLOCK,),
        draft_widths=(BLOCK,),
        reps=args.reps,
        model=model,
        mlx_cache=mlx_cache(),
    )
    cache.restore(snap)
    print(f"{tag}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row["terms"].items()), flush=True)


def _same(r) -> str:
    return f"{r['same']}" + (f" (parted at token {r['parted']})" if "parted" in r else "")


def terms_table(rows) -> list:
    keys = list(rows[0]["terms"])
    lines = [
        "| term | "
        + " | ".join(f"{r['L']}" for r in rows)
        + " | "
        + " | ".join(f"+ at {r['L']}" for r in rows[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(rows) - 1),
    ]
    for k in keys:
        base = rows[0]["terms"][k]
        lines.append(
            f"| {k} | "
            + " | ".join(f"{r['terms'][k] * 1e3:.1f}" for r in rows)
            + " | "
            + " | ".join(f"{(r['terms'][k] - base) * 1e3:+.1f}" for r in rows[1:])
            + " |"
        )
    return lines


def report(rows, args, name, params) -> str:
    kv = "".join(f" --kv-bits {b}" for b in args.kv_bits)
    lines = [
        f"# Long contexts: Qwen3.5-0.8B shape ({name}), oracle draft at block {BLOCK}",
        "",
        f"`python bench/long_context.py --precision {args.precision} --contexts {args.contexts}"
        f" --tokens {args.tokens} --rounds {args.rounds} --reps {args.reps}{kv}`",
        "",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, MLX device {mx.default_device()}; load average %.1f %.1f %.1f when this "
        "context ended (this run alone is about 1); mlx-lm and the engine take turns in this one process"
        % os.getloadavg(),
        f"- BLAS: {blas.describe()}",
        f"- target: random weights, the published Qwen3.5-0.8B config.json, {params:.3f} B parameters ({name}); "
        "draft: random weights, the published 0.8B DFlash draft's shape (5 full-attention layers); "
        "the oracle proposes the target's greedy continuation and runs that draft's forward every cycle",
        f"- per context: one prefill, then both decoders from the same state, {args.tokens} tokens each after "
        f"an untimed warm-up (3 tokens; one cycle), median of {args.rounds} rounds; terms: median of "
        f"{args.reps} repeats",
        "- random weights give degenerate greedy text (repetition); costs do not depend on it",
        "",
        "## Speedup over mlx-lm",
        "",
        "Speculative = plain: the oracle's tokens equal the engine's own plain decoding from the same state "
        "(it proposes them; a parting names its token). mlx-lm agrees for: the share of the run its greedy "
        "tokens match the engine's plain ones from the start (the least over the rounds).",
        "",
        "| context | mlx-lm tok/s | engine plain tok/s | oracle tok/s | speedup | vs 1st context | tau | ms/cycle | "
        "engine prefill tok/s | draft context s | speculative = plain | mlx-lm agrees for |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    fp = [r[None] for r in rows]
    s0 = fp[0]["oracle_tps"] / fp[0]["mlx_tps"]
    for r in fp:
        s = r["oracle_tps"] / r["mlx_tps"]
        lines.append(
            f"| {r['L']} | {r['mlx_tps']:.2f} | {r['plain_tps']:.2f} | {r['oracle_tps']:.2f} | {s:.2f}x | "
            f"{s / s0 * 100:.0f}% | {r['tau']:.2f} | {r['ms_cycle']:.0f} | {r['L'] / r['prefill_s']:.0f} | "
            f"{r['draft_ctx_s']:.1f} | {_same(r)} | {r['agree'] * 100:.0f}% |"
        )
    lines += [
        "",
        "## What grows with context (ms per call)",
        "",
        "T_verify includes the capture of the draft's feature rows; T_rollback restores the caches to 8 of the "
        "16 rows; T_draft reads 4 new context rows and runs the block over all held context rows. "
        "Growth: ms added from the first context to each later one.",
        "",
        *terms_table(fp),
    ]
    for bits in args.kv_bits:
        q = [r[bits] for r in rows]
        s0 = q[0]["oracle_tps"] / q[0]["mlx_tps"]
        lines += [
            "",
            f"## Quantized KV, {bits}-bit",
            "",
            f"The full-precision prefill's attention rows quantized once ({bits}-bit, groups of {KV_GROUP_SIZE}): "
            "the engine's cache in its format (keys rotated, docs/kv-quant.md), mlx-lm's as its "
            "QuantizedKVCache stores them (not rotated), so their greedy tokens may part (the last column: the share "
            "of the run before they first differ); the oracle follows "
            "the engine's own plain decoding of its cache and must equal it. Speedup: oracle over mlx-lm "
            "with its quantized cache.",
            "",
            "| context | mlx-lm tok/s | engine plain tok/s | oracle tok/s | speedup | vs 1st context | tau | "
            "ms/cycle | oracle = engine plain | mlx-lm's tokens agree for |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in q:
            s = r["oracle_tps"] / r["mlx_tps"]
            lines.append(
                f"| {r['L']} | {r['mlx_tps']:.2f} | {r['plain_tps']:.2f} | {r['oracle_tps']:.2f} | {s:.2f}x | "
                f"{s / s0 * 100:.0f}% | {r['tau']:.2f} | {r['ms_cycle']:.0f} | {_same(r)} | "
                f"{r['agree'] * 100:.0f}% |"
            )
        lines += ["", f"What grows with context, {bits}-bit KV (ms per call):", "", *terms_table(q)]
    left = [L for L in (int(x) for x in args.contexts.split(",")) if L not in {r[None]["L"] for r in rows}]
    if left:
        lines += ["", f"Not measured in this run (time or memory): contexts {', '.join(map(str, left))}."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192,16384,32768", help="context lengths, ascending")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "4bit"], help="the target's weights")
    ap.add_argument("--scale", type=int, default=1, help="shrink the shape N times (development runs)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per decode run")
    ap.add_argument("--rounds", type=int, default=2, help="decode rounds per context (the modes take turns)")
    ap.add_argument("--reps", type=int, default=3, help="repeats of each term (median)")
    ap.add_argument(
        "--kv-bits",
        type=int,
        action="append",
        default=[],
        choices=[4, 8],
        help="also measure with the attention KV quantized to this many bits (repeatable; same prefill)",
    )
    ap.add_argument("--models", default="/tmp/mlx-dflash-shapes", help="where the model folders are written")
    ap.add_argument("--out", default=str(RESULTS / "long-context.md"), help="result file")
    blas.add_flag(ap)
    args = ap.parse_args()
    args.kv_bits = sorted(set(args.kv_bits), reverse=True)
    blas.ensure_openblas(args.blas)
    paths = shapes.write_models(Path(args.models) / f"0.8b-x{args.scale}", "0.8b", args.scale)
    target, draft = shapes.load(paths[args.precision], paths["draft"])
    from mlx_lm.utils import get_total_parameters

    params = get_total_parameters(target.model) / 1e9
    # Warm-up: compiles every width the runs use.
    p = shapes.prompt_ids(64, target.vocab_size)
    shapes.mlx_lm_generate(target.model, p, 4)
    cache = target.make_cache()
    logits, feats = target.prefill(p, cache, capture=draft.target_layer_ids)
    anchor = int(mx.argmax(logits[-1]).item())
    snap = cache.snapshot()
    ref, _, _ = engine_decode(target, p, cache, None, None, anchor, 39)
    cache.restore(snap)
    dc = draft.make_cache()
    draft.add_context(feats, dc)
    engine_decode(target, p, cache, dc, shapes.OracleDraft(p + [anchor] + ref, draft, strict=False), anchor, 39)
    del cache, dc, feats, logits
    rows = []
    for L in (int(x) for x in args.contexts.split(",")):
        rows.append(measure_context(L, target, draft, target.model, args))
        text = report(rows, args, args.precision, params)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
