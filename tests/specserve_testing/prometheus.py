"""Fixtures that start real Prometheus processes (Debian's package) on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specserve_operator.local.prometheus import PrometheusProcess, backfill_openmetrics


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[..., PrometheusProcess]]:
    """Start Prometheus processes with the given PrometheusProcess arguments; all stop at teardown.

    `openmetrics=` (text) is backfilled into the data directory before the start."""
    started: list[PrometheusProcess] = []

    def start(openmetrics: str | None = None, **kwargs: object) -> PrometheusProcess:
        data_dir = tmp_path / f"prometheus-{len(started)}"
        if openmetrics is not None:
            backfill_openmetrics(openmetrics, data_dir)
        prom = PrometheusProcess(data_dir=data_dir, **kwargs)  # type: ignore[arg-type]
        started.append(prom)
        return prom.start()

    yield start
    for prom in started:
        prom.stop()
