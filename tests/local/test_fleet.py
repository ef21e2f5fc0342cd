"""The README's first command, shortened: `specserve local up` on the example manifest with one replica
and a short quiet → busy → quiet pattern, on real vLLM engines, a real sidecar, real Prometheus and the
controller. Also Ctrl-C: everything stops, no process and no port is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve_operator.local.preflight import port_in_use

pytestmark = [pytest.mark.engine, pytest.mark.prometheus]

REPO = Path(__file__).resolve().parents[2]
SPECSERVE = Path(sys.executable).parent / "specserve"
# Quiet long enough for the controller to measure, busy well past the cliff, quiet again. The quiet
# phases are all code, where the tiny draft model pays about 1.5x at concurrency 1 (benchmarks/results/
# local_fleet.json); on half prose it pays about 1.05x, inside this machine's noise, and a CI run measured
# it losing and rightly kept speculation off. The last quiet phase is longer than one exploration
# interval (about 50 s at the example's explorationShare 0.2): a CI run ended the busy phase with batch 1
# off, priced on speculative steps timed under the busy phase's contention, its first canary went to the
# bucket the draining batches were in, and the next came after a 50 s phase had ended.
TRAFFIC = "quiet:40s:1:1,busy:60s:16:0.5,quiet:70s:1:1"


def _up(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            str(SPECSERVE),
            "local",
            "up",
            str(REPO / "examples" / "local-fleet.yaml"),
            "--replicas",
            "1",
            "--out",
            str(out),
            "--no-live",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )


def _stray_processes(run_dir: Path) -> list[str]:
    """Processes whose command line or environment mentions the run folder (engines, workers, sidecars,
    Prometheus all do)."""
    found = []
    marker = str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                if marker in (entry / part).read_bytes():
                    found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:120]!r}")
                    break
            except OSError:
                continue
    return found


def _ports(run_dir: Path) -> list[int]:
    fleet = json.loads((run_dir / "fleet.json").read_text())
    urls = [fleet["prometheus"], *fleet["stockEngines"]] + [
        u for pod in fleet["pods"].values() for u in (pod["engine"], pod["sidecar"])
    ]
    return [int(u.rsplit(":", 1)[1]) for u in urls]


def test_local_fleet_follows_the_load(tmp_path: Path) -> None:
    proc = _up(
        tmp_path, "--traffic", TRAFFIC, "--compare-scale", "0.2", "--max-tokens", "48", "--sweep-point", "3"
    )
    output, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, output[-4000:]
    (run_dir,) = tmp_path.iterdir()
    report = run_dir / "report"
    for name in ("report.md", "timeline.png", "tokens_per_s.png", "mal_per_bucket.png", "data.json"):
        assert (report / name).stat().st_size > 0, name
    md = (report / "report.md").read_text()
    assert "turned off under load: **yes**" in md, md
    assert "turned back on: **yes**" in md, md
    data = json.loads((report / "data.json").read_text())
    runs = {r["run"] for r in data["records"]}
    assert runs == {"specserve", "off", "static", "best-static", "sweep"}
    failed = [r for r in data["records"] if not r["ok"]]
    assert not failed, [(r["phase"], r["start_s"], r["error"]) for r in failed[:5]]
    # The plain-decoding run went to the stock vLLM (no specserve), and only that run did.
    (stock_log,) = run_dir.glob("stock-*/engine.log")
    served = stock_log.read_text().count("POST /v1/completions")
    assert served == sum(r["run"] == "off" for r in data["records"]) > 0
    # Speculation was measured: some bucket saw accepted drafts during the controller's run.
    assert max(data["mal_by_bucket"]["specserve"].values()) > 1.0
    assert data["decisions"], "the controller decided nothing"
    # The best static table was swept on the pod (off and K 1-4, at concurrency 1 and 16, in two rounds)
    # and then run.
    assert len(data["sweep"]["points"]) == 20 and data["sweep"]["table"]["drafter"] == "tiny-draft"
    assert all(p["tokens_per_s"] > 0 for p in data["sweep"]["points"])
    assert "## The best static table" in md and "## Against the goals" in md
    # `specserve status --local` reads the fleet's status file as it would read a cluster's resource.
    shown = subprocess.run(
        [str(SPECSERVE), "status", "--local", str(run_dir), "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    (status,) = json.loads(shown.stdout)
    assert status["name"] == "tiny" and status["drafter"] == "tiny-draft" and status["decisions"]
    assert {b["bucket"] for b in status["buckets"]} >= {"1", "16"}
    assert [p["name"] for p in status["pods"]] == ["tiny-0"]
    assert not _stray_processes(run_dir)
    assert not any(port_in_use(p) for p in _ports(run_dir))


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    proc = _up(tmp_path, "--traffic", "quiet:60s:1")
    assert proc.stdout is not None
    # Interrupt while vLLM starts (its API server, engine core and worker are being spawned).
    for line in proc.stdout:
        if line.startswith("starting"):
            break
    (run_dir,) = tmp_path.iterdir()
    deadline = time.monotonic() + 60
    while not list(run_dir.glob("*/engine.log")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(8)
    assert _stray_processes(run_dir), "nothing was running to interrupt"
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "stopped (Ctrl-C)" in output
    assert not _stray_processes(run_dir)
