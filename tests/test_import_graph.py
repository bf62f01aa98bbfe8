"""The package's import graph: no cycles, and the Metal launcher knows no op family.

The graph is read from the source with ``ast``, nothing imported. Its edges:
every ``import`` / ``from ... import`` of an mlx_dflash module, at module level
and inside functions alike (a function-level import is still a dependency,
and the usual way a cycle hides). ``from pkg import name`` is an edge to
``pkg.name`` where that is a module, else to ``pkg``. That Python runs a
package's ``__init__`` before its submodules is not an edge (it is where
``mlx_dflash/__init__`` re-exports the API), except in the launcher's closure
below, where ``kernels/__init__`` is followed too.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

PKG = Path(__file__).resolve().parent.parent / "mlx_dflash"
# The public dispatchers of each op family; the launcher must reach none of them.
FAMILY_OPS = {
    "gated_delta_chain",
    "gated_delta_tree",
    "gated_delta_rollback",
    "causal_conv1d_silu",
    "attention",
    "exp_fused",
}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> Set[str]:
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    out.add(f"{target}.{alias.name}")
                elif target in MODULES:
                    out.add(target)
    out.discard(name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _defines(name: str) -> Set[str]:
    tree = ast.parse(MODULES[name].read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_the_graph_reads_the_package():
    # The reader itself: known edges are found, relative and function-level.
    assert "mlx_dflash.kernels.metal" in GRAPH["mlx_dflash.kernels.gated_delta"]
    assert "mlx_dflash.ddtree" in GRAPH["mlx_dflash.kernels.gated_delta"]
    assert "mlx_dflash.api" in GRAPH["mlx_dflash.cli"]  # imported inside a command
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    # Function-level imports count too: the server's app once imported its
    # dialects inside create_app while they imported it (now routes.py does).
    assert _cycles(GRAPH) == []


def test_the_metal_launcher_reaches_no_op_family():
    """Arrows one way: each family hands the launcher its launch and twin; the
    module that runs Metal kernels imports, directly or not, no family."""
    (launcher,) = [m for m in MODULES if "run_metal" in _defines(m)]
    seen, todo = set(), [launcher]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(GRAPH[m])
        parent = m.rpartition(".")[0]
        if parent != "mlx_dflash" and parent in MODULES:  # its package's __init__ runs first
            todo.append(parent)
    reached = {m: _defines(m) & FAMILY_OPS for m in seen}
    assert {m: ops for m, ops in reached.items() if ops} == {}


def _top_level_imports(path: Path) -> Set[str]:
    """The first name of every absolute import in a file (``tools.tiny`` -> ``tools``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.partition(".")[0])
    return out


def test_the_package_imports_nothing_test_only():
    """The wheel holds mlx_dflash alone: no module of it may import the repo's
    tools/ (tiny random models), tests/ or their helpers."""
    root = PKG.parent
    test_only = {"tools", "tests", "conftest", "support"} | {p.stem for p in (root / "tests").glob("*.py")}
    found = {name: _top_level_imports(path) & test_only for name, path in MODULES.items()}
    assert {name: names for name, names in found.items() if names} == {}
    # tools/ and the test helpers exist where this looks (the check is not vacuous)
    assert (root / "tools" / "tiny.py").is_file() and "gguf_writer" in test_only


def test_every_module_serves_the_package():
    """Each module is reached from the entry points (``import mlx_dflash``, the
    CLI): a module only tests or bench/ import (as ``tiny.py`` once was) is
    test-only code in the wheel."""
    seen, todo = set(), ["mlx_dflash", "mlx_dflash.__main__", "mlx_dflash.cli"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(GRAPH[m])
        parent = m.rpartition(".")[0]
        if parent in MODULES:  # importing a submodule runs its package's __init__
            todo.append(parent)
    assert sorted(set(MODULES) - seen) == []


def test_pipeline_modules_import_one_way():
    """plan (costs, the split) and link (the wire) know nothing of stages;
    stage builds on both; none of them reaches back to the engine factory."""
    pipeline = {m for m in MODULES if m.startswith("mlx_dflash.distributed.")}
    assert pipeline == {f"mlx_dflash.distributed.{m}" for m in ("plan", "link", "stage")}
    assert GRAPH["mlx_dflash.distributed.plan"] & pipeline == set()
    assert GRAPH["mlx_dflash.distributed.link"] & pipeline == set()
    assert GRAPH["mlx_dflash.distributed.stage"] & pipeline == pipeline - {"mlx_dflash.distributed.stage"}
    for m in pipeline | {"mlx_dflash.distributed"}:
        assert not GRAPH[m] & {"mlx_dflash.api", "mlx_dflash.cli", "mlx_dflash.server"}, m


def test_one_engine_factory():
    """Only ``api.load`` constructs an Engine: pipeline stages included, there
    is no second way to make one."""
    makers = []
    for name, path in MODULES.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
                if any(getattr(c.func, "id", getattr(c.func, "attr", None)) == "Engine" for c in calls):
                    makers.append(f"{name}.{fn.name}")
    assert makers == ["mlx_dflash.api.load"]
