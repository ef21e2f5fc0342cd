"""docs/images/architecture.png is drawn from the code's real modules: every file the picture names exists,
so moving a module fails here until scripts/draw_architecture.py (and the picture) follow it."""

from __future__ import annotations

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(REPO / "scripts" / "draw_architecture.py"))


def test_every_module_the_picture_names_exists() -> None:
    paths = SCRIPT["repository_paths"]()
    assert paths, "the picture names no module"
    assert [p for p in paths if not (REPO / p).is_file()] == []


def test_the_picture_is_drawn_and_linked_from_the_architecture_page(tmp_path: Path) -> None:
    drawn = SCRIPT["draw"](tmp_path / "architecture.png")
    assert drawn.read_bytes().startswith(b"\x89PNG")
    assert (REPO / "docs" / "images" / "architecture.png").is_file()
    page = (REPO / "docs" / "architecture.md").read_text()
    assert "](images/architecture.png)" in page.split("\n## ", 1)[0]
