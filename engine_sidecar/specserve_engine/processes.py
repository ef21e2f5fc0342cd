"""Child processes that lead their own process group: the engines, the sidecars, Prometheus.

Stopping a child stops everything it spawned (vLLM's engine core and workers), a Ctrl-C in the terminal
reaches only us (we then stop the children in order), and a child dies with its parent if the parent
dies without stopping it. A `ServiceProcess` is such a child that serves HTTP and says when it is ready
(launch.py starts the engines and sidecars as ones).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

LOG_TAIL_LINES = 40  # of a service that failed to start, in the error
_PR_SET_PDEATHSIG = 1
# Looked up here, not in the child: loading a library between fork and exec can deadlock.
_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None

# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a child started
# from a short-lived thread (asyncio.to_thread's, which end with their event loop) would die with it.
# So every child is forked from this one thread, which lives as long as the process.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-spawn")


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM if our process dies without stopping it."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class GroupProcess:
    """A child process leading its own process group, its output appended to a log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of our own environment
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = _spawner.submit(
                subprocess.Popen,
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,  # a new session, so a new process group led by the child
                preexec_fn=_die_with_parent,
            ).result()

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; the group is gone when this returns."""
        # Once the group is gone its id may be reused: a second stop() must signal nothing.
        if self.popen is None or _gone(self.popen):
            return
        _signal_group(self.popen.pid, signal.SIGTERM)
        if not _wait_gone(self.popen, grace_s):
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole group: nothing in it gets to clean up, as in a crash."""
        if self.popen is None or _gone(self.popen):
            return
        _signal_group(self.popen.pid, signal.SIGKILL)
        _wait_gone(self.popen, 5.0)


class ServiceStartError(RuntimeError):
    """A service exited or was not ready in time; the message carries its log tail."""


@dataclass
class ServiceProcess:
    """A GroupProcess serving HTTP at `url`: ready once `GET url + ready_path` answers 200."""

    group: GroupProcess
    url: str
    ready_path: str
    poll_s: float  # between two readiness probes
    stop_grace_s: float  # SIGTERM to SIGKILL, by default

    @property
    def log_path(self) -> Path:
        return self.group.log_path

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The group's leader."""
        assert self.group.popen is not None, "the service's group is started before it is handed out"
        return self.group.popen

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until ready; raise with the log tail if the process dies or time runs out (stopping it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServiceStartError(
                    f"{self.group.name} exited with code {code} before it was ready; log {self.log_path}, "
                    f"last lines:\n{self.group.log_tail(LOG_TAIL_LINES)}"
                )
            if self.ready():
                return
            time.sleep(self.poll_s)
        self.stop()
        raise ServiceStartError(
            f"{self.group.name} was not ready at {self.url}{self.ready_path} after {timeout_s:.0f} s; "
            f"log {self.log_path}, last lines:\n{self.group.log_tail(LOG_TAIL_LINES)}"
        )

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the whole group, SIGKILL it after `timeout_s` (default `stop_grace_s`); nothing of the
        group is left when this returns."""
        self.group.stop(grace_s=self.stop_grace_s if timeout_s is None else timeout_s)

    def kill(self) -> None:
        """SIGKILL: nothing in the group gets to clean up (a sidecar's socket file stays behind)."""
        self.group.kill()


def _gone(leader: subprocess.Popen[bytes]) -> bool:
    """The leader has exited and no process of its group is left."""
    return leader.poll() is not None and not group_alive(leader.pid)


def _wait_gone(leader: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the group is gone within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not _gone(leader):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_members(pgid: int) -> list[tuple[Path, str]]:
    """(/proc entry, state letter) of every process whose process group is `pgid`."""
    members: list[tuple[Path, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Fields after the parenthesised command: state is [0], pgrp is [2].
            rest = stat[stat.rfind(")") + 2 :].split()
            if int(rest[2]) == pgid:
                members.append((entry, rest[0]))
        except (OSError, ValueError, IndexError):
            continue
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists (zombies of our own children count as gone)."""
    return any(state != "Z" for _, state in _group_members(pgid))


def pin_group(pgid: int, cores: set[int]) -> None:
    """Move every thread of every process in the group onto `cores` (threads started later inherit it).
    The engine benchmark measures two engines at once, each on its own core."""
    for entry, _ in _group_members(pgid):
        with contextlib.suppress(OSError):
            for task in (entry / "task").iterdir():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task.name), cores)


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in the group (an engine's API server, engine core, workers)."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for entry, _ in _group_members(pgid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((entry / "statm").read_text().split()[1]) * page
    return total
