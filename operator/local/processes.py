"""Port checks for the local fleet's preflight; the fleet's child processes themselves are
specserve_engine.processes.GroupProcess."""

from __future__ import annotations

import socket


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False
