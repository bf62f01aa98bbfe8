"""Memory of a Q4_K_M GGUF loaded by mlx-dflash next to mlx-lm's own 4-bit
conversion of the same model.

    python bench/gguf_memory.py [--hidden 1024 --layers 8 --vocab 8192 --tokens 64]

Builds one random bf16 Qwen3.5 HF folder, then
  a. ``mlx_lm.convert -q`` (4-bit, group 64) of it;
  b. a Q4_K_M GGUF of it (tests/gguf_writer.py: llama.cpp's converter conventions,
     llama.cpp's Q4_K_M mix: Q6_K for embeddings, output, ffn_down and attn_v);
  c. ``mlx-dflash convert`` of that GGUF (an mlx_lm.convert-style folder);
and measures each in a fresh process: weights resident after load, peak
memory while loading and while generating ``--tokens`` plain greedy tokens.
Writes bench/results/gguf-memory.md.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def build(d: Path, hidden: int, layers: int, vocab: int) -> dict:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # gguf_writer; tools/
    import mlx.core as mx
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import convert_hf_to_gguf
    from mlx_lm import convert as mlx_lm_convert

    from mlx_dflash.cli import main
    from tools import tiny

    cfg = tiny.scaled_target_config(hidden, layers, vocab)
    cfg["torch_dtype"] = "bfloat16"  # as Qwen3.5 checkpoints ship
    tok = tiny.build_tokenizer(d / "tok", vocab_size=512)
    model = tiny.build_target(cfg, seed=0, dtype=mx.bfloat16)
    hf = tiny.save_hf(model, cfg, d / "hf", tokenizer_dir=tok)
    del model

    def q4_k_m(name, w):
        if w.shape[-1] % 256:
            return Q.Q8_0
        return Q.Q6_K if any(s in name for s in ("output.", "token_embd", "ffn_down", "attn_v")) else Q.Q4_K

    t = time.perf_counter()
    mlx_lm_convert(str(hf), str(d / "mlx-lm-4bit"), quantize=True, q_bits=4, q_group_size=64)
    times = {"mlx-lm-4bit": time.perf_counter() - t}
    convert_hf_to_gguf(hf, d / "model-Q4_K_M.gguf", q4_k_m)
    t = time.perf_counter()
    try:
        main(["convert", str(d / "model-Q4_K_M.gguf"), str(d / "dflash-from-gguf")])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    times["dflash-from-gguf"] = time.perf_counter() - t
    t = time.perf_counter()
    try:  # everything 4-bit, as mlx-lm's conversion has it
        main(
            [
                "convert",
                str(d / "model-Q4_K_M.gguf"),
                str(d / "dflash-from-gguf-all-4bit"),
                "--bits",
                "Q6_K=4",
                "--bits",
                "Q8_0=4",
            ]
        )
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    times["dflash-from-gguf-all-4bit"] = time.perf_counter() - t
    return times


def child(path: str, tokens: int, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlx_dflash

    t = time.perf_counter()
    eng = mlx_dflash.load(path, dtype=getattr(mx, dtype) if dtype else None)
    load_s = time.perf_counter() - t
    params = dict(tree_flatten(eng.target.model.parameters()))
    weights = sum(v.nbytes for v in params.values())
    load_peak = mx.get_peak_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    res = mlx_dflash.generate(eng, [1, 5, 9, 33, 71, 100, 4, 8], max_tokens=tokens, baseline=True)
    gen_s = time.perf_counter() - t
    dtypes = sorted(
        {str(v.dtype).split(".")[-1] for k, v in params.items() if not k.endswith("weight") or v.dtype != mx.uint32}
    )
    print(
        json.dumps(
            {
                "load_s": load_s,
                "weights_bytes": weights,
                "load_peak": load_peak,
                "gen_peak": mx.get_peak_memory(),
                "tokens": len(res.tokens),
                "dtypes": dtypes,
                "gen_s": gen_s,
                "active": mx.get_active_memory(),
            }
        )
    )


def disk(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the random model")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the random model")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size of the random model")
    ap.add_argument(
        "--tokens", type=int, default=64, help="plain greedy tokens generated per model while measuring peak memory"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.tokens, args.child_dtype)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        times = build(d, args.hidden, args.layers, args.vocab)
        runs = [
            ("mlx-lm-4bit", ""),
            ("dflash-from-gguf", ""),
            ("dflash-from-gguf-all-4bit", ""),
            ("model-Q4_K_M.gguf", ""),
            ("model-Q4_K_M.gguf", "float32"),
        ]
        for name, dt in runs:
            r = subprocess.run(
                [sys.executable, __file__, "--child", str(d / name), "--tokens", str(args.tokens), "--child-dtype", dt],
                capture_output=True,
                text=True,
            )
            if r.returncode:
                sys.exit(r.stderr)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            label = name + (f" (--dtype {dt})" if dt else "")
            rows.append((label, disk(d / name), res, None if dt else times.get(name)))
    gb = 1e6
    lines = [
        "# GGUF Q4_K_M vs mlx-lm 4-bit: memory (Linux CPU, fresh process each)",
        "",
        f"One random bf16 Qwen3.5 ({args.hidden} hidden, {args.layers} layers, vocab {args.vocab}); "
        "`mlx_lm.convert -q` (4-bit, group 64) of the HF folder, and a Q4_K_M GGUF of it (llama.cpp's mix), "
        "loaded directly and after `mlx-dflash convert`. Weights: bytes of the loaded parameters; peaks from "
        f"`mx.get_peak_memory()` during load and during {args.tokens} plain greedy tokens. "
        "`python bench/gguf_memory.py` reproduces it.",
        "",
        "| model | on disk MB | loaded weights MB | float types | load peak MB | generate peak MB | load s "
        "| generate s | convert s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, size, res, conv in rows:
        lines.append(
            f"| {name} | {size / gb:.1f} | {res['weights_bytes'] / gb:.1f} | {', '.join(res['dtypes'])} | "
            f"{res['load_peak'] / gb:.1f} | {res['gen_peak'] / gb:.1f} | {res['load_s']:.2f} | "
            f"{res['gen_s']:.1f} | " + (f"{conv:.1f} |" if conv is not None else "- |")
        )
    lines += [
        "",
        "Reading it: the GGUF path holds more bytes than mlx-lm's 4-bit folder because llama.cpp's Q4_K_M keeps",
        "the embeddings, output, ffn_down and attn_v in Q6_K, which we requantize to MLX 8-bit (5/6/8-bit",
        "sources go to 8 bits, so no precision is lost twice); `--bits Q6_K=4 --bits Q8_0=4` gives",
        "mlx-lm's all-4-bit layout and size. Float types: mlx-lm keeps the checkpoint's bf16; a quantized GGUF",
        "loads as float16 (its block scales are fp16), with A_log in float32 as mlx-lm keeps it. Decoding the",
        "GGUF directly peaks one decoded float32 tensor above the final weights. On this CPU, half precision",
        "decodes some 30x slower than float32 (mlx-lm's bf16 folder is slow too: the CPU backend has no fast",
        "half-precision matmul), so `--dtype float32` is the choice there; the half default is for Apple GPUs.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gguf-memory.md").write_text(text)


if __name__ == "__main__":
    main()
