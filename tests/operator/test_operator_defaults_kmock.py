"""The real operator against kmock with a minimal resource: the chart's default engine image reaches the
pods; without one the resource is Invalid, naming spec.engine.image, and nothing is created."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock
import pytest

from specserve_testing.kmock_emulator import NAMESPACE, SERVINGS, RVEmulator, eventually

MINIMAL = {
    "apiVersion": "specserve.io/v1alpha1",
    "kind": "SpeculativeServing",
    "metadata": {"name": "minimal", "namespace": NAMESPACE},
    "spec": {
        "model": {"name": "m", "source": "hf://org/m"},
        "drafters": [{"name": "ngram", "method": "ngram"}],
        "speculation": {"mode": "auto"},
    },
}


def _get(emulator: RVEmulator, resource: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), NAMESPACE, name)
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    return dict(emulator.objects[key].raw)


def _condition(emulator: RVEmulator, type_: str) -> dict[str, Any] | None:
    serving = _get(emulator, SERVINGS, "minimal") or {}
    return next(
        (c for c in (serving.get("status") or {}).get("conditions") or [] if c["type"] == type_), None
    )


async def _create(emulator: RVEmulator) -> None:
    await emulator.post(
        f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings", json=MINIMAL
    )


async def test_a_minimal_resource_runs_the_operators_engine_image(
    kube_emulator: RVEmulator, operator_runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_ENGINE_IMAGE", "registry.example.com/specserve-engine:0.1.0")
    async with operator_runner():
        await _create(kube_emulator)
        deployment = await eventually(lambda: _get(kube_emulator, "apps/v1/deployments", "minimal"))
        await eventually(lambda: (_condition(kube_emulator, "Deployed") or {}).get("status") == "True")
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example.com/specserve-engine:0.1.0"}
    assert _condition(kube_emulator, "Invalid")["status"] == "False"


async def test_without_a_default_image_the_minimal_resource_is_invalid(
    kube_emulator: RVEmulator, operator_runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECSERVE_ENGINE_IMAGE", raising=False)
    async with operator_runner():
        await _create(kube_emulator)
        invalid = await eventually(lambda: _condition(kube_emulator, "Invalid"))
        await asyncio.sleep(1.0)  # long enough for a wrongly created child to show up
    assert invalid["status"] == "True" and "spec.engine.image" in invalid["message"]
    assert _get(kube_emulator, "apps/v1/deployments", "minimal") is None
