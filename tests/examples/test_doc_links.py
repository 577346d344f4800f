"""No dangling references in the README and docs/: every relative link, every anchor and
every repository path named in backticks (`sim/cli.py`, `tests/data/`) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "tests" / "data" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
#: Top-level entries of the repository: a backticked path starting with one is ours to check.
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {
    "build", "dist", "out"}
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|DIR|FILE|path/to")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, re.M)}


def prose(path: Path) -> str:
    """The text outside fenced code blocks (commands there are examples, not references)."""
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)


def links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(path))]


def repo_paths(path: Path) -> list[str]:
    found = []
    for code in CODE.findall(prose(path)):
        for token in code.split():
            token = token.strip("',;:()").split(":", 1)[0] if "::" not in token else token
            if "/" not in token or PLACEHOLDER.search(token) or token.startswith(("../", "/")):
                continue
            if token.split("/", 1)[0] in TOP:
                found.append(token)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    if not doc.exists():
        pytest.fail(f"{doc.relative_to(REPO)} is listed but missing")
    bad = []
    for target in links(doc):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, f"{doc.relative_to(REPO)}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_named_repository_paths_exist(doc):
    missing = sorted({p for p in repo_paths(doc) if not (REPO / p.split("::")[0]).exists()})
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_checker_catches_a_dangling_reference(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# Title\nsee [here](nope.md), [there](#title), [gone](#missing)\n"
                   "and `sim/nope.py` and `sim/cli.py` and `tests/data/`\n")
    assert links(doc) == ["nope.md", "#title", "#missing"]
    assert anchors(doc) == {"title"}
    assert repo_paths(doc) == ["sim/nope.py", "sim/cli.py", "tests/data/"]
