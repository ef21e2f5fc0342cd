"""Async client for the sidecar control API (docs/sidecar.md#control-api), used by the operator and the
local fleet."""

from __future__ import annotations

import aiohttp

from specserve_engine.api import ApiError, PolicyRequest, SidecarState


class SidecarError(Exception):
    """The sidecar refused a call (4xx) or could not be reached."""

    def __init__(self, message: str, status: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


class SidecarClient:
    def __init__(
        self,
        base_url: str,
        token: str | None,
        session: aiohttp.ClientSession,
        timeout_s: float = 2.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def state(self) -> SidecarState:
        return SidecarState.model_validate(await self._call("GET", "/v1/state"))

    async def put_policy(self, policy: PolicyRequest) -> tuple[int, SidecarState]:
        """Apply a policy; returns the HTTP status (200 applied, 202 drafter loading) and the state."""
        body = policy.model_dump(by_alias=True)
        status, data = await self._request("PUT", "/v1/policy", body)
        return status, SidecarState.model_validate(data)

    async def _call(self, method: str, path: str) -> dict:
        _, data = await self._request(method, path, None)
        return data

    async def _request(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        try:
            async with self._session.request(
                method, self.base_url + path, json=body, headers=self._headers, timeout=self._timeout
            ) as resp:
                data = await resp.json(content_type=None)
                if resp.status >= 400:
                    err = (
                        ApiError.model_validate(data) if isinstance(data, dict) and "error" in data else None
                    )
                    raise SidecarError(
                        err.error if err else f"HTTP {resp.status}",
                        status=resp.status,
                        field=err.field if err else None,
                    )
                return resp.status, data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise SidecarError(f"{method} {self.base_url}{path}: {exc!r}") from exc
