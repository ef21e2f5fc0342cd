"""Fixtures of the fault-injection suite (docs/reliability.md): one real Prometheus for the session, a fleet
per scenario (the operator process on kmock, real sidecars, a Prometheus that misbehaves on demand), and a
scenario record that checks for leaks and, with SPECSERVE_FAULTS_RESULTS=path, ends up in that JSON file
(benchmarks/results/faults.json is one such run)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from specserve_operator.local.prometheus import PrometheusProcess
from specserve_testing import fault_fleet as ff
from specserve_testing.kmock_emulator import RVEmulator
from specserve_testing.prometheus import backfill_openmetrics

RESULTS_ENV = "SPECSERVE_FAULTS_RESULTS"
WINDOW_S = 1800.0  # the controller's metrics window: covers the backfilled history for the whole run
# Resources whose pods have a history in the session's Prometheus, and the drafter it was measured with
# (none: the pods of "raise" have only served without speculation so far).
HISTORY = {"llm": "ngram", "other": "ngram", "raise": None}
PODS_PER_RESOURCE = 6

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.faults)


# ---- the summary ------------------------------------------------------------------------------------

_results: dict[str, dict[str, Any]] = {}
_session_started = time.monotonic()


@pytest.fixture
def scenario(request: pytest.FixtureRequest) -> Iterator[ff.Scenario]:
    """Requested after the shared fixtures (engine, Prometheus), so that only what the scenario itself
    starts counts as a leak: every child process, thread and port it used is gone at the end."""
    name = request.node.name.removeprefix("test_")
    record = ff.Scenario(name)
    request.node.fault_scenario = record
    yield record
    leaked = record.leaks.leaks()
    assert leaked == [], f"left behind: {leaked}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    record: ff.Scenario | None = getattr(item, "fault_scenario", None)
    if record is None:
        return
    entry = _results.setdefault(item.nodeid, {"passed": True, "seconds": 0.0})
    entry["name"] = record.name  # a scenario may name itself after its parameter
    entry["seconds"] = round(entry["seconds"] + report.duration, 1)
    if report.failed:
        entry["passed"] = False
        errors = [line[1:].strip() for line in report.longreprtext.splitlines() if line.startswith("E ")]
        entry["failure"] = (errors or [report.longreprtext.strip()])[0][:300]
    if report.when == "teardown":
        entry.update(
            requests=record.requests,
            failedRequests=record.failed_requests,
            recoverySeconds=None if record.recovery_s is None else round(record.recovery_s, 1),
        )
        if record.notes:
            entry["notes"] = record.notes


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path or not _results:
        return
    summary = {
        "command": f"{RESULTS_ENV}={path} python -m pytest -m faults tests/faults",
        "suiteSeconds": round(time.monotonic() - _session_started, 1),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "scenarios": dict(sorted((e.pop("name"), e) for e in _results.values())),
        "allPassed": all(e["passed"] for e in _results.values()),
    }
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")


# ---- the session's real Prometheus --------------------------------------------------------------------


@pytest.fixture(scope="session")
def fleet_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ff.FleetPrometheus]:
    """A real Prometheus holding half an hour of the pods' engine counters (backfilled) and scraping every
    live sidecar each second (its policy, its drafter errors), as the ServiceMonitor would have it."""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        pytest.skip("prometheus and promtool are not installed (scripts/setup.sh installs them)")
    base = tmp_path_factory.mktemp("fleet-prometheus")
    targets = base / "sidecars.json"
    ff.write_targets(targets, [])
    pods = {f"{name}-{i}": drafter for name, drafter in HISTORY.items() for i in range(PODS_PER_RESOURCE)}
    backfill_openmetrics(ff.fleet_history(pods, time.time() - 5, WINDOW_S - 60), base / "data")
    process = PrometheusProcess(scrape_configs=[ff.sidecar_scrape_config(targets)], data_dir=base / "data")
    process.start()
    yield ff.FleetPrometheus(process, targets, WINDOW_S)
    process.stop()


# ---- a fleet per scenario -----------------------------------------------------------------------------


@pytest_asyncio.fixture
async def fleet(
    scenario: ff.Scenario, fleet_prometheus: ff.FleetPrometheus, kube_emulator: RVEmulator, tmp_path: Path
) -> AsyncIterator[ff.Fleet]:
    proxy = await ff.FaultyPrometheus(fleet_prometheus.url).start()
    async with aiohttp.ClientSession() as session:
        fleet = ff.Fleet(kube_emulator, fleet_prometheus, proxy, tmp_path, scenario, session)
        try:
            yield fleet
        finally:
            await fleet.close()
    # the worker threads of this test's event loop go with it, not after the leak check
    await asyncio.get_running_loop().shutdown_default_executor()
