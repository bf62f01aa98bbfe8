"""The docs stay short and their citations resolve.

README.md at most 260 lines; every relative link (and its #anchor) in README.md
and docs/*.md points at something that exists; every bench/results/ path named
in the docs or in the code exists; every result in bench/results/ is cited from
README.md or docs/, and there is one file per benchmark (no re-run copies:
git keeps the history).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Written only on Apple silicon (bench/mac_check.py); cited so Mac owners know where it lands.
NOT_YET_RUN = {"bench/results/mac-check.json"}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
RESULT_PATH = re.compile(r"bench/results/([\w.-]+)(\{[\w,]+\})?(<)?")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def slug(heading):
    """GitHub's anchor for a heading."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def cited_results(text):
    """bench/results/ paths a text names, braces expanded, templated names (NAME-<x>) skipped."""
    out = set()
    for m in RESULT_PATH.finditer(text):
        name, braces, template = m.groups()
        if template or name.endswith("-"):
            continue
        if braces:
            out |= {f"bench/results/{name}{ext}" for ext in braces.strip("{}").split(",")}
        else:
            out.add(f"bench/results/{name.rstrip('.')}")
    return out


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 260, f"README.md has {lines} lines; depth goes in docs/"


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_cited_results_exist():
    sources = DOCS + sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "mlx_dflash").rglob("*.py"))
    missing = []
    for src in sources:
        for path in sorted(cited_results(src.read_text()) - NOT_YET_RUN):
            if not (ROOT / path).is_file():
                missing.append(f"{src.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_every_result_is_cited_once_per_benchmark():
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    reruns = [f for f in files if re.search(r"-(rerun|run\d+)\.", f)]
    assert not reruns, f"re-runs in bench/results (keep the latest as the plain name): {reruns}"
    cited = set()
    for doc in DOCS:
        cited |= {Path(p).stem for p in cited_results(doc.read_text())}
    uncited = [f for f in files if Path(f).stem not in cited]
    assert not uncited, f"results cited from neither README.md nor docs/: {uncited}"
