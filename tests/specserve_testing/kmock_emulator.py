"""A fake Kubernetes API server for operator tests: kmock's emulator, made faithful enough for kopf.

kmock 0.8 keeps objects but assigns no resourceVersion, uid, generation, creationTimestamp or generated
name (so a second Event conflicts with the first), and replays
every object to each new watch, so kopf handles a creation twice. `RVEmulator` fixes both: it stamps
those fields on every write (generation moves only when the spec changes, as on a real server) and a
watch that starts from a resourceVersion streams only new events.

Pytest plugin (listed in tests/conftest.py). Fixtures:
- `kube_emulator`: a running RVEmulator with the built-in resources, the SpeculativeServing CRD and the
  Prometheus Operator's ServiceMonitor; `KUBECONFIG` points at it, so kopf and the operator's client
  both find it as they would a cluster.
- `operator_runner`: `async with operator_runner(): ...` runs the real operator in-process (all of
  HANDLER_MODULES) against the emulator and stops it on exit; usable several times in one test.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import kmock
import kopf
import pytest
import pytest_asyncio
import yaml

from specserve_operator import runner
from specserve_operator.api import models
from specserve_operator.render import children as render

SERVINGS = f"{models.GROUP}/{models.VERSION}/{models.PLURAL}"
SERVICE_MONITORS = "monitoring.coreos.com/v1/servicemonitors"
NAMESPACE = "ns"


@attrs.define(kw_only=True)
class RVEmulator(kmock.KubernetesEmulator):
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(100), init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta["resourceVersion"] = str(next(self._versions))
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            elif request.action == kmock.action.UPDATE and request.name is not None:
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = str(next(self._versions))
                key = (request.resource, request.namespace, request.name)
                if request.subresource is None and "spec" in request.data and key in self._objects:
                    current = self._objects[key]
                    if not current.deleted and _merged(
                        current.get("spec"), request.data["spec"]
                    ) != current.get("spec"):
                        meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        elif (
            request.resource is not None
            and isinstance(request.data, list)
            and request.action == kmock.action.UPDATE
        ):
            # a JSON patch
            version = str(next(self._versions))
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        return await super()._handle(request)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        if "resourceVersion" not in request.params:
            async for item in super()._serve_watch(request):
                yield item
            return
        yield b""  # send the headers now; then only what happens from here on
        async for event in self._buses[request.resource]:
            meta = event.get("object", {}).get("metadata", {})
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                continue
            if request.name is not None and meta.get("name") != request.name:
                continue
            yield event


def pod_object(name: str, resource_name: str, ip: str) -> dict[str, Any]:
    """A ready, running engine Pod of a resource, as its Deployment would make it, at address `ip`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": render.common_labels(resource_name)},
        "spec": {"containers": [{"name": "engine", "image": "engine:test"}]},
        "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _merged(old: Any, patch: Any) -> Any:
    """A JSON merge patch applied to a copy (RFC 7386), to tell whether the spec really changed."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out


def add_resources(emulator: RVEmulator) -> None:
    emulator.resources.load_bundled()
    emulator.resources[SERVINGS] = kmock.ResourceInfo(
        kind=models.KIND,
        singular=models.SINGULAR,
        namespaced=True,
        shortnames=set(models.SHORT_NAMES),
        subresources={"status", "scale"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
    )
    emulator.resources[SERVICE_MONITORS] = kmock.ResourceInfo(
        kind="ServiceMonitor",
        singular="servicemonitor",
        namespaced=True,
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
    )


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "kmock", "user": {"token": "kmock"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


@pytest_asyncio.fixture()
async def kube_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RVEmulator]:
    async with RVEmulator() as emulator, kmock.Server(emulator) as server:
        add_resources(emulator)
        url = str(server.url).rstrip("/")
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", url)))
        yield emulator


def fast_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 15
    settings.watching.reconnect_backoff = 0.1
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 1
    settings.persistence.consistency_timeout = 1
    settings.posting.enabled = True
    return settings


@pytest.fixture()
def operator_runner(kube_emulator: RVEmulator) -> Callable[..., contextlib.AbstractAsyncContextManager[None]]:
    """The operator runs in a thread with its own event loop, as in a real process: on exit kopf waits
    for every task of its loop, which must not include the emulator's (served by the test's loop)."""

    @contextlib.asynccontextmanager
    async def run(**kwargs: Any) -> AsyncIterator[None]:
        stop = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(
                    runner.run_operator(standalone=True, settings=fast_settings(), stop_flag=stop, **kwargs)
                )
            except BaseException as exc:  # reported to the test below
                errors.append(exc)

        thread = threading.Thread(target=main, name="specserve-operator", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "the operator did not stop within 30 s"
        if errors:
            raise errors[0]

    return run


async def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.1) -> Any:
    """Wait until `check()` returns a truthy value (or stops raising AssertionError); return it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError):
            if asyncio.get_running_loop().time() > deadline:
                raise
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
