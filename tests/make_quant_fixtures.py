"""Make the quantized GGUF fixtures in tests/data with llama.cpp's own quantizer.

The F32 source is a tiny seeded qwen35 model converted by tests/gguf_writer.py
(the stand-in for llama.cpp's converter); :func:`source_gguf` rebuilds it
bit for bit, so only the quantized files are committed. Quantizing needs
llama-cpp-python, which may live in another environment:

    python tests/make_quant_fixtures.py --llama-python /work/llamavenv/bin/python

writes tests/data/tiny-qwen35-{Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K}.gguf (see tests/data/README.md),
then checks, in that Python (which then also needs numpy and gguf), that
llama.cpp's own dequantization of every tensor equals gguf-py's.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SEED = 23
# hidden and FFN sizes are multiples of 256 so K-quants apply; the DeltaNet
# output and attention output projections (input 128) are not, so llama.cpp
# gives them its fallback types (Q5_0, Q5_1, Q8_0), which are covered too.
CONFIG = dict(
    vocab_size=320,
    hidden_size=256,
    num_hidden_layers=2,
    full_attention_interval=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)
# name -> (llama_ftype value, pure): Q4_0 is quantized "pure" (llama.cpp would
# otherwise store output.weight as Q6_K), so that one file is Q4_0 throughout.
FTYPES = {"Q8_0": (7, False), "Q4_0": (2, True), "Q4_K_M": (15, False), "Q5_K_M": (17, False), "Q6_K": (18, False)}


def fixture(name: str) -> Path:
    return DATA / f"tiny-qwen35-{name}.gguf"


def source_gguf(out_dir) -> Path:
    """The unquantized F32 GGUF every fixture was quantized from."""
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # gguf_writer; tools/ at the repo root
    from gguf_writer import convert_hf_to_gguf

    from tools import tiny

    out_dir = Path(out_dir)
    cfg = tiny.target_config(**CONFIG)
    tok = tiny.build_tokenizer(out_dir / "tok", vocab_size=300)
    hf = tiny.save_hf(tiny.build_target(cfg, seed=SEED), cfg, out_dir / "hf", tokenizer_dir=tok)
    return convert_hf_to_gguf(hf, out_dir / "tiny-qwen35-F32.gguf")


QUANTIZE = """
import sys, llama_cpp
src, dst, ftype, pure = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.pure, p.nthread = ftype, pure, 1
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(rc)
"""

# In the same Python: llama.cpp's own dequantization (ggml's to_float) of every
# quantized tensor must equal gguf-py's, the reference the tests compare with.
CHECK = """
import ctypes, os, sys
import llama_cpp
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.llama_cpp._lib._name), "libggml-base.so"))

class Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]

lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)
same = n = 0
for path in sys.argv[1:]:
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        raw = np.ascontiguousarray(np.asarray(t.data).view(np.uint8))
        out = np.empty(int(t.n_elements), np.float32)
        to_float(lib.ggml_get_type_traits(int(t.tensor_type)).contents.to_float)(
            raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        want = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
        n += 1
        same += bool(np.array_equal(out.view(np.uint32), want.view(np.uint32)))
print(f"{same}/{n} quantized tensors: llama.cpp's dequantization equals gguf-py's bit for bit")
sys.exit(same != n)
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--llama-python", default=sys.executable, help="a Python where llama_cpp (llama-cpp-python) imports"
    )
    a = ap.parse_args(argv)
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = source_gguf(tmp)
        for name, (ftype, pure) in FTYPES.items():
            subprocess.run(
                [a.llama_python, "-c", QUANTIZE, str(src), str(fixture(name)), str(ftype), "1" if pure else "0"],
                check=True,
            )
            print(f"wrote {fixture(name)} ({fixture(name).stat().st_size / 1e6:.2f} MB)")
    subprocess.run([a.llama_python, "-c", CHECK] + [str(fixture(n)) for n in FTYPES], check=True)


if __name__ == "__main__":
    main()
