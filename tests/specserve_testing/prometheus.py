"""Fixtures that start real Prometheus processes (Debian's package) on 127.0.0.1."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specserve_operator.local.prometheus import PrometheusError, PrometheusProcess, require_binary


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


def backfill_openmetrics(openmetrics: str, data_dir: Path) -> None:
    """Write OpenMetrics samples (ending with `# EOF`) into TSDB blocks that a Prometheus on `data_dir`
    serves: deterministic history for tests, with `promtool tsdb create-blocks-from openmetrics`."""
    promtool = require_binary("promtool")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".om", delete=False) as f:
        f.write(openmetrics if openmetrics.rstrip().endswith("# EOF") else openmetrics.rstrip() + "\n# EOF\n")
        src = f.name
    try:
        result = subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", src, str(data_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise PrometheusError(f"promtool backfill failed: {result.stderr or result.stdout}")
    finally:
        Path(src).unlink(missing_ok=True)
