"""Execute Metal kernel bodies (mx.fast.metal_kernel sources) on a CPU.

The body is wrapped into a C++ function with the same names MLX binds
(inputs, outputs, template constants, thread attributes), compiled with the
system C++ compiler against ``metal_compat.h``, and run over the whole grid:
each threadgroup's threads are cooperative fibers that really meet at
barriers and SIMD-group operations, run in the order ``order`` names:
"forward" (thread index order), "reverse", or "random:SEED" (a new
permutation at every pass). Inputs and outputs travel as raw files.

    outs = run(gated_delta.chain_launch(...))   # same Launch the real dispatch uses
    outs = run(launch, order="reverse")
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List

import mlx.core as mx
import numpy as np

HERE = Path(__file__).parent
CACHE = Path(tempfile.gettempdir()) / "mlx_dflash_metal_harness"

CTYPES = {
    mx.float32: "float",
    mx.float16: "half",
    mx.bfloat16: "bfloat",
    mx.int32: "int",
    mx.uint32: "uint",
    mx.bool_: "bool",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
}
RAW = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16}  # how a dtype travels as bytes

ATTRS = """uint3 thread_position_in_grid, uint3 thread_position_in_threadgroup,
    uint3 threadgroup_position_in_grid, uint3 threads_per_threadgroup, uint3 threadgroups_per_grid,
    uint thread_index_in_threadgroup, uint thread_index_in_simdgroup, uint simdgroup_index_in_threadgroup"""


def compiler() -> str:
    for c in ("c++", "g++", "clang++"):
        if shutil.which(c):
            return c
    raise RuntimeError("no C++ compiler found")


def _to_bytes(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    if a.dtype in RAW:
        a = a.view(RAW[a.dtype])
    mx.eval(a)
    return np.array(a).tobytes()


def _from_bytes(raw: bytes, shape, dtype) -> mx.array:
    if dtype in RAW:
        return mx.array(np.frombuffer(raw, np.uint16).reshape(shape)).view(dtype)
    np_dtype = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32, mx.bool_: np.bool_}[dtype]
    return mx.array(np.frombuffer(raw, np_dtype).reshape(shape))


def generate(source: str, launch) -> str:
    """The C++ translation unit for one kernel instantiation. Only the source,
    the template and the input dtypes are compiled in: scalar inputs, output
    sizes, grid and threadgroup come on the command line, so launches that
    differ in T alone share one build."""
    consts = []
    for name, value in launch.template:
        if isinstance(value, mx.Dtype):
            consts.append(f"using {name} = {CTYPES[value]};")
        elif isinstance(value, bool):
            consts.append(f"constexpr bool {name} = {'true' if value else 'false'};")
        else:
            consts.append(f"constexpr int {name} = {int(value)};")
    params, args, loads = [], [], []
    for i, (name, a) in enumerate(launch.inputs):
        if isinstance(a, mx.array):
            ct = CTYPES[a.dtype]
            params.append(f"const device {ct}* {name}")
            args.append(f"reinterpret_cast<const {ct}*>(g_in[{i}].data())")
        else:
            ct = "bool" if isinstance(a, bool) else "int"
            params.append(f"const {ct} {name}")
            args.append(f"{ct}(*reinterpret_cast<const int32_t*>(g_in[{i}].data()))")
        loads.append(f"  g_in[{i}] = read_file(argv[{i + 8}]);")
    n_in = len(launch.inputs)
    stores = []
    for j, (name, _shape, dtype) in enumerate(launch.outputs):
        ct = CTYPES[dtype]
        params.append(f"device {ct}* {name}")
        args.append(f"reinterpret_cast<{ct}*>(g_out[{j}].data())")
        # 0xff bytes: NaN for floats, so an element the kernel never writes shows.
        loads.append(f"  g_out[{j}].assign(std::strtoull(argv[{n_in + 9 + 2 * j}], nullptr, 10), char(0xff));")
        stores.append(f"  write_file(argv[{n_in + 8 + 2 * j}], g_out[{j}]);")
    nl = "\n"
    return f"""#include "metal_compat.h"
{nl.join(consts)}

static void kernel_body({", ".join(params)},
    {ATTRS}) {{
  (void)thread_position_in_grid; (void)thread_position_in_threadgroup;
  (void)threadgroup_position_in_grid; (void)threads_per_threadgroup; (void)threadgroups_per_grid;
  (void)thread_index_in_threadgroup; (void)thread_index_in_simdgroup; (void)simdgroup_index_in_threadgroup;
{source}
}}

static std::vector<char> read_file(const char* path) {{
  FILE* f = std::fopen(path, "rb");
  if (!f) {{ std::perror(path); std::exit(2); }}
  std::fseek(f, 0, SEEK_END);
  long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<char> buf(n);
  if (n && std::fread(buf.data(), 1, n, f) != size_t(n)) std::exit(2);
  std::fclose(f);
  return buf;
}}

static void write_file(const char* path, const std::vector<char>& buf) {{
  FILE* f = std::fopen(path, "wb");
  std::fwrite(buf.data(), 1, buf.size(), f);
  std::fclose(f);
}}

static std::vector<char> g_in[{max(n_in, 1)}], g_out[{max(len(launch.outputs), 1)}];

static void thread_main(const harness::Thread& t) {{
  kernel_body({", ".join(args)},
              t.pos, t.local, t.group, t.tg, t.groups, t.linear, t.linear % 32, t.linear / 32);
}}

int main(int argc, char** argv) {{
  (void)argc;
  const char* order = argv[1];  // forward | reverse | random:SEED
  if (std::strcmp(order, "reverse") == 0) harness::order().mode = 1;
  if (std::strncmp(order, "random:", 7) == 0) {{
    harness::order().mode = 2;
    harness::order().rng.seed(unsigned(std::atoi(order + 7)));
  }}
{nl.join(loads)}
  uint d[6];  // grid x, y, z and threadgroup x, y, z
  for (int i = 0; i < 6; ++i) d[i] = uint(std::atoi(argv[2 + i]));
  harness::dispatch({{d[0], d[1], d[2]}}, {{d[3], d[4], d[5]}}, thread_main);
{nl.join(stores)}
  return 0;
}}
"""


FLAGS = ["-std=c++17", "-O1", "-w"]


def _header_dir() -> Path:
    """A folder holding metal_compat.h, precompiled when the compiler is GCC
    (most of a kernel's build time is the header's standard includes)."""
    header = (HERE / "metal_compat.h").read_text()
    d = CACHE / ("h_" + hashlib.sha256((header + " ".join(FLAGS)).encode()).hexdigest()[:16])
    if not (d / "metal_compat.h").exists():
        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        (tmp / "metal_compat.h").write_text(header)
        version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout
        if "Free Software Foundation" in version:  # GCC finds metal_compat.h.gch beside the header
            subprocess.run(
                [
                    compiler(),
                    *FLAGS,
                    "-x",
                    "c++-header",
                    str(tmp / "metal_compat.h"),
                    "-o",
                    str(tmp / "metal_compat.h.gch"),
                ],
                capture_output=True,
            )
        try:
            os.replace(tmp, d)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def build(source: str, launch) -> Path:
    code = generate(source, launch)
    key = hashlib.sha256((code + (HERE / "metal_compat.h").read_text()).encode()).hexdigest()[:20]
    CACHE.mkdir(parents=True, exist_ok=True)
    exe = CACHE / f"k_{key}"
    if not exe.exists():
        src = CACHE / f"k_{key}.cpp"
        src.write_text(code)
        r = subprocess.run(
            [compiler(), *FLAGS, f"-I{_header_dir()}", str(src), "-o", str(exe) + ".tmp"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"kernel {launch.name} does not compile:\n{r.stderr[-4000:]}")
        os.replace(str(exe) + ".tmp", exe)
    return exe


ORDERS = ("forward", "reverse", "random:1", "random:2")


def run(launch, source: str = None, order: str = "forward") -> List[mx.array]:
    """Run ``launch`` (a metal.Launch) with ``source`` (default: its .metal file),
    threads taking turns in ``order``."""
    from mlx_dflash.kernels.metal import metal_source

    source = source if source is not None else metal_source(launch.name)
    exe = build(source, launch)
    with tempfile.TemporaryDirectory() as d:
        files = []
        for i, (_name, a) in enumerate(launch.inputs):
            p = Path(d) / f"in{i}"
            p.write_bytes(_to_bytes(a) if isinstance(a, mx.array) else np.int32(int(a)).tobytes())
            files.append(str(p))
        outs = [str(Path(d) / f"out{j}") for j in range(len(launch.outputs))]
        sizes = [str(dtype.size * int(np.prod(shape))) for _, shape, dtype in launch.outputs]
        dims = [str(int(x)) for x in (*launch.grid, *launch.threadgroup)]
        out_args = [x for pair in zip(outs, sizes) for x in pair]
        r = subprocess.run([str(exe), order, *dims, *files, *out_args], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"kernel {launch.name} failed ({r.returncode}): {r.stderr[-2000:]}")
        return [_from_bytes(Path(o).read_bytes(), shape, dtype) for o, (_, shape, dtype) in zip(outs, launch.outputs)]
