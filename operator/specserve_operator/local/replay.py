"""`specserve local replay RUN_DIR`: the controller driven again over a run's stored Prometheus data, tick
by tick, printing what it decides and why (docs/local-fleet.md, "Replaying a run").

The run folder keeps what a replay needs: the resource as it ran (status.json, with the decisions that
changed something), its pods (fleet.json) and Prometheus's data (prometheus-data/). A copy of the data is
served by a Prometheus of its own, every query is evaluated at the tick's time, and the controller's
clock is set to it. Nothing is pushed: the metrics are those of the run, so a replay shows what the
controller of this checkout would have decided on them, not how the pods would then have behaved.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from specserve_operator.api.models import SpeculativeServingSpec
from specserve_operator.local.errors import LocalFleetError
from specserve_operator.local.prometheus import PrometheusProcess
from specserve_operator.local.status_file import FLEET_FILE, PROMETHEUS_DATA_DIR, STATUS_FILE
from specserve_operator.tuner import core
from specserve_operator.tuner.loop import FleetController
from specserve_operator.tuner.reader import PrometheusReader


@dataclass(frozen=True)
class RecordedDecision:
    time: float  # Unix seconds
    action: str
    reason: str


@dataclass(frozen=True)
class RecordedRun:
    """What a run folder holds of one `specserve local up` run."""

    view: core.ResourceView
    interval_s: float  # the resource's evaluationInterval
    decisions: tuple[RecordedDecision, ...]
    data_dir: Path


@dataclass(frozen=True)
class ReplayedTick:
    time: float
    decision: core.Decision | None
    error: str | None  # why there is no decision (Prometheus, or a failed decision)
    recorded: RecordedDecision | None  # what the run decided at this tick, where it changed something

    @property
    def action(self) -> str:
        return self.decision.action if self.decision is not None else "error"

    @property
    def notable(self) -> bool:
        """Worth a line without --every-tick: a change, an action other than hold, or a recorded one."""
        d = self.decision
        return d is None or d.changed or d.action != "hold" or self.recorded is not None


def _json(path: Path) -> dict:
    if not path.exists():
        raise LocalFleetError(
            f"{path}: no such file", hint="give a run folder written by `specserve local up`"
        )
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise LocalFleetError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise LocalFleetError(f"{path}: expected an object, got {type(doc).__name__}")
    return doc


def _timestamp(text: object, where: str) -> float:
    try:
        moment = datetime.fromisoformat(str(text))
    except ValueError:
        raise LocalFleetError(f"{where}: {text!r} is not an ISO 8601 time") from None
    # A time without a zone is UTC, as every time the local fleet writes.
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def load_run(run_dir: Path) -> RecordedRun:
    """The run in `run_dir`; a folder that is not a complete run raises LocalFleetError saying what is
    missing or wrong."""
    status = _json(run_dir / STATUS_FILE)
    fleet = _json(run_dir / FLEET_FILE)
    try:
        spec = SpeculativeServingSpec.model_validate(status["spec"])
        meta = status["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
    except (KeyError, TypeError) as exc:
        raise LocalFleetError(f"{run_dir / STATUS_FILE}: no {exc} in it") from None
    except ValidationError as exc:
        raise LocalFleetError(f"{run_dir / STATUS_FILE}: its spec is not valid: {exc}") from None
    pods = fleet.get("pods")
    if not isinstance(pods, dict) or not pods:
        raise LocalFleetError(f"{run_dir / FLEET_FILE}: no pods in it")
    decisions = []
    for i, d in enumerate(status.get("decisions") or []):
        where = f"{run_dir / STATUS_FILE}: decisions[{i}]"
        if not isinstance(d, dict) or "time" not in d or "action" not in d:
            raise LocalFleetError(f"{where}: expected an object with time and action")
        decisions.append(
            RecordedDecision(_timestamp(d["time"], where), str(d["action"]), str(d.get("reason")))
        )
    data_dir = run_dir / PROMETHEUS_DATA_DIR
    if not data_dir.is_dir():
        raise LocalFleetError(f"{data_dir}: no such folder", hint="the run's Prometheus data is needed")
    view = core.ResourceView(namespace, name, spec, tuple(sorted(pods)))
    interval = spec.speculation.evaluation_interval_seconds
    return RecordedRun(view, interval, tuple(sorted(decisions, key=lambda d: d.time)), data_dir)


def tick_times(start: float, end: float, interval_s: float) -> list[float]:
    """Every `interval_s` from `start` up to `end`, both included."""
    if end < start:
        return []
    n = int((end - start) / interval_s + 1e-9)
    return [start + i * interval_s for i in range(n + 1)]


def recorded_at(
    decisions: Sequence[RecordedDecision], t: float, interval_s: float
) -> RecordedDecision | None:
    """The run's decision within half an interval of `t` (the run ticked on its own clock, not on the
    replay's grid); the last of them where there are several."""
    near = [d for d in decisions if t - interval_s / 2 <= d.time < t + interval_s / 2]
    return near[-1] if near else None


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def format_tick(tick: ReplayedTick) -> str:
    """One line per tick (and one more for a recorded decision that differs)."""
    d = tick.decision
    if d is None:
        line = f"{_clock(tick.time)}  {'error':<13} {tick.error}"
    else:
        table = " ".join(f"{b}:{k}" for b, k in d.k_by_bucket.items())
        scores = ", ".join(f"{name} {score:.2f}" for name, score in sorted(d.scores.items()))
        line = f"{_clock(tick.time)}  {d.action:<13} {d.drafter}  K {table}"
        line += f"  scores {scores}" if scores else ""
        line += f"\n          {d.reason}"
    r = tick.recorded
    if r is not None:
        same = "same action" if r.action == tick.action else "a different action"
        line += f"\n          run decided {r.action} ({same}): {r.reason}"
    return line


async def replay(
    run: RecordedRun, prometheus_url: str, times: Sequence[float], window_s: float
) -> AsyncIterator[ReplayedTick]:
    """The controller's tick at each of `times`, over `prometheus_url` evaluated at that time; stops early
    at the first tick with no engine data after ticks that had some (the run ended)."""
    now = [times[0] if times else 0.0]

    def reader(url: str) -> PrometheusReader:
        return PrometheusReader(url, window_s=window_s, evaluation_time=lambda: now[0])

    seen_data = False
    async with aiohttp.ClientSession() as session:
        controller = FleetController(
            prometheus_url, session, window_s=window_s, clock=lambda: now[0], reader_factory=reader
        )
        for t in times:
            now[0] = t
            tick = await controller.decide(run.view)
            d = tick.decision
            if d is not None and d.action == "noData" and seen_data:
                return
            seen_data = seen_data or (d is not None and d.action != "noData")
            error = None if d is not None else str(tick.metrics_error or tick.error)
            yield ReplayedTick(t, d, error, recorded_at(run.decisions, t, run.interval_s))


class StoredPrometheus:
    """A Prometheus serving a copy of a run's data (Prometheus writes to the folder it serves: the run
    folder stays as it was), scraping nothing."""

    def __init__(self, data_dir: Path) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="specserve-replay-"))
        copy = self._tmp / "data"
        shutil.copytree(data_dir, copy, ignore=shutil.ignore_patterns("lock"))
        self.process = PrometheusProcess(data_dir=copy, log_path=self._tmp / "prometheus.log")

    def __enter__(self) -> PrometheusProcess:
        try:
            return self.process.start()
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise

    def __exit__(self, *exc: object) -> None:
        self.process.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)


def replay_range(run: RecordedRun, start: str | None, end: str | None) -> tuple[float, float]:
    """The replay's first and last tick: by default from the run's first recorded decision to an hour
    after its last (the replay stops where the data ends)."""
    if start is None and not run.decisions:
        raise LocalFleetError("the run recorded no decision to start from", hint="give --from")
    first = _timestamp(start, "--from") if start is not None else run.decisions[0].time
    last_decision = run.decisions[-1].time if run.decisions else first
    last = _timestamp(end, "--to") if end is not None else max(first, last_decision) + 3600.0
    if last < first:
        raise LocalFleetError(f"--to ({end}) is before the replay's start ({_clock(first)})")
    return first, last
