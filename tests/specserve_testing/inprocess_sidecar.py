"""The whole sidecar (`server.serve`: control API, draft socket and drafting service, what
`specserve-sidecar` runs) in the test's own event loop, on a free port: for tests that need the real
listeners and their limits, and may patch module settings first."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from specserve_engine.api import SidecarConfig
from specserve_engine.server import serve


@dataclass(frozen=True)
class RunningSidecar:
    url: str
    port: int
    config: SidecarConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def running_sidecar(config: SidecarConfig, ready_s: float = 15.0) -> AsyncIterator[RunningSidecar]:
    """Serves `config` (its host and port as given) until the block ends; ready (/readyz 200) on entry."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    url = f"http://{config.host}:{config.port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = asyncio.get_running_loop().time() + ready_s
            while True:
                if task.done():
                    task.result()  # raises what stopped it
                    raise AssertionError("the sidecar stopped before it was ready")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url + "/readyz") as resp:
                        if resp.status == 200:
                            break
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(f"the sidecar was not ready within {ready_s} s")
                await asyncio.sleep(0.05)
        yield RunningSidecar(url, config.port, config)
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
