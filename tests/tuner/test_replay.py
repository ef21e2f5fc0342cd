"""`specserve local replay`: the controller driven over a run folder's stored Prometheus data, each query
evaluated at the tick's time (a real Prometheus serving a copy of the data, backfilled with promtool)."""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from specserve_operator.cli import build_parser
from specserve_operator.local.errors import LocalFleetError
from specserve_operator.local.replay import (
    RecordedDecision,
    load_run,
    recorded_at,
    replay_range,
    tick_times,
)
from specserve_testing.prometheus import backfill_openmetrics, openmetrics_phases

pytestmark = pytest.mark.prometheus
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="prometheus and promtool are not installed (scripts/setup.sh installs them)",
)
NS, POD = "local", "tiny-0"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _write_run(run: Path, spec_body: dict, decisions: list[dict], openmetrics: str | None) -> Path:
    run.mkdir(parents=True)
    status = {"metadata": {"namespace": NS, "name": "tiny"}, "spec": spec_body, "decisions": decisions}
    (run / "status.json").write_text(json.dumps(status))
    (run / "fleet.json").write_text(json.dumps({"pods": {POD: {}}}))
    if openmetrics is not None:
        backfill_openmetrics(openmetrics, run / "prometheus-data")
    return run


@pytest.fixture
def code_then_prose(rows_for, bucket_load) -> tuple[str, float]:
    """Ten minutes of code-like traffic at batch 1 (the draft model accepts α 0.9 a position), then five of
    prose-like (α 0.3); ends a minute ago. Returns the OpenMetrics text and the time the prose began."""

    def phase(span_s: float, alpha: float) -> list:
        load = bucket_load(
            batch=1, steps_plain=span_s, step_s_plain=0.01, steps_spec=20 * span_s, step_s_spec=0.02, k=4
        )
        return rows_for(NS, POD, "draft", {"1": load}, alphas=(alpha,) * 4, running=1)

    end = time.time() - 60
    prose = end - 300
    return openmetrics_phases(
        [(phase(600, 0.9), prose - 600, prose), (phase(300, 0.3), prose, end)], 5.0
    ), prose


def test_ticks_fall_every_interval_from_the_first_to_the_last() -> None:
    assert tick_times(100.0, 130.0, 10.0) == [100.0, 110.0, 120.0, 130.0]
    assert tick_times(100.0, 129.0, 10.0) == [100.0, 110.0, 120.0]
    assert tick_times(100.0, 99.0, 10.0) == []


def test_a_recorded_decision_belongs_to_the_tick_within_half_an_interval() -> None:
    decisions = [RecordedDecision(103.0, "enable", "a"), RecordedDecision(108.0, "setK", "b")]
    assert recorded_at(decisions, 100.0, 10.0) == decisions[0]
    assert recorded_at(decisions, 110.0, 10.0) == decisions[1]
    assert recorded_at(decisions, 120.0, 10.0) is None


def test_a_folder_that_is_not_a_run_is_refused_with_what_is_missing(
    tmp_path: Path, spec_body_factory, capsys
) -> None:
    args = build_parser().parse_args(["local", "replay", str(tmp_path)])
    assert args.func(args) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "status.json: no such file" in err and "hint: give a run folder" in err
    with pytest.raises(LocalFleetError, match=r"status\.json: no such file"):
        load_run(tmp_path)
    run = _write_run(tmp_path / "run", spec_body_factory(replicas=1), [], None)
    with pytest.raises(LocalFleetError, match="prometheus-data: no such folder"):
        load_run(run)
    (run / "prometheus-data").mkdir()
    with pytest.raises(LocalFleetError, match="recorded no decision"):
        replay_range(load_run(run), None, None)
    assert replay_range(load_run(run), "2026-01-01T00:00:00Z", None)[1] > 0  # --from is enough
    bad = spec_body_factory(replicas=1, speculation={"evaluationInterval": "-5s"})
    with pytest.raises(LocalFleetError, match="its spec is not valid"):
        load_run(_write_run(tmp_path / "bad", bad, [], None))
    late = _write_run(
        tmp_path / "late", spec_body_factory(replicas=1), [{"time": "yesterday", "action": "x"}], None
    )
    with pytest.raises(LocalFleetError, match="'yesterday' is not an ISO 8601 time"):
        load_run(late)


@needs_prometheus
def test_replay_reads_each_tick_at_its_time_and_stops_where_the_data_ends(
    tmp_path: Path, spec_body_factory, code_then_prose, capsys
) -> None:
    """Every tick's queries are evaluated at the tick's time: ticks in the code phase read MAL near
    1 + 0.9 + 0.9² + ..., those in the prose phase near 1.43, where queries at the time of the replay would
    all read the end (or nothing). The replay ends at the first tick without data, a window after the
    data's end; the run's decision at a tick is shown beside the replayed one; the run folder is left as
    it was (Prometheus serves a copy)."""
    text, prose = code_then_prose
    start = prose - 240
    decisions = [{"time": _iso(start + 30), "action": "enable", "reason": "recorded in the run"}]
    run = _write_run(tmp_path / "run", spec_body_factory(replicas=1), decisions, text)
    before = sorted((p.relative_to(run), p.stat().st_size) for p in run.rglob("*"))
    args = build_parser().parse_args(
        ["local", "replay", str(run), "--from", _iso(start), "--controller-window", "60", "--every-tick"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert sorted((p.relative_to(run), p.stat().st_size) for p in run.rglob("*")) == before
    assert "run decided enable" in out and "recorded in the run" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("replayed ") and "the run recorded 1 decisions in that span" in last

    # The same replay through the library, to look at the decisions themselves.
    import asyncio

    from specserve_operator.local.replay import StoredPrometheus, replay

    recorded = load_run(run)
    times = tick_times(start, prose + 3600, recorded.interval_s)

    async def collect() -> list:
        with StoredPrometheus(recorded.data_dir) as prometheus:
            return [t async for t in replay(recorded, prometheus.url, times, 60.0)]

    ticks = asyncio.run(collect())
    mal = {t.time: t.decision.mean_accepted_length for t in ticks if t.decision is not None}
    code = [m for t, m in mal.items() if t <= prose]
    prosey = [m for t, m in mal.items() if prose + 60 <= t <= prose + 300]
    assert code and prosey
    assert all(m == pytest.approx(4.095, abs=0.05) for m in code), code
    assert all(m == pytest.approx(1.43, abs=0.05) for m in prosey), prosey
    assert ticks[-1].time <= prose + 300 + 60 + recorded.interval_s  # a window past the data, no further
    assert len(out.strip().splitlines()) > len(ticks)  # every tick printed (with its reason line)
