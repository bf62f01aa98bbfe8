"""Whether a verify's rows are a single step's rows, on this machine's MLX device.

    python bench/row_exact.py [--size 0.8b] [--scale 1] [--block 16]

Speculative greedy output equals plain greedy output when each row of a
B-token verify gets the logits a one-token step gives that token, or when
the differences never flip a greedy pick. On a CPU the engine keeps single
steps' order where it matters (docs/numerics.md). On a GPU, MLX sends a
one-row product to a matrix-vector kernel and a several-row one to a
matrix-matrix kernel, which rounds float32 through TF32 unless
MLX_ENABLE_TF32=0. Measured per weight format (float32; bfloat16; 4-bit as
mlx_lm.convert quantizes, with bf16 activations as in published 4-bit
checkpoints):

- matmul: X[B, D] @ W against each row alone, X[i:i+1] @ W, at the target's
  width (largest difference over the largest entry);
- verify: a random-weight target at the published Qwen3.5 shape
  (tools/shapes.py), a 64-token prompt prefilled, then the B-row recorded
  verify against B single steps from the same state: the largest logit
  difference over the rows (relative to the logits' spread) and the rows
  whose greedy pick differs.

The device, MLX version and MLX_ENABLE_TF32 are in the result. Writes
bench/results/row-exact-<device>.md (``--out``).
"""

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

import mlx.core as mx  # noqa: E402

from mlx_dflash import blas  # noqa: E402
from tools import shapes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def matmul_rows(dim: int, block: int, dtype, bits=None) -> float:
    """Largest |row of a B-row product - the same row alone| / largest |entry|."""
    k1, k2 = mx.random.split(mx.random.key(0))
    x = mx.random.normal((block, dim), key=k1).astype(mx.float32 if dtype is None else dtype)
    w = (mx.random.normal((4 * dim, dim), key=k2) / dim**0.5).astype(x.dtype)
    if bits:
        wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)

        def mm(a):
            return mx.quantized_matmul(a, wq, scales, biases, transpose=True, group_size=64, bits=bits)
    else:

        def mm(a):
            return a @ w.T

    full = mm(x).astype(mx.float32)
    rows = mx.concatenate([mm(x[i : i + 1]) for i in range(block)]).astype(mx.float32)
    return (mx.abs(full - rows).max() / mx.abs(rows).max()).item()


def verify_rows(target, prompt, block: int):
    """(largest |logit difference| / the logits' spread, rows whose argmax differs)
    of a recorded ``block``-row verify against single steps from the same state."""
    c1, c2 = target.make_cache(), target.make_cache()
    logits, _ = target.prefill(prompt, c1)
    target.prefill(prompt, c2)
    toks = [int(mx.argmax(logits[-1]).item())]
    singles = []
    for _ in range(block):  # the plain continuation: single steps
        lg = target.forward([toks[-1]], c2)[0][0].astype(mx.float32)
        singles.append(lg)
        toks.append(int(mx.argmax(lg).item()))
    verify, _ = target.forward(toks[:block], c1, record=True)
    verify = verify.astype(mx.float32)
    single = mx.stack(singles)
    spread = (single.max(axis=-1) - single.min(axis=-1)).max()
    rel = (mx.abs(verify - single).max() / spread).item()
    differ = [i for i in range(block) if int(mx.argmax(verify[i]).item()) != int(mx.argmax(single[i]).item())]
    return rel, differ


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.8b", choices=sorted(shapes.SIZES), help="published target shape")
    ap.add_argument("--scale", type=int, default=1, help="shrink the shape N times (development runs)")
    ap.add_argument("--block", type=int, default=16, help="verify rows B")
    ap.add_argument("--models", default="/tmp/mlx-dflash-shapes", help="where the model folders are written")
    ap.add_argument("--out", default=None, help="result file (default bench/results/row-exact-<device>.md)")
    blas.add_flag(ap)
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    from mlx_dflash.loading import load_target

    device = str(mx.default_device()).replace("Device(", "").replace(")", "").replace(", ", "")
    paths = shapes.write_models(Path(args.models) / f"{args.size}-x{args.scale}", args.size, args.scale)
    cfg = shapes.target_config(args.size, args.scale)["text_config"]
    dim = cfg["hidden_size"]
    prompt = shapes.prompt_ids(64, cfg["vocab_size"])
    rows = []
    for name, folder, dtype, bits in (
        ("float32", paths["fp32"], None, None),
        ("bfloat16", paths["fp32"], mx.bfloat16, None),
        ("4-bit, bf16 activations", paths["4bit"], mx.bfloat16, 4),
    ):
        target = load_target(folder, dtype=dtype)
        mm = matmul_rows(dim, args.block, dtype, bits)
        rel, differ = verify_rows(target, prompt, args.block)
        rows.append((name, mm, rel, differ))
        print(
            f"{name}: matmul rows {mm:.2e}, verify rows {rel:.2e}, greedy picks differing at rows {differ}", flush=True
        )
        del target
        mx.clear_cache()
    tf32 = os.environ.get("MLX_ENABLE_TF32", "unset (MLX's default: on)")
    lines = [
        f"# Verify rows against single steps: {device}",
        "",
        f"`python bench/row_exact.py --size {args.size} --scale {args.scale} --block {args.block}`",
        "",
        f"- machine: {platform.platform()}, {platform.machine()}; MLX {mx.__version__}, device {device}; "
        f"MLX_ENABLE_TF32 {tf32}",
        f"- BLAS: {blas.describe()}",
        f"- target: random weights, the published Qwen3.5-{args.size.upper()} config.json"
        + (f" scaled down {args.scale}x" if args.scale > 1 else "")
        + f"; a 64-token prompt, then {args.block} rows verified (recorded, as the decoder verifies) against "
        f"{args.block} single steps of the plain continuation; matmul at width {dim}",
        "- 0 means bit for bit; a greedy pick can differ only where a row's top two logits are closer than the "
        "difference",
        "",
        "| weights | matmul: B rows vs one | verify rows vs single steps (of the logits' spread) "
        "| rows whose greedy pick differs |",
        "|---|---:|---:|---|",
    ]
    for name, mm, rel, differ in rows:
        lines.append(f"| {name} | {mm:.1e} | {rel:.1e} | {', '.join(map(str, differ)) or 'none'} |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out) if args.out else RESULTS / f"row-exact-{device}.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
