"""Fixtures that start real Prometheus processes (Debian's package) on 127.0.0.1, and the history they
hold: the reader's rows written as OpenMetrics counters, backfilled with promtool."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specserve_engine import metric_names
from specserve_operator.local.prometheus import PrometheusError, PrometheusProcess, require_binary
from specserve_operator.tuner import observations


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


# Row kind → (metric series, label names kept) for writing rows as Prometheus counters.
_STEP_LABELS = ("bucket", "speculating", "drafter", "k")
_POSITION_LABELS = ("drafter", "position")
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    observations.STEPS: (metric_names.ENGINE_STEPS.series[0], _STEP_LABELS),
    observations.STEP_SECONDS: (metric_names.ENGINE_STEP_SECONDS.series[0], _STEP_LABELS),
    observations.TOKENS: (metric_names.ENGINE_GENERATED_TOKENS.series[0], _STEP_LABELS),
    observations.DRAFTS: (metric_names.SPEC_DRAFTS.series[0], ("bucket", "drafter")),
    observations.DRAFT_TOKENS: (metric_names.SPEC_DRAFT_TOKENS.series[0], ("bucket", "drafter")),
    observations.ACCEPTED: (metric_names.SPEC_ACCEPTED_TOKENS.series[0], ("bucket", "drafter")),
    observations.ACCEPTED_POS: (metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION.series[0], _POSITION_LABELS),
    observations.PROPOSED_POS: (metric_names.SPEC_DRAFT_TOKENS_PER_POSITION.series[0], _POSITION_LABELS),
    observations.SHADOW_ACCEPTED_POS: (metric_names.SIDECAR_SHADOW_ACCEPTED.series[0], _POSITION_LABELS),
    observations.SHADOW_PROPOSED_POS: (metric_names.SIDECAR_SHADOW_PROPOSED.series[0], _POSITION_LABELS),
    observations.SHADOW_ROWS: (metric_names.SIDECAR_SHADOW_ROWS.series[0], ("drafter",)),
}


def openmetrics(rows: list[observations.Row], start_s: float, end_s: float, step_s: float = 15.0) -> str:
    """Rows as counters rising linearly from 0 at `start_s` to their value at `end_s` (the increase over
    that span is the row's value), gauges held constant; OpenMetrics text for promtool's backfill."""
    return openmetrics_phases([(rows, start_s, end_s)], step_s)


def openmetrics_phases(
    phases: list[tuple[list[observations.Row], float, float]], step_s: float = 15.0
) -> str:
    """Like `openmetrics`, over consecutive spans each with its own rows: within a span a counter rises
    linearly by that span's value, carrying on from where the spans before left it (a traffic change);
    a gauge holds each span's value."""
    families: dict[str, list[str]] = {}
    types: dict[str, str] = {}
    totals: dict[str, float] = {}  # series → the counter's value where the last span ended
    for rows, start_s, end_s in phases:
        n = int((end_s - start_s) // step_s)
        for kind, labels, value in rows:
            extra = {}
            if kind in SERIES:
                series, keep = SERIES[kind]
                family, mtype = series.removesuffix("_total"), "counter"
                extra = {k: labels[k] for k in keep if k in labels}
            elif kind == observations.POLICY_INFO:
                series = family = metric_names.SIDECAR_POLICY_INFO.name
                mtype = "gauge"
                extra = {k: labels[k] for k in ("drafter", "mode", "policy_version")}
            elif kind == observations.RUNNING:
                series = family = metric_names.VLLM_REQUESTS_RUNNING
                mtype = "gauge"
            else:
                continue
            types[family] = mtype
            lab = {"namespace": labels["namespace"], "pod": labels["pod"], **extra}
            text = ",".join(f'{k}="{v}"' for k, v in sorted(lab.items()))
            name = f"{series}{{{text}}}"
            # A later span starts one step in: its first sample would repeat the span before's last time.
            first, base = (1, totals[name]) if name in totals else (0, 0.0)
            lines = families.setdefault(family, [])
            for i in range(first, n + 1):
                t = start_s + i * step_s
                v = base + value * i / n if mtype == "counter" else value
                lines.append(f"{name} {v:.6f} {t:.3f}")
            totals[name] = base + value if mtype == "counter" else 0.0
    out = []
    for family, lines in families.items():
        out.append(f"# TYPE {family} {types[family]}")
        # OpenMetrics wants each series' samples in time order; group them by series.
        out.extend(sorted(lines, key=lambda line: (line.rsplit(" ", 2)[0], float(line.rsplit(" ", 1)[1]))))
    out.append("# EOF")
    return "\n".join(out) + "\n"
