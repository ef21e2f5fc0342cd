"""The sidecar's HTTP control API (aiohttp), the operator's only way into the pod: `GET /v1/state`,
`PUT /v1/policy`, `/healthz`, `/readyz`, `/metrics` (docs/sidecar.md, "Control API"). It parses and
authenticates; every decision about a policy is the service's.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from specserve_engine.api import ApiError, PolicyRequest
from specserve_engine.sidecar_service import PolicyRefused, SidecarService

MAX_BODY_BYTES = 64 * 1024


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


def build_app(service: SidecarService, token: str | None) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/") and token is not None:
            given = request.headers.get("Authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
                return _error(401, "missing or wrong bearer token", "Authorization")
        return await handler(request)

    async def get_state(request: web.Request) -> web.Response:
        return _state_response(service)

    async def put_policy(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _error(413, f"body of {request.content_length} bytes exceeds {MAX_BODY_BYTES}")
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            return _error(413, f"body exceeds {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"malformed JSON: {exc}")
        try:
            req = PolicyRequest.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            return _error(422, f"{where or 'body'}: {first['msg']}", where)
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
