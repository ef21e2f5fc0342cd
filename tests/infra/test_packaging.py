"""The layout: each top-level folder holds its package under its import name, so nothing in the repository
root shadows the standard library (a folder `operator/` that was itself a package broke `python -m venv`)."""

from __future__ import annotations

import os
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


# The interpreters a fresh machine offers: the base interpreter below the test venv (pyenv's or python.org's),
# a venv's own (as when one is active), and Debian's.
INTERPRETERS = {
    "base interpreter": getattr(sys, "_base_executable", sys.executable),
    "venv interpreter": sys.executable,
    "debian python3": "/usr/bin/python3",
}


def _interpreter(name: str) -> str:
    python = INTERPRETERS[name]
    if not Path(python).exists():
        pytest.skip(f"{python} is not on this machine")
    return python


@pytest.mark.parametrize("name", INTERPRETERS)
def test_venv_from_repository_root(tmp_path: Path, name: str) -> None:
    """Every interpreter creates a venv from the repository root, and that venv and the interpreter itself
    import the standard library's `operator` there."""
    python = _interpreter(name)
    venv = tmp_path / "venv"
    subprocess.run(
        [python, "-m", "venv", "--without-pip", str(venv)], cwd=REPO, capture_output=True, check=True
    )
    _import_stdlib_operator(str(venv / "bin" / "python"))
    _import_stdlib_operator(python)


def _create_venv(venv: Path, python: str, env: dict[str, str] | None = None) -> str:
    """Runs scripts/create_venv.sh from elsewhere (as `make -C` would) and returns what pyvenv.cfg names as
    the venv's interpreter."""
    env = {**os.environ, **(env or {}), "PYTHON": python, "VENV": str(venv)}
    subprocess.run([REPO / "scripts" / "create_venv.sh"], cwd=venv.parent, env=env, check=True)
    subprocess.run([venv / "bin" / "python", "-I", "-m", "pip", "--version"], capture_output=True, check=True)
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines())
    return cfg["executable"]


@pytest.mark.parametrize("name", INTERPRETERS)
def test_setup_creates_the_venv_from_a_base_interpreter(tmp_path: Path, name: str) -> None:
    """scripts/setup.sh's venv step: an active venv's python3 creates the new venv from its base, so .venv
    never hangs off another venv; Debian's and pyenv's python3 serve as they are."""
    python = _interpreter(name)
    base = subprocess.run(
        [python, "-I", "-c", "import sys; print(sys._base_executable)"], capture_output=True, text=True
    ).stdout.strip()
    active = {"VIRTUAL_ENV": sys.prefix, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    made_with = _create_venv(tmp_path / "venv", python, active if name == "venv interpreter" else None)
    assert Path(made_with).resolve() == Path(base).resolve()
    assert not Path(made_with).is_relative_to(sys.prefix)


def test_setup_replaces_a_half_made_venv(tmp_path: Path) -> None:
    """A venv left without pip (Debian's python3 without python3-venv fails half-way) is made again, and a
    second run keeps what is there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _create_venv(venv, sys.executable)
    marker = venv / "kept"
    marker.touch()
    _create_venv(venv, sys.executable)
    assert marker.exists()
