"""The project's docs stand alone: no reference to a design file or a path outside the
repository, and every relative link in the Markdown docs names a file that exists."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("dgt", "scheduler", "transport", "tc_profiles", "tools", "tests", "docs")
OUTSIDE = re.compile(r"DESIGN(\.md|:|,)|/work/|shared/DESIGN|STYLE\.md")


def _files():
    yield ROOT / "README.md"
    for top in SOURCES:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".md", ".lua", ".sh", ".yaml", ".cfg") \
                    and p.name != "test_docs.py":
                yield p


def test_no_reference_outside_the_repository():
    hits = []
    for p in _files():
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_relative_links_in_docs_resolve():
    bad = []
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", p.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (p.parent / target).exists():
                bad.append(f"{p.relative_to(ROOT)} -> {target}")
    assert not bad, "broken links:\n" + "\n".join(bad)


#: `path/to/file.py::Name` or `path/to/file.py::Class.method` in the docs
CODE_REF = re.compile(r"`([\w/]+\.py)::([\w.]+)`")


def _defines(path: Path, dotted: str) -> bool:
    """Whether ``path`` defines ``dotted`` (a function or class, or Class.method),
    read from its AST (nothing is imported)."""
    import ast
    body = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef,
                                                       ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return False
        body = node.body
    return True


def test_every_code_reference_in_the_docs_exists():
    """docs/architecture.md's hop-by-hop map (and any doc) names `file::function`: each
    must still exist, so the map stays true when code moves."""
    bad, seen = [], 0
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path, name in CODE_REF.findall(p.read_text()):
            seen += 1
            f = ROOT / path
            if not f.is_file() or not _defines(f, name):
                bad.append(f"{p.relative_to(ROOT)}: {path}::{name}")
    assert seen >= 20, "the architecture map names no code"
    assert not bad, "names in the docs that the code no longer has:\n" + "\n".join(bad)
