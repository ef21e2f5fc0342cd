"""Process groups: stopping a child stops everything it spawned, and nothing is left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

from specserve_engine.launch import free_port
from specserve_operator.local.processes import (
    GroupProcess,
    group_alive,
    group_rss_bytes,
    port_in_use,
)


def test_stop_takes_down_grandchildren(tmp_path: Path) -> None:
    # A shell that ignores SIGTERM and has a grandchild: the group is still stopped (SIGKILL after grace).
    proc = GroupProcess("t", ["sh", "-c", "trap '' TERM; sleep 60 & echo started; wait"], tmp_path / "t.log")
    proc.start()
    assert proc.pid is not None
    deadline = time.monotonic() + 10
    while "started" not in proc.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.running() and group_alive(proc.pid)
    assert os.getpgid(proc.pid) == proc.pid  # it leads its own group: a terminal's Ctrl-C misses it
    assert group_rss_bytes(proc.pid) > 0
    t0 = time.monotonic()
    proc.stop(grace_s=0.5)
    assert time.monotonic() - t0 < 8
    assert not proc.running()
    assert not group_alive(proc.pid)


def test_stop_is_quick_for_a_well_behaved_child(tmp_path: Path) -> None:
    proc = GroupProcess("t", ["sleep", "60"], tmp_path / "t.log")
    proc.start()
    t0 = time.monotonic()
    proc.stop()
    assert time.monotonic() - t0 < 2
    assert proc.returncode() is not None


def test_free_port_is_free() -> None:
    port = free_port()
    assert not port_in_use(port)
