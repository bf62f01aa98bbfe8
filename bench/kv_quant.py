"""Quantized attention KV (--kv-bits): memory per 1k tokens, speed, agreement.

    python bench/kv_quant.py [--context 1024] [--tokens 512] [--blas auto|openblas|bundled]

For full precision, 8-bit and 4-bit K/V on the embedded pair: attention K/V
bytes per 1k context tokens (measured on the cache after a --context-token
prompt), plain and DFlash decode tok/s after that prompt (the modes taking
turns, best of 2), and greedy agreement with the full-precision cache over
--tokens generated tokens: the first position where the tokens differ and
the share of positions equal. Quantized KV changes the target, so agreement
is reported, not assumed; DFlash with quantized KV is checked to give the
same tokens as plain decoding with the same quantized KV.
Writes bench/results/kv-quant.md.
"""

import argparse
import platform
from pathlib import Path

from mlx_dflash import blas

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens (start of argparse.py)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens generated per run")
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    import mlx_dflash
    from mlx_dflash.benchmark import context_prompt
    from mlx_dflash.decode import GenerationStats, generate_tokens

    e = mlx_dflash.load()
    ids = context_prompt(e, args.context)

    def run(bits, draft):
        st = GenerationStats()
        cache = e.target.make_cache(kv_bits=bits)
        out = []
        for t in generate_tokens(e.target, ids, draft=draft, max_tokens=args.tokens, stats=st, cache=cache):
            out.extend(t)
        return out, st, cache.kv_nbytes() / cache.offset * 1000

    rows = {}
    for _ in range(2):
        for bits in (None, 8, 4):
            for mode, d in (("plain", None), ("dflash", e.draft)):
                out, st, per_k = run(bits, d)
                key = (bits, mode)
                if key not in rows or st.decode_tps > rows[key][1].decode_tps:
                    rows[key] = (out, st, per_k)
                print(bits, mode, f"{st.decode_tps:.1f} tok/s", flush=True)
    ref = rows[(None, "plain")][0]
    lines = [
        "# Quantized KV cache (--kv-bits)",
        "",
        f"- machine: {platform.platform()}; BLAS: {blas.describe()}",
        f"- embedded pair; prompt: first {args.context} tokens of argparse.py; {args.tokens} tokens generated greedily; "
        "best of 2 runs, the six configurations taking turns (a shared, loaded machine: compare within a run)",
        "",
        "| KV | K/V bytes per 1k tokens | plain tok/s | dflash tok/s | dflash = plain (same KV) | "
        "first token differing from full precision | positions equal to full precision |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for bits in (None, 8, 4):
        out, st_p, per_k = rows[(bits, "plain")]
        dout, st_d, _ = rows[(bits, "dflash")]
        first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        equal = sum(a == b for a, b in zip(out, ref)) / max(len(ref), 1)
        lines.append(
            f"| {'float32' if bits is None else f'{bits}-bit'} | {per_k / 1024:.1f} KiB | {st_p.decode_tps:.1f} | "
            f"{st_d.decode_tps:.1f} | {dout == out} | {'none' if first is None else first} | {equal:.1%} |"
        )
    lines += [
        "",
        "Bytes count the attention layers' K/V rows held (packed values, scales and biases for the "
        "quantized ones); the DeltaNet layers' state is fixed-size and not included.",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv-quant.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
