"""`specserve status --local`: the local fleet's status file, written after each controller tick from the
controller's real tick (a real Prometheus holding two pods' history, real sidecars), read
back by the status command. The engines are left out: what the file holds comes from the tick alone."""

from __future__ import annotations

import io
import json
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
from rich.console import Console

from specserve_operator import cli, status_cli
from specserve_operator.local.status_file import STATUS_FILE, record_tick
from specserve_operator.tuner.core import ResourceView
from specserve_operator.tuner.loop import FleetController

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="prometheus and promtool are not installed (scripts/setup.sh installs them)",
    ),
]
NS, NAME, PODS = "local", "tiny", ("tiny-0", "tiny-1")
TOKEN = "secret-token"


def _status(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = status_cli.run(cli.build_parser().parse_args(["status", *args]), Console(file=out, width=200))
    return code, out.getvalue()


async def test_the_status_file_of_a_ticking_fleet_reads_back_as_the_clusters_would(
    tmp_path: Path, prometheus_factory, rows_for, bucket_load, openmetrics_of, spec_factory, sidecars
) -> None:
    spec = spec_factory()
    view = ResourceView(NS, NAME, spec, PODS)
    prior = view.prior(spec.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=6000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=3000, step_s_plain=prior.step_s(50, 0)),
    }
    rows = [r for pod in PODS for r in rows_for(NS, pod, "draft", loads, running=3)]
    end = time.time() - 5
    prom = prometheus_factory(openmetrics=openmetrics_of(rows, end - 600, end))
    stands = {pod: await sidecars(token=TOKEN) for pod in PODS}
    run_dir = tmp_path / "runs" / "tiny-20250101-000000"
    status: dict = {}
    decisions: list[dict] = []
    async with aiohttp.ClientSession() as session:
        controller = FleetController(prom.url, session)
        tick = await controller.tick(view, {p: s.url for p, s in stands.items()}, TOKEN)
        record_tick(run_dir, status, decisions, view, tick, datetime.now(UTC))
    assert tick.decision is not None and tick.pushed

    code, out = _status("--local", str(tmp_path / "runs"), "-o", "json")  # the newest run under --out
    assert code == 0
    (shown,) = json.loads(out)
    assert (shown["namespace"], shown["name"], shown["mode"]) == (NS, NAME, "auto")
    assert shown["drafter"] == "draft" and shown["policyVersion"] == tick.decision.policy_version
    by_bucket = {b["bucket"]: b for b in shown["buckets"]}
    assert by_bucket["4"]["k"] == tick.decision.k_by_bucket["4"] > 0
    assert by_bucket["4"]["recommendedK"] == by_bucket["4"]["k"]  # auto: the recommendation is in force
    assert by_bucket["4"]["mal"] > 2.0
    assert [p["policyVersion"] for p in shown["pods"]] == [1, 1]  # what the history's sidecars report
    assert shown["decisions"][-1]["action"] == tick.decision.action

    code, plain = _status("--local", str(run_dir / STATUS_FILE), NAME)
    assert code == 0 and plain.startswith(f"{NS}/{NAME}  phase -  mode auto")
    assert "buckets (K in force and recommended per batch-size bucket):" in plain
    assert _status("--local", str(run_dir), "other")[0] == 1
    assert _status("--local", str(tmp_path / "empty"))[0] == 1
