"""Checks before anything starts: every failure is a LocalFleetError with a hint, and nothing is left
running because nothing was started yet."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterable
from pathlib import Path

from specserve_operator.local.errors import LocalFleetError

GIB = 1024**3


def require_binary(name: str, purpose: str, install_hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LocalFleetError(f"`{name}` is not installed ({purpose})", hint=install_hint)
    return path


PROMETHEUS_HINT = (
    "run `make setup` (it installs Debian's `prometheus` package), or `sudo apt-get install prometheus`, "
    "then try again"
)


def require_prometheus() -> str:
    return require_binary(
        "prometheus", "the local fleet runs a real Prometheus that scrapes the engines", PROMETHEUS_HINT
    )


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def require_ports_free(ports: Iterable[tuple[str, int]], host: str = "127.0.0.1") -> None:
    """Each (what, port) must be free on `host`."""
    for what, port in ports:
        if port_in_use(port, host):
            raise LocalFleetError(
                f"port {port} on {host} is already taken (wanted for {what})",
                hint=f"stop what listens there (`ss -ltnp 'sport = :{port}'` shows it) "
                f"or pick another port with the matching --*-port option",
            )


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable: what the kernel says can be allocated without swapping."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise LocalFleetError(f"{meminfo} has no MemAvailable line", hint="the local fleet needs Linux")


def check_memory(replicas: int, per_engine_bytes: int, available_bytes: int, reserve_bytes: int) -> None:
    """Refuse to start `replicas` engines that would not fit in memory (with a reserve for Prometheus,
    the sidecars, the controller and the rest of the machine)."""
    needed = replicas * per_engine_bytes + reserve_bytes
    if needed > available_bytes:
        fits = max(0, (available_bytes - reserve_bytes) // per_engine_bytes)
        raise LocalFleetError(
            f"not enough memory for {replicas} replica(s): each engine with its sidecar needs about "
            f"{per_engine_bytes / GIB:.1f} GiB, {needed / GIB:.1f} GiB in all with the reserve, "
            f"and {available_bytes / GIB:.1f} GiB is available",
            hint=f"lower spec.replicas to {fits} or fewer (or use --replicas), or free memory",
        )
