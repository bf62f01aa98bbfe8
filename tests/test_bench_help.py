"""Every flag of the bench/ and tools/ scripts explains itself in --help (checked by parsing, not running them)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_flag_has_help():
    files = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("tools/*.py")])
    assert files
    missing = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "add_argument":
                continue
            h = next((k.value for k in node.keywords if k.arg == "help"), None)
            # A constant must be a non-empty string; an expression (argparse.SUPPRESS, an f-string) passes.
            if h is None or (isinstance(h, ast.Constant) and not (isinstance(h.value, str) and h.value.strip())):
                missing.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not missing, "add_argument without help=: " + ", ".join(missing)
