"""Runs the real helm binary (scripts/setup.sh puts it in .cache/bin; tests/conftest.py puts that on PATH)
on the chart. Imported as `chart.helm` (tests/ is on the path)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "specserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
MONITORING_API = ("--api-versions", "monitoring.coreos.com/v1")


class HelmError(RuntimeError):
    pass


def helm(*args: str | Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("helm")
    if binary is None:
        raise HelmError("helm is not on PATH: run scripts/setup.sh (it installs .cache/bin/helm)")
    return subprocess.run([binary, *map(str, args)], capture_output=True, text=True, check=False)


def render(
    *args: str | Path, values: Sequence[Path] = (), namespace: str = "specserve", release: str = "specserve"
) -> list[dict]:
    """`helm template` into a list of objects (CRDs from crds/ included); raises HelmError on failure."""
    flags: list[str | Path] = []
    for path in values:
        flags += ["-f", path]
    result = helm("template", release, CHART, "--namespace", namespace, "--include-crds", *flags, *args)
    if result.returncode != 0:
        raise HelmError(result.stderr.strip())
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
