"""The layout: each top-level folder holds its package under its import name, so nothing in the repository
root shadows the standard library (a folder `operator/` that was itself a package broke `python -m venv`)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = {"operator": "specserve_operator", "engine_sidecar": "specserve_engine"}


def test_package_folders_hold_one_package_named_for_its_import() -> None:
    for folder, import_name in PACKAGE_FOLDERS.items():
        assert not (REPO / folder / "__init__.py").exists(), f"{folder}/ must not itself be a package"
        packages = [p for p in (REPO / folder).iterdir() if (p / "__init__.py").exists()]
        assert [p.name for p in packages] == [import_name]


def test_pyproject_finds_every_subpackage() -> None:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert sorted(find["where"]) == sorted(PACKAGE_FOLDERS)
    found = {
        name
        for where in find["where"]
        for name in setuptools.find_packages(str(REPO / where), include=find["include"])
    }
    on_disk = {
        ".".join(init.parent.relative_to(REPO / folder).parts)
        for folder in PACKAGE_FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert found == on_disk


def _import_stdlib_operator(python: str) -> None:
    """From the repository root, with nothing imported early, the standard library's `operator` wins."""
    code = "import operator, runpy; operator.eq; print(operator.__file__)"
    out = subprocess.run(
        [python, "-I", "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert not out.strip().startswith(str(REPO)), out
    # `-m` puts the working directory first on sys.path: the case that used to break.
    subprocess.run(
        [python, "-m", "json.tool", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    )


@pytest.mark.parametrize("base", ["test interpreter", "venv interpreter"])
def test_venv_from_repository_root(tmp_path: Path, base: str) -> None:
    """(a) the interpreter running the tests and (c) an already active venv's interpreter both create a
    venv from the repository root, and that venv imports the standard library's `operator`."""
    python = sys.executable if base == "test interpreter" else str(Path(sys.prefix) / "bin" / "python")
    venv = tmp_path / "venv"
    subprocess.run(
        [python, "-m", "venv", "--without-pip", str(venv)], cwd=REPO, capture_output=True, check=True
    )
    _import_stdlib_operator(str(venv / "bin" / "python"))
    _import_stdlib_operator(python)
