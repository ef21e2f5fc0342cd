"""The speculative engine sidecar: `specserve-sidecar --config FILE` (a SidecarConfig JSON file).

One process, two servers around one drafting service (sidecar_service.py):

- the draft socket (draft_socket.py, `drafts.sock` in the runtime dir): one thread per engine
  connection answers each engine step with up to K drafts per sequence from the drafter in force;
- the control API (control_api.py, aiohttp; docs/sidecar.md, "Control API"): the operator's only way
  into the pod.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
from pathlib import Path

import aiohttp
import torch
from pydantic import ValidationError

from specserve_engine.api import SidecarConfig
from specserve_engine.control_api import TokenFile, build_app, start_control_server
from specserve_engine.draft_protocol import SOCKET_NAME
from specserve_engine.draft_socket import DraftSocketServer
from specserve_engine.drafters import DrafterError
from specserve_engine.sidecar_service import PolicyRefused, SidecarService

log = logging.getLogger("specserve.sidecar")

ENGINE_POLL_S = 5.0


async def watch_engine(service: SidecarService, url: str) -> None:
    """Keep `engineReachable` current from the engine's /health."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            try:
                async with session.get(url.rstrip("/") + "/health") as resp:
                    service.engine_reachable = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                service.engine_reachable = False
            await asyncio.sleep(ENGINE_POLL_S)


async def serve(config: SidecarConfig, stop: asyncio.Event | None = None) -> None:
    token = TokenFile(config.token_file) if config.token_file is not None else None
    if token is None:
        log.warning("no tokenFile: the control API accepts unauthenticated calls")
    service = SidecarService(config)
    sockets = DraftSocketServer(service, Path(config.runtime_dir) / SOCKET_NAME)
    sockets.start()
    control = await start_control_server(build_app(service, token), config.host, config.port)
    log.info("control API on http://%s:%d", config.host, control.port)
    watcher = asyncio.create_task(watch_engine(service, config.engine_url))
    try:
        await service.start()
        gc.freeze()  # long-lived objects (weights, modules) leave the collector's scans: steadier draft calls
        log.info("sidecar ready")
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        watcher.cancel()
        sockets.stop()
        await control.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve-sidecar", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="SidecarConfig JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Small drafters are latency-bound: one intra-op thread avoids thread hand-offs on every tiny op.
    torch.set_num_threads(int(os.environ.get("SPECSERVE_SIDECAR_THREADS", "1")))
    try:
        config = SidecarConfig.model_validate_json(Path(args.config).read_text())
        asyncio.run(serve(config))
    except (OSError, ValidationError, ValueError, DrafterError) as exc:
        raise SystemExit(f"specserve-sidecar: {exc}") from exc
    except PolicyRefused as exc:
        raise SystemExit(f"specserve-sidecar: initialPolicy: {exc}") from exc


if __name__ == "__main__":
    main()
