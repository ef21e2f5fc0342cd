"""Process groups: stopping a child stops everything it spawned, nothing is left behind, and a child
dies with its parent. A service process is ready when its HTTP probe says so, and one that fails to
start says why."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specserve_engine.launch import free_port
from specserve_engine.processes import (
    GroupProcess,
    ServiceProcess,
    ServiceStartError,
    _group_members,
    group_alive,
    group_rss_bytes,
    pin_group,
)
from specserve_operator.local.preflight import port_in_use


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stubborn(tmp_path: Path) -> GroupProcess:
    """A shell that ignores SIGTERM and has a grandchild, started and reporting so."""
    proc = GroupProcess("t", ["sh", "-c", "trap '' TERM; sleep 60 & echo started; wait"], tmp_path / "t.log")
    proc.start()
    assert _wait_for(lambda: "started" in proc.log_tail())
    return proc


def test_stop_takes_down_grandchildren(tmp_path: Path) -> None:
    # SIGTERM is ignored, so the group is stopped with SIGKILL after the grace period.
    proc = _stubborn(tmp_path)
    assert proc.pid is not None
    assert proc.running() and group_alive(proc.pid)
    assert os.getpgid(proc.pid) == proc.pid  # it leads its own group: a terminal's Ctrl-C misses it
    assert group_rss_bytes(proc.pid) > 0
    t0 = time.monotonic()
    proc.stop(grace_s=0.5)
    assert time.monotonic() - t0 < 8
    assert not proc.running()
    assert not group_alive(proc.pid)


def test_pin_group_moves_every_process_and_thread_of_the_group(tmp_path: Path) -> None:
    proc = _stubborn(tmp_path)  # a shell and its grandchild
    ours = os.sched_getaffinity(0)
    try:
        assert proc.pid is not None
        members = [entry for entry, _ in _group_members(proc.pid)]
        assert len(members) >= 2
        core = max(ours)
        pin_group(proc.pid, {core})
        for member in members:
            for task in (member / "task").iterdir():
                assert os.sched_getaffinity(int(task.name)) == {core}
        assert os.sched_getaffinity(0) == ours  # only the group moved
    finally:
        proc.stop(grace_s=0.5)


def test_stop_is_quick_for_a_well_behaved_child(tmp_path: Path) -> None:
    proc = GroupProcess("t", ["sleep", "60"], tmp_path / "t.log")
    proc.start()
    t0 = time.monotonic()
    proc.stop()
    assert time.monotonic() - t0 < 2
    assert proc.returncode() is not None


def test_kill_takes_down_the_group_at_once(tmp_path: Path) -> None:
    proc = _stubborn(tmp_path)
    assert proc.pid is not None
    t0 = time.monotonic()
    proc.kill()
    assert time.monotonic() - t0 < 2  # no grace period
    assert proc.returncode() == -signal.SIGKILL
    assert not group_alive(proc.pid)


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    # The parent starts a child and is then SIGKILLed, so it cannot stop the child itself.
    parent_code = (
        "import sys; from pathlib import Path; from specserve_engine.processes import GroupProcess\n"
        "p = GroupProcess('c', ['sleep', '60'], Path(sys.argv[1])); p.start(); print(p.pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, str(tmp_path / "c.log")], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert group_alive(child)
    parent.kill()
    parent.wait()
    assert _wait_for(lambda: not group_alive(child))


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread(tmp_path: Path) -> None:
    # asyncio.to_thread's worker threads end when the event loop closes; the child must stay (the
    # kernel's parent-death signal follows the thread that forked, so children are forked elsewhere).
    proc = GroupProcess("t", ["sleep", "60"], tmp_path / "t.log")

    async def start() -> None:
        await asyncio.to_thread(proc.start)

    asyncio.run(start())
    try:
        time.sleep(0.5)
        assert proc.running()
    finally:
        proc.stop()


def test_free_port_is_free() -> None:
    port = free_port()
    assert not port_in_use(port)


def _service(tmp_path: Path, script: str, port: int) -> ServiceProcess:
    group = GroupProcess("svc", [sys.executable, "-c", script, str(port)], tmp_path / "svc.log", cwd=tmp_path)
    group.start()
    return ServiceProcess(group, f"http://127.0.0.1:{port}", "/", poll_s=0.05, stop_grace_s=5.0)


HTTP_AFTER_A_PAUSE = (
    "import http.server, sys, time; time.sleep(0.5); "
    "handler = http.server.SimpleHTTPRequestHandler; "
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), handler).serve_forever()"
)


def test_a_service_is_ready_once_its_probe_answers(tmp_path: Path) -> None:
    service = _service(tmp_path, HTTP_AFTER_A_PAUSE, free_port())
    try:
        assert not service.ready()
        service.wait_ready(timeout_s=30)
        assert service.ready()
    finally:
        service.stop()
    assert not group_alive(service.process.pid)


def test_a_service_that_exits_early_raises_with_its_log(tmp_path: Path) -> None:
    service = _service(tmp_path, "import sys; print('bad config', flush=True); sys.exit(3)", free_port())
    with pytest.raises(ServiceStartError, match=r"(?s)exited with code 3.*bad config"):
        service.wait_ready(timeout_s=30)


def test_a_service_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    service = _service(tmp_path, "import time; time.sleep(60)", free_port())
    with pytest.raises(ServiceStartError, match="not ready"):
        service.wait_ready(timeout_s=0.5)
    assert not group_alive(service.process.pid)
