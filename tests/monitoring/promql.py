"""Shared by the rule, dashboard and chart tests: where the chart keeps its monitoring files, PromQL metric
names, promtool. Imported as `monitoring.promql` (tests/ is on the path)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART_FILES = REPO / "charts" / "specserve" / "files"
RULES_FILE = CHART_FILES / "rules.yaml"
DASHBOARDS = sorted((CHART_FILES / "dashboards").glob("*.json"))
RUNBOOK = REPO / "docs" / "runbook.md"

# Words of PromQL that look like metric names but are not.
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
    | {"inf", "nan", "atan2"}
)
_IDENT = re.compile(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and label names left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery windows
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for match in _IDENT.finditer(text):
        followed_by = text[match.end() :].lstrip()[:1]
        if followed_by != "(" and match.group(0).lower() not in _KEYWORDS:
            names.add(match.group(0))
    return names


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *map(str, args)], capture_output=True, text=True, check=False)
