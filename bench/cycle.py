"""Per-cycle cost terms of DFlash decoding: T_ar, T_verify(B), T_draft, T_rollback, tau,
and what a cycle of the real loop spends beyond its draft and verify forwards.

    python bench/cycle.py [--models embedded,medium] [--reps 10] [--blas auto|openblas|bundled]

speedup ~= tau * T_ar / (T_draft + T_verify(B) + T_rollback). Each term is a
median over --reps after a warm-up, measured side by side in this one run,
plus real generations (baseline, dflash pinned at B=16, dflash adaptive) for
tau and end-to-end tok/s, and the forwards as plain ops (--no-compile) next to
the compiled ones. The loop's overhead is its time per cycle at B=16
minus the isolated T_draft(16) + T_verify(16) (rollback, host work, small
arrays); its share of a cycle is reported. Writes bench/results/cycle-<model>.md.
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

from mlx_dflash import blas  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS = (1, 2, 4, 8, 16)


def med(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def medium_pair(tmp):
    """A >= 100M-parameter random fp32 target and a 2-layer draft, in memory."""
    from mlx_dflash.models.qwen35 import Target
    from tools import tiny

    cfg = tiny.target_config(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=3072,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        full_attention_interval=4,
    )
    target = Target(tiny.build_target(cfg, seed=0))
    dcfg = tiny.draft_config(
        cfg, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=3072
    )
    draft = tiny.build_draft(dcfg, seed=1).bind(target)
    return target, draft


def embedded_pair():
    import mlx_dflash

    e = mlx_dflash.load()
    return e.target, e.draft


def measure(name, target, draft, reps, ctx_len=128, gen_tokens=64):
    import mlx.core as mx
    from mlx_lm.utils import get_total_parameters

    from mlx_dflash.decode import GenerationStats, generate_tokens

    prompt = [(7 * i + 3) % target.vocab_size for i in range(ctx_len)]
    capture = draft.target_layer_ids
    cache = target.make_cache()
    _, feats = target.prefill(prompt, cache, capture=capture)
    mx.eval(feats)
    rows = {}

    def ar():
        lg, _ = target.forward([5], cache)
        mx.eval(mx.argmax(lg, -1))

    rows["T_ar"] = med(ar, reps)

    for B in BLOCKS[1:]:
        block = [(11 * j + 1) % target.vocab_size for j in range(B)]
        tv, tr = [], []
        for r in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            lg, f = target.forward(block, cache, capture=capture, record=True)
            mx.eval(mx.argmax(lg, -1), f, cache.state())
            t1 = time.perf_counter()
            cache.rollback(max(B // 2, 1))  # a mid-block acceptance
            mx.eval(cache.state())
            t2 = time.perf_counter()
            if r:
                tv.append(t1 - t0)
                tr.append(t2 - t1)
        rows[f"T_verify({B})"] = statistics.median(tv)
        rows[f"T_rollback({B})"] = statistics.median(tr)
    # T_draft at block 16 with a few new context rows, as in a real cycle.
    dcache = draft.make_cache()
    draft(feats, 9, ctx_len, 16, dcache)
    pos = [ctx_len]
    newf = feats[-4:]

    def drafting():
        lg = draft(newf, 9, pos[0] + 4, 16, dcache)
        pos[0] += 4
        mx.eval(mx.argmax(lg, -1))

    rows["T_draft(16)"] = med(drafting, reps)

    # The same forwards as plain MLX ops (--no-compile), side by side.
    target.compiled = draft.compiled = False
    try:
        rows["T_ar, plain ops"] = med(ar, reps)
        block = [(11 * j + 1) % target.vocab_size for j in range(16)]

        def verify16():
            lg, f = target.forward(block, cache, capture=capture, record=True)
            mx.eval(mx.argmax(lg, -1), f, cache.state())
            cache.rollback(8)
            mx.eval(cache.state())

        rows["T_verify(16) + T_rollback(16), plain ops"] = med(verify16, reps)
        rows["T_draft(16), plain ops"] = med(drafting, reps)
    finally:
        target.compiled = draft.compiled = True

    res = {}
    modes = (("baseline", None, None), ("dflash", draft, 16), ("adaptive", draft, None))
    for _ in range(3):  # the modes take turns; each keeps its fastest run
        for mode, d, B in modes:
            st = GenerationStats()
            out = []
            for toks in generate_tokens(target, prompt, draft=d, max_tokens=gen_tokens, stats=st, block_size=B):
                out.extend(toks)
            if mode not in res or st.decode_tps > res[mode][0].decode_tps:
                res[mode] = (st, out)
    same = res["baseline"][1] == res["dflash"][1] == res["adaptive"][1]
    params = get_total_parameters(target.model) / 1e6
    return rows, res, same, params


def write(name, rows, res, same, params, reps):
    st_b, st_d = res["baseline"][0], res["dflash"][0]
    tau = st_d.tau
    t_ar = rows["T_ar"]
    lines = [
        f"# Cycle costs: {name}",
        "",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}",
        f"- BLAS: {blas.describe()}",
        f"- target parameters: {params:.1f} M (fp32); reps: {reps} (median)",
        f"- baseline and dflash tokens identical: {same}",
        "",
        "| term | ms | ratio to T_ar |",
        "|---|---:|---:|",
    ]
    for k, v in rows.items():
        lines.append(f"| {k} | {v * 1e3:.2f} | {v / t_ar:.2f} |")
    pred = tau * t_ar / (rows["T_draft(16)"] + rows["T_verify(16)"] + rows["T_rollback(16)"])
    lines += [
        "",
        "T_verify(B): one recorded target forward of B tokens with capture; "
        "T_rollback(B): restoring the caches to B/2 accepted tokens (tape replay). "
        "Rows marked 'plain ops' run the same forwards uncompiled (--no-compile).",
        "",
        "| generation (64 tokens, best of 3) | decode tok/s | tau | cycles | ms per cycle | widths |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for mode, label in (("baseline", "baseline"), ("dflash", "dflash (B=16 pinned)"), ("adaptive", "dflash adaptive")):
        st = res[mode][0]
        lines.append(
            f"| {label} | {st.decode_tps:.1f} | {st.tau:.2f} | {st.cycles} | "
            f"{st.decode_time / st.cycles * 1e3:.2f} | " + " ".join(f"{w}:{c}" for w, c in st.widths.items()) + " |"
        )
    cyc = st_d.decode_time / st_d.cycles
    fwd = rows["T_draft(16)"] + rows["T_verify(16)"]
    lines += [
        "",
        f"Predicted speedup at B=16 from the terms: tau*T_ar/(T_draft+T_verify+T_rollback) = {pred:.2f}x; "
        f"measured: {st_d.decode_tps / st_b.decode_tps:.2f}x.",
        "",
        f"Loop overhead at B=16: {cyc * 1e3:.2f} ms per cycle against {fwd * 1e3:.2f} ms of isolated draft + verify "
        f"forwards: {max(cyc - fwd, 0) * 1e3:.2f} ms beyond them, {max(cyc - fwd, 0) / cyc * 100:.0f}% of a cycle "
        "(the loop overlaps the next draft with the host's work, so this can be near or below 0).",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"cycle-{name}.md").write_text(text)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,medium", help="comma list of: embedded, medium")
    ap.add_argument("--reps", type=int, default=10, help="timed repeats per term (median)")
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    print(f"BLAS: {blas.describe()}", flush=True)
    for name in args.models.split(","):
        target, draft = embedded_pair() if name == "embedded" else medium_pair(None)
        rows, res, same, params = measure(name, target, draft, args.reps)
        write(name, rows, res, same, params, args.reps)


if __name__ == "__main__":
    main()
