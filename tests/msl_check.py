"""A strict Metal Shading Language check that runs on Linux.

``capture(launch)`` traces the real dispatch of a kernel (metal.run_metal,
i.e. ``mx.fast.metal_kernel``) with ``mx.export_function``: MLX builds, on
any backend, the full source it would hand to the Metal compiler (the
``[[kernel]]`` signature with each input's address space, template
parameters, the body and the explicit instantiation) and stores it in the
exported file, from which it is read back. ``check(source)`` compiles that
source with clang (the ``libclang`` wheel) as C++14 without extensions
against msl_strict.h, where device/constant/threadgroup are distinct address
spaces and double, std::, VLAs and exceptions do not exist, and rejects
recursion from the AST and more than 31 buffer arguments. Returns the
list of problems (empty: passes).

MLX compiles the source after its own prelude (metal_stdlib and its
utilities); msl_strict.h stands in for those. The one edit made to the
captured text: the attribute lists on the explicit instantiation
(``template [[host_name(..)]] [[kernel]] decltype(..)``), which only the
Metal compiler accepts, are dropped after checking that host_name names the
kernel.
"""

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import List

import mlx.core as mx

from mlx_dflash.kernels import metal

HERE = Path(__file__).parent
ARGS = [
    "-x",
    "c++",
    "-std=c++14",
    "-pedantic-errors",
    "-fno-exceptions",
    "-fno-rtti",
    "-nostdinc",
    "-nostdinc++",
    "-Werror=vla",
    "-Wno-unknown-attributes",
    "-Wno-unused-value",
]


def capture(launch) -> str:
    """The Metal source MLX generates for ``launch`` (a metal.Launch)."""
    arrays = [a for _, a in launch.inputs if isinstance(a, mx.array)]

    def dispatch(*xs):
        it = iter(xs)
        inputs = [(n, next(it) if isinstance(a, mx.array) else a) for n, a in launch.inputs]
        return metal.run_metal(dataclasses.replace(launch, inputs=inputs))

    return capture_fn(dispatch, arrays)


def capture_fn(fn, arrays) -> str:
    """The Metal source of the (one) metal_kernel call in ``fn(*arrays)``."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.mlxfn"
        mx.export_function(str(path), fn, *arrays)
        data = path.read_bytes()
    # Strings are stored as a little-endian uint64 length and the bytes.
    at = data.find(b"[[kernel]] void ")
    if at < 0:
        raise RuntimeError("no kernel source in the exported function")
    for start in (data.rfind(b"template <", 0, at), at):
        if start >= 8:
            n = int.from_bytes(data[start - 8 : start], "little")
            if start + n <= len(data) and b"[[kernel]]" in data[start : start + n]:
                return data[start : start + n].decode()
    raise RuntimeError("could not delimit the kernel source in the exported function")


INSTANTIATION = re.compile(r'template \[\[host_name\("(\w+)"\)\]\] \[\[kernel\]\] decltype\((\w+)<')


def _strip_instantiation(source: str) -> str:
    m = INSTANTIATION.search(source)
    if m is None:
        if "[[host_name(" in source:
            raise RuntimeError("unrecognised explicit instantiation in the kernel source")
        return source  # a kernel without template parameters is not a template
    if m.group(1) != m.group(2):
        raise RuntimeError(f"host_name {m.group(1)} is not the kernel {m.group(2)}")
    return source[: m.start()] + "template decltype(" + m.group(2) + "<" + source[m.end() :]


def _recursion(tu, main: str) -> List[str]:
    from clang.cindex import CursorKind

    funcs = {CursorKind.FUNCTION_DECL, CursorKind.FUNCTION_TEMPLATE, CursorKind.CXX_METHOD, CursorKind.LAMBDA_EXPR}
    calls = {}

    def key(c):
        return c.canonical.get_usr() or f"{c.spelling}@{c.location.line}"

    def walk(node, owner):
        for ch in node.get_children():
            if ch.location.file is not None and ch.location.file.name != main:
                continue
            if ch.kind in funcs:
                k = key(ch)
                calls.setdefault(k, set())
                walk(ch, k)
                continue
            if ch.kind == CursorKind.CALL_EXPR and owner and ch.referenced is not None and ch.referenced.kind in funcs:
                calls[owner].add(key(ch.referenced))
            walk(ch, owner)

    walk(tu.cursor, None)
    problems, state = [], {}

    def visit(k, stack):
        state[k] = 1
        for c in calls.get(k, ()):
            if state.get(c) == 1:
                problems.append("recursion (MSL has none): " + " -> ".join(stack + [c]))
            elif c not in state:
                visit(c, stack + [c])
        state[k] = 2

    for k in list(calls):
        if k not in state:
            visit(k, [k])
    return problems


def check(source: str) -> List[str]:
    """Problems clang finds in ``source`` (a captured kernel) under MSL rules."""
    from clang.cindex import Diagnostic, Index

    buffers = [int(b) for b in re.findall(r"\[\[buffer\((\d+)\)\]\]", source)]
    if buffers and max(buffers) > 30:
        return [f"{max(buffers) + 1} buffer arguments (Metal binds at most 31)"]
    text = '#include "msl_strict.h"\n' + _strip_instantiation(source)
    with tempfile.TemporaryDirectory() as d:
        main = str(Path(d) / "kernel.cpp")
        Path(main).write_text(text)
        tu = Index.create().parse(main, args=ARGS + [f"-I{HERE}"])
        problems = [
            f"line {x.location.line - 1}: {x.spelling}" for x in tu.diagnostics if x.severity >= Diagnostic.Error
        ]
        if not problems:
            problems = _recursion(tu, main)
    return problems
