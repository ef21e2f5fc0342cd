"""docs/metrics.md documents every metric and recording rule that specserve defines."""

from __future__ import annotations

from pathlib import Path

from specserve_engine import metric_names

DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()


def test_every_metric_is_documented() -> None:
    exported = [m.series[0] if m.type == "counter" else m.name for m in metric_names.SPECSERVE_METRICS]
    missing = [name for name in (*exported, *metric_names.RECORDING_RULES) if f"`{name}`" not in DOC]
    assert missing == []


def test_metric_names_are_unique_and_unprefixed() -> None:
    names = [m.name for m in metric_names.SPECSERVE_METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("specserve_") for n in names)
