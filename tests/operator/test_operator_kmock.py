"""The real operator (kopf, all handler modules) in-process against a fake API server (kmock)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import kmock
import yaml

from specserve_operator import reconciler
from specserve_operator.api import crd
from specserve_operator.render import children as render
from specserve_testing.kmock_emulator import NAMESPACE, SERVICE_MONITORS, SERVINGS, RVEmulator, eventually

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "llama-70b-eagle3-h200.yaml"

CHILDREN = {
    "apps/v1/deployments": "{name}",
    "v1/services": "{name}",
    "policy/v1/poddisruptionbudgets": "{name}",
    "v1/configmaps": "{name}-sidecar",
    "v1/secrets": "{name}-control-token",
    SERVICE_MONITORS: "{name}",
}


def _resource(name: str = "llama") -> dict[str, Any]:
    resource = yaml.safe_load(EXAMPLE.read_text())
    resource["metadata"] = {"name": name, "namespace": NAMESPACE}
    return resource


def _get(emulator: RVEmulator, resource: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), NAMESPACE, name)
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    return dict(emulator.objects[key].raw)


def _children(emulator: RVEmulator, name: str) -> dict[str, dict[str, Any] | None]:
    return {res: _get(emulator, res, pattern.format(name=name)) for res, pattern in CHILDREN.items()}


def _condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


def _events(emulator: RVEmulator, reason: str) -> list[dict[str, Any]]:
    return [
        obj.raw
        for (res, _, _), obj in emulator.objects.items()
        if res.plural == "events" and not obj.deleted and obj.raw.get("reason") == reason
    ]


def _posts(emulator: RVEmulator, resource: str) -> int:
    return len(emulator["post", kmock.resource(resource)])


async def _create(emulator: RVEmulator, body: dict[str, Any]) -> None:
    await emulator.post(f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings", json=body)


def _deployed(emulator: RVEmulator, name: str) -> dict[str, Any] | None:
    serving = _get(emulator, SERVINGS, name)
    condition = _condition(serving, "Deployed")
    return serving if condition and condition["status"] == "True" else None


async def test_create_makes_every_child_owned_by_the_resource(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        serving = await eventually(lambda: _deployed(kube_emulator, "llama"))
    uid = serving["metadata"]["uid"]
    for res, child in _children(kube_emulator, "llama").items():
        assert child is not None, f"{res} missing"
        owners = child["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"], o["controller"]) for o in owners] == [
            ("SpeculativeServing", "llama", uid, True)
        ], res
    status = serving["status"]
    assert status["phase"] == "Deploying"  # no pods exist in a fake API server
    assert status["observedGeneration"] == 1
    assert status["selector"] == render.label_selector_string("llama")
    assert _condition(serving, "Invalid")["status"] == "False"
    assert _condition(serving, "Conflict")["status"] == "False"
    assert _condition(serving, "Ready")["status"] == "False"
    assert _events(kube_emulator, "Deployed")
    # what the operator wrote fits the CRD's status schema (a real API server would prune the rest)
    jsonschema.Draft4Validator(crd.open_api_schema()["properties"]["status"]).validate(status)


async def test_update_patches_the_deployment_and_rolls_the_pods(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
        before = _get(kube_emulator, "apps/v1/deployments", "llama")
        path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
        patch = {"spec": {"engine": {"image": "ghcr.io/specserve/engine:0.2.0"}, "replicas": 6}}
        await kube_emulator.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})

        def rolled() -> dict[str, Any] | None:
            deployment = _get(kube_emulator, "apps/v1/deployments", "llama")
            return deployment if deployment["spec"]["replicas"] == 6 else None

        after = await eventually(rolled)
        serving = await eventually(
            lambda: (s := _get(kube_emulator, SERVINGS, "llama"))["status"]["observedGeneration"] == 2 and s
        )
    key = render.POD_HASH_ANNOTATION
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != after["spec"]["template"]["metadata"]["annotations"][key]
    )
    assert {c["image"] for c in after["spec"]["template"]["spec"]["containers"]} == {
        "ghcr.io/specserve/engine:0.2.0"
    }
    assert _posts(kube_emulator, "apps/v1/deployments") == 1  # patched, not re-created
    assert serving["metadata"]["generation"] == 2


async def test_the_token_is_never_rotated(kube_emulator: RVEmulator, operator_runner) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
        token = _get(kube_emulator, "v1/secrets", "llama-control-token")["stringData"]["token"]
        path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
        await kube_emulator.patch(
            path, json={"spec": {"replicas": 1}}, headers={"Content-Type": "application/merge-patch+json"}
        )
        await eventually(lambda: _get(kube_emulator, "apps/v1/deployments", "llama")["spec"]["replicas"] == 1)
    assert _get(kube_emulator, "v1/secrets", "llama-control-token")["stringData"]["token"] == token
    assert _posts(kube_emulator, "v1/secrets") == 1


async def test_delete_removes_every_child(kube_emulator: RVEmulator, operator_runner) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
        await kube_emulator.delete(
            f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
        )
        await eventually(lambda: _get(kube_emulator, SERVINGS, "llama") is None)
    assert _children(kube_emulator, "llama") == dict.fromkeys(CHILDREN)


# Someone else's objects under the children's names: made by hand, by another tool, or by a user who
# may create SpeculativeServings but should not thereby delete or rewrite workloads in the namespace.
FOREIGN: dict[str, tuple[str, dict[str, Any]]] = {
    "apps/v1/deployments": (
        "Deployment",
        {
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "theirs"}},
                "template": {
                    "metadata": {"labels": {"app": "theirs"}},
                    "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]},
                },
            }
        },
    ),
    "v1/services": ("Service", {"spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}),
    "policy/v1/poddisruptionbudgets": (
        "PodDisruptionBudget",
        {"spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "theirs"}}}},
    ),
    "v1/configmaps": ("ConfigMap", {"data": {"settings": "theirs"}}),
    "v1/secrets": ("Secret", {"type": "Opaque", "data": {"token": "dGhlaXJzLXRva2Vu"}}),
    SERVICE_MONITORS: ("ServiceMonitor", {"spec": {"selector": {"matchLabels": {"app": "theirs"}}}}),
}


async def _create_foreign(emulator: RVEmulator, resource: str, name: str) -> None:
    kind, extra = FOREIGN[resource]
    group_version, plural = resource.rsplit("/", 1)
    prefix = "/api" if group_version == "v1" else "/apis"
    body = {
        "apiVersion": group_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "theirs"}},
        **copy.deepcopy(extra),
    }
    await emulator.post(f"{prefix}/{group_version}/namespaces/{NAMESPACE}/{plural}", json=body)


def _writes(emulator: RVEmulator, resource: str) -> int:
    """Requests that create, change or delete objects of this resource."""
    return sum(len(emulator[verb, kmock.resource(resource)]) for verb in ("post", "patch", "put", "delete"))


def _conflicted(emulator: RVEmulator, name: str) -> dict[str, Any] | None:
    condition = _condition(_get(emulator, SERVINGS, name), "Conflict")
    return condition if condition and condition["status"] == "True" else None


async def test_foreign_objects_under_the_childrens_names_are_never_touched(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    for resource, pattern in CHILDREN.items():
        await _create_foreign(kube_emulator, resource, pattern.format(name="llama"))
    before = _children(kube_emulator, "llama")
    writes_before = {resource: _writes(kube_emulator, resource) for resource in CHILDREN}
    path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
    async with operator_runner():
        await _create(kube_emulator, _resource())
        condition = await eventually(lambda: _conflicted(kube_emulator, "llama"))
        await eventually(lambda: len(_events(kube_emulator, "Conflict")) >= len(CHILDREN))
        events = _events(kube_emulator, "Conflict")
        await kube_emulator.delete(path)
        await eventually(lambda: _get(kube_emulator, SERVINGS, "llama") is None)
    # nothing was created, patched, adopted or deleted: the objects are exactly as their owner left them
    assert {resource: _writes(kube_emulator, resource) for resource in CHILDREN} == writes_before
    assert _children(kube_emulator, "llama") == before
    assert all(not (child or {})["metadata"].get("ownerReferences") for child in before.values())
    objects = [f"{kind} {CHILDREN[res].format(name='llama')}" for res, (kind, _) in FOREIGN.items()]
    assert condition["reason"] == "ForeignObject"
    assert all(o in condition["message"] for o in objects), condition["message"]
    assert all(any(o in e["message"] for e in events) for o in objects), [e["message"] for e in events]
    assert {e["type"] for e in events} == {"Warning"}


async def test_a_conflict_stops_only_its_own_resource_and_clears_when_the_name_is_free(
    kube_emulator: RVEmulator, operator_runner, monkeypatch
) -> None:
    monkeypatch.setattr(reconciler, "CONFLICT_RETRY_S", 1)
    await _create_foreign(kube_emulator, "v1/secrets", "llama-control-token")
    async with operator_runner():
        await _create(kube_emulator, _resource("llama"))
        await _create(kube_emulator, _resource("other"))
        other = await eventually(lambda: _deployed(kube_emulator, "other"))
        condition = await eventually(lambda: _conflicted(kube_emulator, "llama"))
        assert "Secret llama-control-token" in condition["message"]
        assert _condition(_get(kube_emulator, SERVINGS, "llama"), "Deployed")["reason"] == "Conflict"
        # the colliding resource made nothing at all, not even the children whose names were free
        assert all(
            child is None for res, child in _children(kube_emulator, "llama").items() if res != "v1/secrets"
        )
        await kube_emulator.delete(f"/api/v1/namespaces/{NAMESPACE}/secrets/llama-control-token")
        llama = await eventually(lambda: _deployed(kube_emulator, "llama"))
    assert _condition(other, "Conflict")["status"] == "False"
    assert _condition(llama, "Conflict")["status"] == "False"
    uid = llama["metadata"]["uid"]
    for res, child in _children(kube_emulator, "llama").items():
        assert [o["uid"] for o in child["metadata"]["ownerReferences"]] == [uid], res
    secret = _get(kube_emulator, "v1/secrets", "llama-control-token")
    assert secret["stringData"]["token"] != "theirs-token"  # a token of its own, not the foreign one


async def test_without_secret_access_the_condition_says_where_to_grant_it_and_deletion_works(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    """A namespace outside the chart's secretNamespaces: no Secret can be read or made there."""
    kube_emulator["get", kmock.resource("v1/secrets")] << kmock.KubernetesError(
        status=403, reason="Forbidden", message='secrets "llama-control-token" is forbidden'
    )
    async with operator_runner():
        await _create(kube_emulator, _resource())

        def failed() -> dict[str, Any] | None:
            condition = _condition(_get(kube_emulator, SERVINGS, "llama"), "Deployed")
            return condition if condition and condition["status"] == "False" else None

        condition = await eventually(failed)
        await kube_emulator.delete(
            f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
        )
        await eventually(lambda: _get(kube_emulator, SERVINGS, "llama") is None)
    assert condition["reason"] == "ApplyFailed"
    assert "operator.secretNamespaces" in condition["message"] and "docs/install.md" in condition["message"]
    assert _children(kube_emulator, "llama") == dict.fromkeys(CHILDREN)


async def test_invalid_resource_gets_a_condition_and_an_event_and_no_children(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    bad = _resource("broken")
    bad["spec"]["drafters"][0]["placement"] = "separateGpu"  # eagle3 cannot run in the sidecar
    async with operator_runner():
        await _create(kube_emulator, bad)

        def invalid() -> dict[str, Any] | None:
            condition = _condition(_get(kube_emulator, SERVINGS, "broken"), "Invalid")
            return condition if condition and condition["status"] == "True" else None

        condition = await eventually(invalid)
        events = await eventually(lambda: _events(kube_emulator, "Invalid"))
    assert "spec.drafters[0].placement" in condition["message"]
    assert condition["reason"] == "InvalidSpec"
    assert "spec.drafters[0].placement" in events[0]["message"]
    assert events[0]["type"] == "Warning"
    assert _get(kube_emulator, SERVINGS, "broken")["status"]["phase"] == "Failed"
    assert _children(kube_emulator, "broken") == dict.fromkeys(CHILDREN)


async def test_fixing_an_invalid_resource_deploys_it(kube_emulator: RVEmulator, operator_runner) -> None:
    bad = _resource("fixme")
    bad["spec"]["speculation"]["defaultDrafter"] = "nope"
    async with operator_runner():
        await _create(kube_emulator, bad)
        await eventually(
            lambda: (
                (_condition(_get(kube_emulator, SERVINGS, "fixme"), "Invalid") or {}).get("status") == "True"
            )
        )
        path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/fixme"
        await kube_emulator.patch(
            path,
            json={"spec": {"speculation": {"defaultDrafter": "ngram"}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        serving = await eventually(lambda: _deployed(kube_emulator, "fixme"))
    assert _condition(serving, "Invalid")["status"] == "False"
    assert all(child is not None for child in _children(kube_emulator, "fixme").values())


async def test_a_restarted_operator_creates_no_duplicates(kube_emulator: RVEmulator, operator_runner) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
    posts_before = {res: _posts(kube_emulator, res) for res in CHILDREN}
    patches_before = len(kube_emulator["patch", kmock.resource("apps/v1/deployments")])
    async with operator_runner():
        # the resumed reconcile re-applies (patches) the Deployment; wait for that, then stop
        await eventually(
            lambda: len(kube_emulator["patch", kmock.resource("apps/v1/deployments")]) > patches_before
        )
    assert {res: _posts(kube_emulator, res) for res in CHILDREN} == posts_before
    assert all(count == 1 for count in posts_before.values()), posts_before
    assert kube_emulator["post", kmock.resource("apps/v1/deployments")][0].data["metadata"]["name"] == "llama"


async def test_deployment_progress_reaches_the_status(kube_emulator: RVEmulator, operator_runner) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
        # a real cluster's Deployment controller would report its pods; here the test does
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llama/status"
        status = {"replicas": 4, "updatedReplicas": 4, "readyReplicas": 4, "availableReplicas": 4}
        await kube_emulator.patch(
            path, json={"status": status}, headers={"Content-Type": "application/merge-patch+json"}
        )

        def ready() -> dict[str, Any] | None:
            serving = _get(kube_emulator, SERVINGS, "llama")
            return serving if serving["status"]["phase"] == "Ready" else None

        serving = await eventually(ready)
    assert serving["status"]["readyReplicas"] == 4
    assert _condition(serving, "Ready")["status"] == "True"


async def test_without_the_prometheus_operator_no_service_monitor(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    del kube_emulator.resources[SERVICE_MONITORS]
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
    children = _children(kube_emulator, "llama")
    assert children.pop(SERVICE_MONITORS) is None
    assert all(child is not None for child in children.values())


async def test_speculation_off_without_drafters_has_no_sidecar_objects(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    resource = yaml.safe_load((REPO / "examples" / "mistral-speculation-off.yaml").read_text())
    resource["metadata"]["namespace"] = NAMESPACE
    async with operator_runner():
        await _create(kube_emulator, copy.deepcopy(resource))
        await eventually(lambda: _deployed(kube_emulator, "mistral-small-baseline"))
    children = _children(kube_emulator, "mistral-small-baseline")
    assert children["v1/configmaps"] is None and children["v1/secrets"] is None
    assert [c["name"] for c in children["apps/v1/deployments"]["spec"]["template"]["spec"]["containers"]] == [
        "engine"
    ]


async def test_a_failing_api_call_gets_an_event_and_a_condition(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    kube_emulator["post", kmock.resource("apps/v1/deployments")] << kmock.KubernetesError(
        status=403, reason="Forbidden", message="deployments is forbidden"
    )
    async with operator_runner():
        await _create(kube_emulator, _resource())

        def failed() -> dict[str, Any] | None:
            condition = _condition(_get(kube_emulator, SERVINGS, "llama"), "Deployed")
            return condition if condition and condition["status"] == "False" else None

        condition = await eventually(failed)
        events = await eventually(lambda: _events(kube_emulator, "ApplyFailed"))
    assert condition["reason"] == "ApplyFailed"
    assert "403" in condition["message"] and "forbidden" in condition["message"]
    assert events[0]["type"] == "Warning"


async def test_liveness_endpoint_answers(
    kube_emulator: RVEmulator, operator_runner, unused_tcp_port: int
) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}/healthz"
    async with operator_runner(liveness_endpoint=url), aiohttp.ClientSession() as session:

        async def probe() -> dict[str, Any]:
            async with session.get(url) as response:
                assert response.status == 200
                return await response.json()

        body = None
        for _ in range(100):
            try:
                body = await probe()
                break
            except (aiohttp.ClientError, AssertionError):
                await asyncio.sleep(0.1)
    assert body is not None and body.get("kubernetes") is True


async def test_an_update_that_breaks_the_resource_changes_no_child(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
        before = _children(kube_emulator, "llama")
        writes_before = len(kube_emulator["patch", kmock.resource("apps/v1/deployments")])
        path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
        broken = {"spec": {"engine": {"image": "engine:9"}, "speculation": {"batchBuckets": [8, 4]}}}
        await kube_emulator.patch(path, json=broken, headers={"Content-Type": "application/merge-patch+json"})

        def invalid() -> dict[str, Any] | None:
            condition = _condition(_get(kube_emulator, SERVINGS, "llama"), "Invalid")
            return condition if condition and condition["status"] == "True" else None

        condition = await eventually(invalid)
    assert "spec.speculation.batchBuckets" in condition["message"]
    assert len(kube_emulator["patch", kmock.resource("apps/v1/deployments")]) == writes_before
    assert _children(kube_emulator, "llama") == before


async def test_a_reconcile_keeps_the_controllers_rollout(kube_emulator: RVEmulator, operator_runner) -> None:
    async with operator_runner():
        await _create(kube_emulator, _resource())
        await eventually(lambda: _deployed(kube_emulator, "llama"))
        path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/llama"
        merge = {"Content-Type": "application/merge-patch+json"}
        # The controller moved the fleet to the n-gram drafter; then a person scales the resource.
        await kube_emulator.patch(
            f"{path}/status", json={"status": {"activeDrafter": "ngram"}}, headers=merge
        )
        await kube_emulator.patch(path, json={"spec": {"replicas": 5}}, headers=merge)

        def scaled() -> dict[str, Any] | None:
            deployment = _get(kube_emulator, "apps/v1/deployments", "llama")
            return deployment if deployment["spec"]["replicas"] == 5 else None

        deployment = await eventually(scaled)
    engine = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    config = json.loads(engine["args"][engine["args"].index("--speculative-config") + 1])
    assert config["method"] == "ngram"
