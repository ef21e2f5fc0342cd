"""The sidecar's HTTP control API (aiohttp), the operator's only way into the pod: `GET /v1/state`,
`PUT /v1/policy`, `/healthz`, `/readyz`, `/metrics` (docs/sidecar.md, "Control API"). It parses and
authenticates; every decision about a policy is the service's.

Limits (docs/sidecar.md, "Limits"): a connection must deliver a request's headers within
`HEADER_TIMEOUT_S` of opening (and of its previous response) and its body within `BODY_TIMEOUT_S`;
at most `MAX_CONNECTIONS` are open at once, further ones are closed on accept. The operator makes a
handful of short calls per interval, so honest clients never come near either.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from specserve_engine.api import ApiError, PolicyRequest
from specserve_engine.sidecar_service import PolicyRefused, SidecarService

log = logging.getLogger("specserve.sidecar")

MAX_BODY_BYTES = 64 * 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


def _error(status: int, error: str, field: str | None = None) -> web.Response:
    return web.json_response(ApiError(error=error, field=field).model_dump(exclude_none=True), status=status)


def _state_response(service: SidecarService, status: int = 200) -> web.Response:
    return web.json_response(service.state().model_dump(by_alias=True), status=status)


def read_token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"tokenFile {token_file} is empty")
    return token


class TokenFile:
    """The control token, re-read whenever its file changes (a rotated Secret: kubelet swaps the
    `..data` symlink of the mounted volume, which gives the path a new inode; a plain rewrite changes
    its mtime or size). One `stat` per call; an empty or unreadable file keeps the token in force."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._token = read_token(path)  # start-up fails on a missing or empty file
        self._seen = self._identity()

    def _identity(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the symlinks: the Secret's current file
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> str | None:
        seen = self._identity()
        if seen != self._seen:
            self._seen = seen
            try:
                self._token = read_token(self.path)
                log.info("control token re-read from %s", self.path)
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                log.warning("control token file unusable, keeping the token in force: %s", exc)
        return self._token


def _authorized(header: str, token: str) -> bool:
    # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes: compare bytes, never raise.
    given = header.encode("utf-8", "surrogateescape")
    return given.startswith(b"Bearer ") and hmac.compare_digest(given[7:], token.encode())


def build_app(service: SidecarService, token: str | TokenFile | None) -> web.Application:
    def current_token() -> str | None:
        return token.current() if isinstance(token, TokenFile) else token

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        expected = current_token() if request.path.startswith("/v1/") else None
        if expected is not None and not _authorized(request.headers.get("Authorization", ""), expected):
            return _error(401, "missing or wrong bearer token", "Authorization")
        return await handler(request)

    async def get_state(request: web.Request) -> web.Response:
        return _state_response(service)

    async def put_policy(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _error(413, f"body of {request.content_length} bytes exceeds {MAX_BODY_BYTES}")
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await _read_body(request)
        except TimeoutError:
            return _error(408, f"body not received within {BODY_TIMEOUT_S:g} s")
        if raw is None:
            return _error(413, f"body exceeds {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except RecursionError:
            return _error(400, "malformed JSON: nested too deeply")
        except ValueError as exc:
            return _error(400, f"malformed JSON: {exc}")
        try:
            # Strict on the wire: "3" is not 3, true is not 1, 2.0 is not 2.
            req = PolicyRequest.model_validate(data, strict=True)
        except ValidationError as exc:
            return _validation_error(exc)
        try:
            status = await service.put_policy(req)
        except PolicyRefused as exc:
            return web.json_response(exc.body.model_dump(exclude_none=True), status=exc.status)
        return _state_response(service, status)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if not service.warm:
            return _error(503, "warming up")
        return web.json_response({"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/v1/state", get_state)
    app.router.add_put("/v1/policy", put_policy)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def _read_body(request: web.Request) -> bytes | None:
    """The whole body, or None when it is longer than MAX_BODY_BYTES."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(MAX_BODY_BYTES + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
    return b"".join(chunks)


def _validation_error(exc: ValidationError) -> web.Response:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or None
    return _error(422, f"{where or 'body'}: {first['msg']}", where)


class _Refused(asyncio.Protocol):
    """A connection over MAX_CONNECTIONS: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's handler for one connection, freeing the connection's slot when it ends."""

    def __init__(self, inner: asyncio.Protocol, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release = release

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


@dataclass
class ControlServer:
    """The control API listening on a TCP port, with the limits of the module docstring."""

    runner: web.AppRunner
    server: asyncio.Server

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()  # closes the open connections
        await self.server.wait_closed()


async def start_control_server(
    app: web.Application,
    host: str,
    port: int,
    header_timeout_s: float | None = None,
    max_connections: int | None = None,
) -> ControlServer:
    header_timeout_s = HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s
    max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
    # aiohttp's keep-alive timer starts when a connection opens and closes it while no whole request
    # has arrived: that is the header timeout (its default is an hour).
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=header_timeout_s)
    await runner.setup()
    handlers = runner.server
    assert handlers is not None
    open_now = refused = 0

    def release() -> None:
        nonlocal open_now
        open_now -= 1

    def protocol() -> asyncio.Protocol:
        nonlocal open_now, refused
        if open_now < max_connections:
            open_now += 1
            return _Counted(handlers(), release)
        refused += 1
        if refused == 1 or refused % 1000 == 0:
            log.warning("control API: %d connections refused over the limit of %d", refused, max_connections)
        return _Refused()

    server = await asyncio.get_running_loop().create_server(protocol, host, port)
    return ControlServer(runner, server)
