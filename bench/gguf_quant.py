"""Quantized GGUF files as the file holds them: how close and how big.

    python bench/gguf_quant.py [--llama-python /path/to/python-with-llama_cpp]

With ``--llama-python`` it also quantizes the same source to Q4_1, Q5_0,
Q5_1, Q2_K, Q3_K_M, IQ4_NL and IQ4_XS with llama.cpp (not kept) and reports those too.

For each fixture in tests/data (made by llama.cpp's own quantizer, see its
README), against an F32 GGUF holding gguf-py's exact dequantization of the same
file (gguf-py's decode equals llama.cpp's ``dequantize_row_*``):

- the engine's logits on the quantized file (``added``), next to the file's own
  error (the dequantized file vs the unquantized source) and to the added error
  of the earlier loader's requantization (dequantize, then ``mx.quantize``:
  group 64, 8 bits for Q5/Q6/Q8 sources, 4 bits for the rest, fp16 scales);
- where greedy decoding (64 tokens) first parts from the dequantized file's;
- memory: the loaded MLX weights vs the file's tensor bytes; and bits per
  weight of each type's MLX form.

Runs in float32 (the type that holds the K-quant scales). Writes
bench/results/gguf-quant.md.
"""

import argparse
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import make_quant_fixtures as fx  # noqa: E402
from test_gguf_quant import PROMPT, dequantized_gguf, param_types  # noqa: E402

from mlx_dflash.decode import generate_tokens  # noqa: E402
from mlx_dflash.loading.gguf import FP16_SCALED, default_bits, load_gguf_target, mlx_form  # noqa: E402


def old_bits(t: str) -> int:
    return 8 if t.startswith(("Q5", "Q6", "Q8")) else 4


def old_requantized(deq_path, q_path):
    """The earlier loader's weights: the exact decode requantized to group 64, fp16 scales."""
    from mlx.utils import tree_flatten

    target, _ = load_gguf_target(deq_path, dtype=mx.float32)
    src = param_types(q_path)
    updates = []
    for k, w in tree_flatten(target.model.parameters()):
        t = src.get(k, "F32")
        if t in ("F32", "F16", "BF16") or w.ndim < 2:
            continue
        b = old_bits(t)
        gs = 64 if w.shape[-1] % 64 == 0 else 32
        q, s, z = mx.quantize(w, group_size=gs, bits=b)
        updates.append(
            (
                k,
                mx.dequantize(
                    q,
                    s.astype(mx.float16).astype(mx.float32),
                    z.astype(mx.float16).astype(mx.float32),
                    group_size=gs,
                    bits=b,
                ),
            )
        )
    target.model.load_weights(updates, strict=False)
    return target


def logits(target):
    return np.array(target(PROMPT).astype(mx.float32), np.float64)


def greedy(target, n=64):
    out = []
    for t in generate_tokens(target, PROMPT, max_tokens=n):
        out.extend(t)
    return out


def parts_at(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


def nbytes(model):
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


EXTRA = {"Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "IQ4_NL": 25, "IQ4_XS": 30}  # llama_ftype


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", help="a Python where llama_cpp imports: also measure more types")
    a = ap.parse_args()
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rows, mem, types_seen = [], [], Counter()
    with tempfile.TemporaryDirectory() as tmp:
        src_path = fx.source_gguf(Path(tmp))
        src = load_gguf_target(src_path, dtype=mx.float32)[0]
        ls = logits(src)
        files = {name: fx.fixture(name) for name in fx.FTYPES}
        for name, ftype in EXTRA.items() if a.llama_python else ():
            files[name] = Path(tmp) / f"{name}.gguf"
            subprocess.run(
                [a.llama_python, "-c", fx.QUANTIZE, str(src_path), str(files[name]), str(ftype), "0"],
                check=True,
                capture_output=True,
            )
        for name, path in files.items():
            deq_path = dequantized_gguf(path, Path(tmp) / f"{name}-deq.gguf")
            f = load_gguf_target(deq_path, dtype=mx.float32)[0]
            q, qcfg = load_gguf_target(path, dtype=mx.float32)
            old = old_requantized(deq_path, path)
            lf, lq, lo = logits(f), logits(q), logits(old)
            gf, gq, go = greedy(f), greedy(q), greedy(old)
            r = GGUFReader(str(path))
            kinds = Counter(t.tensor_type.name for t in r.tensors if t.tensor_type.name != "F32")
            types_seen.update(kinds)
            own, added, added_old = rms(lf - ls), rms(lq - lf), rms(lo - lf)
            p, po = parts_at(gq, gf), parts_at(go, gf)
            rows.append(
                f"| {name} | {', '.join(f'{k} x{v}' for k, v in sorted(kinds.items()))} | {own:.4f} | "
                f"{added:.2e} ({added / own:.3f} of own) | {np.abs(lq - lf).max():.2e} | "
                f"{'equal' if p is None else f'token {p}'} | {added_old:.4f} ({added_old / own:.2f}) | "
                f"{'equal' if po is None else f'token {po}'} |"
            )
            default, dcfg = load_gguf_target(path)
            file_bytes = sum(int(t.n_bytes) for t in r.tensors)
            mem.append(
                f"| {name} | {file_bytes / 1e6:.3f} MB | {nbytes(default.model) / 1e6:.3f} MB "
                f"({nbytes(default.model) / file_bytes:.2f}x) | {dcfg['torch_dtype']} |"
            )
    per_type = []
    for t in list(dict.fromkeys(sorted(types_seen) + ["Q4_1", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "MXFP4"])):
        block, size = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, t)]
        form = mlx_form(t)
        bits = default_bits(t)
        scale_bits = 8 if t == "MXFP4" else (16 if t in FP16_SCALED else 32) * 2
        per_type.append(
            f"| {t} | {size * 8 / block:.4g} | {form} | {bits + scale_bits / 32:.4g} | "
            f"{(bits + scale_bits / 32) / (size * 8 / block):.2f}x |"
        )
    out = ROOT / "bench" / "results" / "gguf-quant.md"
    out.write_text(
        "\n".join(
            [
                "# Quantized GGUF weights as the file holds them",
                "",
                f"`python bench/gguf_quant.py{' --llama-python PY' if a.llama_python else ''}`: the llama.cpp-made "
                "fixtures in tests/data (tiny qwen35, hidden 256; tests/data/README.md)"
                + (f", and the same source quantized by llama.cpp to {', '.join(EXTRA)}" if a.llama_python else "")
                + ".",
                "Float32, a prompt of 16 tokens. *Own*: RMS logit difference of the file's exact",
                "dequantization vs the unquantized source. *Added*: the engine on the quantized file vs on an F32 GGUF",
                "holding gguf-py's exact dequantization of it. *Old*: the earlier loader's requantization (group 64,",
                "8 bits for Q5/Q6/Q8, else 4, fp16 scales). Greedy: 64 tokens vs the dequantized file's.",
                "",
                "| file | quantized tensors | own | added (now) | max abs (now) | greedy (now) | added (old) | greedy (old) |",
                "|---|---|---:|---:|---:|---:|---:|---:|",
                *rows,
                "",
                "## Memory: loaded MLX weights (default float type) vs the file's tensor bytes",
                "",
                "| file | file tensors | MLX weights | float type |",
                "|---|---:|---:|---|",
                *mem,
                "",
                "## Bits per weight by type (group 32; scales and biases counted)",
                "",
                "| GGUF type | file bpw | MLX form | MLX bpw | MLX / file |",
                "|---|---:|---|---:|---:|",
                *per_type,
                "",
            ]
        )
    )
    print(out.read_text())


if __name__ == "__main__":
    main()
