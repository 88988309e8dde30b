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
