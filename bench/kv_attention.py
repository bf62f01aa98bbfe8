"""One attention layer over a quantized KV cache: single rows against verify blocks, side by side.

    python bench/kv_attention.py [--contexts 1024,8192,16384,32768] [--bits 8,4] [--reps 5]

The Qwen3.5-0.8B attention shape (8 query heads, 2 KV heads, head dim 256;
tools/shapes.py), random K/V rows quantized as ``--kv-bits`` stores them, at
each context L. Per repeat, taking turns, the median of ``--reps`` each (ms):

- ``quantized T``: mlx-lm's quantized attention (``mx.quantized_matmul``
  over the packed rows) for T query rows, the path single rows take;
- ``engine T``: ``QuantizedKVBuffer.attend`` of a block of T rows (append
  and quantize the block's rows, then attend: on a CPU, blocks of
  ``DEQUANT_MIN_ROWS`` or more attend over the rows dequantized once,
  ``STRETCH_ROWS`` rows at a time, merging the softmax);
- ``one pass T``: the same block dequantizing all rows and taking one
  softmax over them (the engine before stretches);
- ``float T``: the same attention over a full-precision cache (stretches too);
- ``mx.dequantize`` and ``cache.dequantize``: one KV head-set's keys back to floats.

Writes bench/results/kv-attention.md (``--out``).
"""

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

import mlx.core as mx  # noqa: E402

from mlx_dflash import blas  # noqa: E402
from mlx_dflash.cache import DEQUANT_MIN_ROWS, KV_GROUP_SIZE, KVBuffer, QuantizedKVBuffer, dequantize  # noqa: E402
from mlx_dflash.kernels.fused_exp import STRETCH_ROWS, attention_stretches  # noqa: E402
from tools import shapes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def measure(L: int, bits: int, T: int, reps: int, H: int, Hkv: int, D: int) -> dict:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    k = mx.random.normal((1, Hkv, L, D))
    v = mx.random.normal((1, Hkv, L, D))
    q = mx.random.normal((1, H, T, D))
    mask = "causal" if T > 1 else None
    qbuf, fbuf = QuantizedKVBuffer(bits), KVBuffer()
    qbuf.append(k[:, :, : L - T], v[:, :, : L - T])
    fbuf.append(k[:, :, : L - T], v[:, :, : L - T])
    mx.eval(qbuf.state(), fbuf.state())
    held = QuantizedKVBuffer(bits)
    held.append(k, v)
    packed = held.state()
    mx.eval(packed)

    def quantized():
        return quantized_scaled_dot_product_attention(
            mx.array(q), packed[:3], packed[3:], scale=D**-0.5, mask=mask, group_size=KV_GROUP_SIZE, bits=bits
        )

    def engine():
        out = qbuf.attend(q, k[:, :, L - T :], v[:, :, L - T :], D**-0.5, mask, verify=True)
        qbuf.truncate(L - T)
        return out

    def one_pass():
        keys, values = qbuf.append(k[:, :, L - T :], v[:, :, L - T :])
        whole = [dequantize(*rows, group_size=KV_GROUP_SIZE, bits=bits) for rows in (keys, values)]
        out = attention_stretches(qbuf._rotate(q), [tuple(whole)], D**-0.5, mask)
        qbuf.truncate(L - T)
        return out

    def floats():
        out = fbuf.attend(q, k[:, :, L - T :], v[:, :, L - T :], D**-0.5, mask, verify=True)
        fbuf.truncate(L - T)
        return out

    fns = {
        f"quantized {T}": quantized,
        f"engine {T}": engine,
        f"float {T}": floats,
    }
    if T >= DEQUANT_MIN_ROWS:
        fns[f"one pass {T}"] = one_pass
    if T == 1:
        fns["mx.dequantize"] = lambda: mx.dequantize(*packed[:3], group_size=KV_GROUP_SIZE, bits=bits)
        fns["cache.dequantize"] = lambda: dequantize(*packed[:3], group_size=KV_GROUP_SIZE, bits=bits)
    times = {name: [] for name in fns}
    for r in range(reps + 1):
        # A new order each repeat: no path always runs after the same one.
        names = list(fns)
        random.Random(r).shuffle(names)
        for name in names:
            dt = timed(fns[name])
            if r:
                times[name].append(dt)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192,16384,32768", help="cached rows L")
    ap.add_argument("--bits", default="8,4", help="KV bits")
    ap.add_argument("--rows", default="1,16", help="query rows T (1: a plain step; 16: a block-16 verify)")
    ap.add_argument("--reps", type=int, default=5, help="repeats (median)")
    ap.add_argument("--out", default=str(RESULTS / "kv-attention.md"), help="result file")
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    cfg = shapes.target_config("0.8b")["text_config"]
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Ts = [int(t) for t in args.rows.split(",")]
    lines = [
        "# Attention over a quantized KV cache: single rows and verify blocks",
        "",
        f"`python bench/kv_attention.py --contexts {args.contexts} --bits {args.bits} --rows {args.rows} "
        f"--reps {args.reps}`",
        "",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        "load average %.1f %.1f %.1f at the end" % os.getloadavg(),
        f"- BLAS: {blas.describe()}; MLX {mx.__version__}, device {mx.default_device()}",
        f"- one attention layer of the Qwen3.5-0.8B shape ({H} query heads, {Hkv} KV heads, head dim {D}), "
        f"random rows, groups of {KV_GROUP_SIZE}; ms per call, median of {args.reps}, the paths taking turns in a new order each repeat",
        f"- quantized: mlx-lm's quantized attention over the packed rows; engine: QuantizedKVBuffer.attend "
        f"(blocks of >= {DEQUANT_MIN_ROWS} rows attend over the rows dequantized on a CPU, {STRETCH_ROWS} "
        "at a time); one pass: that block dequantizing all rows, one softmax; float: a full-precision cache; "
        "dequantize: one layer's keys",
        "",
    ]
    header = (
        ["bits", "context"]
        + [
            f"{p} {T}"
            for T in Ts
            for p in ("quantized", "engine", "float") + (("one pass",) if T >= DEQUANT_MIN_ROWS else ())
        ]
        + ["mx.dequantize", "cache.dequantize"]
    )
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    ratios = []
    for bits in (int(b) for b in args.bits.split(",")):
        for L in (int(x) for x in args.contexts.split(",")):
            row = {}
            for T in Ts:
                row.update(measure(L, bits, T, args.reps, H, Hkv, D))
            print(f"bits {bits} L {L}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
            lines.append(f"| {bits} | {L} | " + " | ".join(f"{row[h]:.2f}" for h in header[2:]) + " |")
            ratios.append((bits, L, row))
    T = max(Ts)
    lines += [
        "",
        f"Ratios: a {T}-row block over one row's quantized attention (what a verify costs against a plain step's "
        "attention), the engine's block against the quantized path's and against one pass, and the two "
        "dequantizations.",
        "",
        f"| bits | context | quantized {T} / quantized 1 | engine {T} / quantized 1 | quantized {T} / engine {T} | "
        f"engine {T} / one pass {T} | mx.dequantize / cache.dequantize |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for bits, L, r in ratios:
        q1 = r["quantized 1"]
        lines.append(
            f"| {bits} | {L} | {r[f'quantized {T}'] / q1:.1f} | {r[f'engine {T}'] / q1:.1f} | "
            f"{r[f'quantized {T}'] / r[f'engine {T}']:.1f}x | {r[f'engine {T}'] / r[f'one pass {T}']:.2f} | "
            f"{r['mx.dequantize'] / r['cache.dequantize']:.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
