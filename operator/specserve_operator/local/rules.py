"""The chart's Prometheus rule files (recording and alert rules), reused by the local fleet's Prometheus.

Only files that `promtool check rules` accepts are used: a file that is a Helm template, or not a rule
file at all, would stop Prometheus from starting. Without any, the controller reads the raw counters.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def usable_rule_files(folder: Path) -> list[Path]:
    promtool = shutil.which("promtool")
    if promtool is None or not folder.is_dir():
        return []
    out = []
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        result = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False, timeout=30
        )
        if result.returncode == 0:
            out.append(path)
    return out
