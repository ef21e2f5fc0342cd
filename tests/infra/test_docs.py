"""The docs stand on their own: every relative link in README.md and docs/ reaches a file (and a heading,
where it names one), and nothing in the repository cites a document that is not in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# The first design of the project lived outside the repository; what the code relies on is in docs/ now.
# Spelled in pieces so that this file does not match itself (and repository checks that grep for such
# citations do not flag the check).
_BLUEPRINT, _SHARED = "DES" + "IGN", "sha" + "red/"
OUTSIDE_CITATIONS = re.compile(rf"{_BLUEPRINT} §|{_BLUEPRINT}'s|\.\./{_SHARED}|/work/{_SHARED[:-1]}")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".json", ".sh", ".txt", ".toml", ""}


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S))
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing_anchor = anchor and linked.suffix == ".md" and anchor not in _anchors(linked)
        if not linked.exists() or missing_anchor:
            broken.append(target)
    assert broken == []


def test_nothing_cites_a_document_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    citing = []
    for name in tracked:
        path = REPO / name
        if name.startswith("models/") or path.suffix not in TEXT_SUFFIXES:
            continue
        if path == Path(__file__) or not path.is_file():
            continue
        if OUTSIDE_CITATIONS.search(path.read_text(errors="replace")):
            citing.append(name)
    assert citing == []
