"""The control API (control_api.py) over real HTTP (docs/sidecar.md, "Control API"): every good call,
every bad call with its 4xx, and the policy in force (state and policy.json) unchanged by anything
refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from specserve_engine.api import SidecarConfig, SidecarState
from specserve_engine.control_api import build_app
from specserve_engine.policy_file import policy_path
from specserve_engine.sidecar_service import SidecarService

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def api(service: SidecarService) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(build_app(service, TOKEN))) as client:
        yield client


def body(version: int, drafter: str = "ngram", k: int = 2, mode: str = "on") -> dict[str, Any]:
    return {"policyVersion": version, "drafter": drafter, "mode": mode, "kByBucket": {"1": k, "2": k, "4": 1}}


async def put(api: TestClient, data: Any, headers: dict[str, str] = AUTH) -> tuple[int, dict]:
    raw = data if isinstance(data, bytes | str) else json.dumps(data)
    resp = await api.put("/v1/policy", data=raw, headers=headers)
    return resp.status, await resp.json()


async def state(api: TestClient) -> SidecarState:
    resp = await api.get("/v1/state", headers=AUTH)
    assert resp.status == 200
    return SidecarState.model_validate(await resp.json())


async def test_apply_is_versioned_and_idempotent(api: TestClient, config: SidecarConfig) -> None:
    status, data = await put(api, body(2, "suffix", 3))
    assert status == 200
    assert (data["policyVersion"], data["drafter"], data["kByBucket"]["1"]) == (2, "suffix", 3)
    on_disk = json.loads(policy_path(config.runtime_dir).read_text())
    assert (on_disk["policyVersion"], on_disk["drafter"]) == (2, "suffix")
    assert on_disk["kByBucket"] == {"1": 3, "2": 3, "4": 1}
    assert await put(api, body(2, "suffix", 3)) == (200, data)  # the same call again: a no-op
    status, data = await put(api, body(3, "suffix", 0, mode="off"))
    assert (status, data["mode"]) == (200, "off")
    metrics = await (await api.get("/metrics")).text()
    labels = 'drafter="suffix",drafter_status="loaded",mode="off",policy_version="3"'
    info = "specserve_sidecar_policy_info{" + labels + "}"
    assert f"{info} 1.0" in metrics
    assert 'specserve_sidecar_k{bucket="1"} 0.0' in metrics
    assert 'specserve_sidecar_switches_total{kind="drafter",result="applied"} 1.0' in metrics
    assert 'specserve_sidecar_switches_total{kind="mode",result="applied"} 1.0' in metrics


BAD_CALLS: list[tuple[str, Any, dict[str, str], int, str | None]] = [
    ("older version", body(0), AUTH, 409, "policyVersion"),
    ("same version, other content", body(1, k=1), AUTH, 409, "policyVersion"),
    ("unknown drafter", body(5, "eagle9"), AUTH, 422, "drafter"),
    ("K above the drafter's maximum", body(5, "self", 4), AUTH, 422, "kByBucket"),
    ("unknown bucket", {**body(5), "kByBucket": {"3": 1}}, AUTH, 422, "kByBucket"),
    ("negative K", {**body(5), "kByBucket": {"1": -1}}, AUTH, 422, "kByBucket"),
    ("bad mode", {**body(5), "mode": "sometimes"}, AUTH, 422, "mode"),
    ("missing version", {"drafter": "ngram"}, AUTH, 422, "policyVersion"),
    ("unknown field", {**body(5), "drafters": []}, AUTH, 422, "drafters"),
    ("not an object", [1, 2], AUTH, 422, None),
    ("malformed JSON", b'{"policyVersion": 5,', AUTH, 400, None),
    ("oversized body", b'{"x": "' + b"a" * 70_000 + b'"}', AUTH, 413, None),
    ("no token", body(5), {}, 401, "Authorization"),
    ("wrong token", body(5), {"Authorization": "Bearer nope"}, 401, "Authorization"),
]


@pytest.mark.parametrize(
    ("why", "data", "headers", "code", "field"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
async def test_bad_calls_change_nothing(
    api: TestClient, config: SidecarConfig, why: str, data: Any, headers: dict, code: int, field: str | None
) -> None:
    before = await state(api)
    file = policy_path(config.runtime_dir)
    file_before = (file.read_text(), file.stat().st_mtime_ns)
    status, err = await put(api, data, headers)
    assert status == code, (why, err)
    assert set(err) <= {"error", "field"} and err["error"]
    assert err.get("field") == field
    assert await state(api) == before
    assert (file.read_text(), file.stat().st_mtime_ns) == file_before


async def test_state_needs_the_token_but_probes_do_not(api: TestClient) -> None:
    assert (await api.get("/v1/state")).status == 401
    assert (await api.get("/healthz")).status == 200
    assert (await api.get("/readyz")).status == 200
    assert (await api.get("/metrics")).status == 200


async def test_not_ready_before_warm_up(config: SidecarConfig) -> None:
    service = SidecarService(config)
    async with TestClient(TestServer(build_app(service, None))) as api:
        assert (await api.get("/readyz")).status == 503
        assert (await api.get("/healthz")).status == 200
        await service.start()
        assert (await api.get("/readyz")).status == 200
        assert (await api.get("/v1/state")).status == 200  # no token configured: open
