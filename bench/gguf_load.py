"""Load time and peak memory of a GGUF target, the largest this machine builds.

    python bench/gguf_load.py [--hidden 2048 --layers 16 --type Q4_0]

Writes a random qwen35 GGUF (an HF folder converted the way llama.cpp's converter
does it, tests/gguf_writer.py),
then loads it in a fresh process and reports wall time and peak RSS next to
the file size and the loaded MLX size. Appends to bench/results/gguf-load.md.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def build(path: Path, hidden: int, layers: int, qtype: str) -> dict:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # gguf_writer; tools/
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import convert_hf_to_gguf

    from tools import tiny

    cfg = tiny.scaled_target_config(hidden, layers, 32000)
    model = tiny.build_target(cfg, seed=0)
    q = getattr(Q, qtype)
    hf = tiny.save_hf(model, cfg, path.parent / "hf")
    del model
    convert_hf_to_gguf(
        hf, path, lambda name, w: Q.Q8_0 if "token_embd" in name or "output." in name else q, tokenizer=False
    )
    return cfg


def _peak_rss_gb() -> float:
    # VmHWM starts afresh at exec; ru_maxrss would carry over the parent's peak.
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1e9 if sys.platform == "darwin" else 1e6)


def child(path: str) -> None:
    import mlx.core as mx
    from mlx_lm.utils import get_total_parameters

    from mlx_dflash.loading.gguf import load_gguf_target

    t = time.perf_counter()
    target, _ = load_gguf_target(path)
    dt = time.perf_counter() - t
    params = get_total_parameters(target.model)
    nbytes = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(target.model.parameters()))
    rss = _peak_rss_gb()
    print(
        json.dumps(
            {
                "seconds": dt,
                "params": params,
                "mlx_bytes": nbytes,
                "peak_rss_gb": rss,
                "mlx_peak_gb": mx.get_peak_memory() / 1e9,
            }
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size of the random target")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers of the random target")
    ap.add_argument(
        "--type",
        default="Q4_0",
        help="GGML type of the weight matrices (a gguf.GGMLQuantizationType name); token embeddings and output: Q8_0",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.gguf"
        t = time.perf_counter()
        build(path, args.hidden, args.layers, args.type)
        print(f"wrote {path.stat().st_size / 1e9:.2f} GB GGUF in {time.perf_counter() - t:.0f}s", flush=True)
        r = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        line = (
            f"| {args.hidden} x {args.layers} layers | {args.type} (+Q8_0 embeddings) | {res['params'] / 1e6:.0f} M | "
            f"{path.stat().st_size / 1e9:.2f} GB | {res['mlx_bytes'] / 1e9:.2f} GB | {res['seconds']:.1f} s | "
            f"{res['peak_rss_gb']:.2f} GB | {res['mlx_peak_gb']:.2f} GB |"
        )
    print(line)
    out = RESULTS / "gguf-load.md"
    if not out.exists():
        out.write_text(
            "# GGUF load: time and peak memory (Linux CPU, fresh process)\n\n"
            "| model | GGUF types | parameters | file | loaded MLX weights | load time | peak RSS | MLX peak |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|\n"
        )
    with open(out, "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
