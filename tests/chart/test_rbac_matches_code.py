"""The chart's RBAC grants exactly what the operator's code uses: the API calls its handlers make (run
here with a recording API client on every example resource), the resources its kopf handlers watch and
patch, and kopf's own needs (peering, CRD and namespace discovery, events). A permission the code does
not use, or a call the chart does not permit, fails the test. Secrets are granted only by Roles in
listed namespaces, never by a ClusterRole (docs/install.md)."""

from __future__ import annotations

import logging
import re
from typing import Any

import kopf
import pytest
import yaml
from chart.helm import CI_VALUES, REPO, find, render

from specserve_operator import reconciler, runner
from specserve_operator.kube import Connection, KubeApi

Permission = tuple[str, str, str]  # (API group, resource, verb)

# What kopf itself needs, whatever the handlers do: CRD and namespace discovery, and the peering object
# (cluster-wide, or one per watched namespace).
KOPF_DISCOVERY: set[Permission] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
}
PEERING_VERBS = ("get", "list", "watch", "patch")
MODES = {
    "cluster-wide": (
        ["--set", "operator.secretNamespaces={ml}"],
        {("kopf.dev", "clusterkopfpeerings", v) for v in PEERING_VERBS},
    ),
    "namespaced": (
        ["--set", "operator.watchNamespaces={inference,research}"],
        {("kopf.dev", "kopfpeerings", v) for v in PEERING_VERBS},
    ),
    "standalone": (["--set", "peering.enabled=false", "--set", "operator.secretNamespaces={ml}"], set()),
}
PATH = re.compile(r"^/(?:api|apis/(?P<group>[^/]+))/(?P<version>v[^/]+)(?:/namespaces/[^/]+)?/(?P<rest>.+)$")


class RecordingKube(KubeApi):
    """A KubeApi that answers like a cluster with the Prometheus Operator, holding what is created in
    memory (so a later call finds it, as the operator's ownership checks need), and records every call."""

    def __init__(self) -> None:
        super().__init__(Connection(server="http://recording.invalid"))
        self.permissions: set[Permission] = set()
        self.objects: dict[str, dict[str, Any]] = {}

    async def _request(
        self, method: str, path: str, *, body: Any = None, content_type: str = "", **_: Any
    ) -> dict[str, Any]:
        match = PATH.match(path)
        if match is None:  # discovery (/apis/group/version): allowed to every authenticated client
            return {"resources": [{"name": "servicemonitors"}]}
        group, parts = match.group("group") or "", match.group("rest").split("/")
        resource = parts[0] + ("/" + parts[2] if len(parts) == 3 else "")
        verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}.get(method)
        if verb is None:
            verb = "get" if len(parts) >= 2 else "list"
        self.permissions.add((group, resource, verb))
        if method == "POST":
            stored = {**body, "metadata": {"uid": f"uid-{len(self.objects)}", **body["metadata"]}}
            self.objects[f"{path}/{body['metadata']['name']}"] = stored
            return stored
        if method == "DELETE":
            self.objects.pop(path, None)
        if method == "GET" and len(parts) >= 2:
            if parts[0] == "speculativeservings":  # the owner a Deployment event refers to
                return {"metadata": {"name": parts[1], "uid": "u-1"}, "status": {"observedGeneration": 1}}
            if path not in self.objects:
                from specserve_operator.kube import KubeError

                raise KubeError(404, "not found")
            return self.objects[path]
        return body or {}


def _examples() -> list[dict]:
    docs = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        docs += [
            d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "SpeculativeServing"
        ]
    assert len(docs) >= 4
    return docs


async def _exercise_handlers(kube: RecordingKube, monkeypatch: pytest.MonkeyPatch) -> set[Permission]:
    events: list[str] = []
    monkeypatch.setattr(kopf, "info", lambda *a, **k: events.append("info"))
    monkeypatch.setattr(kopf, "warn", lambda *a, **k: events.append("warn"))
    memo = kopf.Memo(kube=kube, options=reconciler.render_options_from_env({}))
    logger = logging.getLogger("rbac-test")
    for resource in _examples():
        meta = {"namespace": "ml", "uid": "u-1", "generation": 1, **resource["metadata"]}
        body = kopf.Body({**resource, "metadata": meta})
        for _ in range(2):  # the first reconcile creates the children, the second patches them
            await reconciler.reconcile(
                body=body,
                spec=body.spec,
                name=meta["name"],
                namespace=meta["namespace"],
                meta=body.metadata,
                status=body.status,
                patch=kopf.Patch(),
                memo=memo,
                logger=logger,
            )
        await reconciler.delete_children(name=meta["name"], namespace=meta["namespace"], body=body, memo=memo)
        deployment = kopf.Body(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "ownerReferences": [
                        {
                            "apiVersion": reconciler.API_VERSION,
                            "kind": reconciler.KIND,
                            "name": meta["name"],
                            "uid": "u-1",
                        }
                    ],
                },
                "spec": {"replicas": 2},
                "status": {"replicas": 2, "readyReplicas": 1},
            }
        )
        await reconciler.deployment_changed(
            body=deployment, type="MODIFIED", namespace=meta["namespace"], memo=memo
        )
    needed = set(kube.permissions)
    if events:  # kopf posts them as core/v1 Events
        needed.add(("", "events", "create"))
    return needed


def _watched_by_kopf() -> set[Permission]:
    runner.load_handlers()
    registry = kopf.get_default_registry()
    needed: set[Permission] = set()
    # Watching and indexing handlers only watch; changing handlers and timers/daemons (spawning) also
    # patch the object (finalizers, progress annotations) and its status (their results).
    kinds = {"_watching": False, "_indexing": False, "_changing": True, "_spawning": True}
    for attr, patches in kinds.items():
        for handler in getattr(registry, attr).get_all_handlers():
            group, plural = handler.selector.group or "", handler.selector.plural or handler.selector.any_name
            needed |= {(group, plural, "list"), (group, plural, "watch")}
            if patches:
                needed |= {(group, plural, "patch"), (group, f"{plural}/status", "patch")}
    unknown = set(vars(registry)) - set(kinds) - {"_activities", "_webhooks"}
    assert not unknown, f"kopf registry has handler kinds this test does not know: {unknown}"
    assert not registry._webhooks.get_all_handlers(), (
        "admission webhooks need more permissions: extend this test"
    )
    return needed


def _granted(*args: str) -> set[Permission]:
    """What the chart's ClusterRoles and Roles grant, in any namespace."""
    objects = render(*args)
    granted: set[Permission] = set()
    for role in find(objects, "ClusterRole") + find(objects, "Role"):
        for rule in role["rules"]:
            granted |= {
                (g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
            }
    return granted


def _static_calls() -> set[Permission]:
    """`kube.<verb>("apiVersion", "Kind", ...)` calls anywhere in the operator (the tuner's, say)."""
    verbs = {"get": "get", "list": "list", "create": "create", "apply": "patch"}
    verbs |= {"patch_status": "patch", "delete": "delete"}
    from specserve_operator.kube import PLURALS

    call = re.compile(r"\bkube\.(" + "|".join(verbs) + r")\(\s*\"([\w./]+)\",\s*\"(\w+)\"")
    found: set[Permission] = set()
    for path in (REPO / "operator").rglob("*.py"):
        if "local" in path.relative_to(REPO / "operator").parts:  # the local fleet runs no cluster
            continue
        if path.name == "status_cli.py":  # `specserve status` reads as the user (kubeconfig), not the chart
            continue
        for method, api_version, kind in call.findall(path.read_text()):
            group = api_version.rpartition("/")[0]
            plural = PLURALS[kind] + ("/status" if method == "patch_status" else "")
            found.add((group, plural, verbs[method]))
    return found


@pytest.mark.parametrize("mode", MODES)
async def test_rbac_grants_exactly_what_the_operator_uses(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    args, peering = MODES[mode]
    used = await _exercise_handlers(RecordingKube(), monkeypatch) | _watched_by_kopf() | _static_calls()
    used |= KOPF_DISCOVERY | peering
    granted = _granted(*args)
    assert not used - granted, f"the chart does not permit: {sorted(used - granted)}"
    assert not granted - used, f"granted but unused: {sorted(granted - used)}"


def test_recording_client_sees_calls() -> None:
    """The recorder maps API paths to RBAC permissions the way the API server does."""
    import asyncio

    kube = RecordingKube()
    asyncio.run(kube.list("v1", "Pod", "ml"))
    asyncio.run(kube.patch_status(reconciler.API_VERSION, "SpeculativeServing", "ml", "x", {}))
    asyncio.run(kube.get("apps/v1", "Deployment", "ml", "x"))
    assert kube.permissions == {
        ("", "pods", "list"),
        ("specserve.io", "speculativeservings/status", "patch"),
        ("apps", "deployments", "get"),
    }


SECRET_RULE_MODES = {
    "default": [],
    **{mode: args for mode, (args, _) in MODES.items()},
    **{path.name: ["-f", str(path)] for path in CI_VALUES},
}


@pytest.mark.parametrize("mode", SECRET_RULE_MODES)
def test_no_cluster_role_grants_secrets(mode: str) -> None:
    """Secrets only through Roles, each in one listed namespace and bound to the operator alone."""
    objects = render(*SECRET_RULE_MODES[mode])
    for role in find(objects, "ClusterRole"):
        for rule in role["rules"]:
            assert not ({"", "*"} & set(rule["apiGroups"]) and {"secrets", "*"} & set(rule["resources"])), (
                role["metadata"]["name"],
                rule,
            )
    for role in find(objects, "Role"):
        if any("secrets" in rule["resources"] for rule in role["rules"]):
            assert role["rules"] == [
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]}
            ]


@pytest.mark.parametrize(
    ("args", "namespaces"),
    [
        ([], []),
        (["--set", "operator.secretNamespaces={ml,research}"], ["ml", "research"]),
        (["--set", "operator.watchNamespaces={inference}"], ["inference"]),
        (
            ["--set", "operator.watchNamespaces={inference}", "--set", "operator.secretNamespaces={ml}"],
            ["inference"],
        ),
    ],
)
def test_secrets_are_granted_only_in_the_listed_namespaces(args: list[str], namespaces: list[str]) -> None:
    objects = render(*args)
    roles = [r for r in find(objects, "Role") if r["metadata"]["name"] == "specserve-secrets"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces
    bindings = [b for b in find(objects, "RoleBinding") if b["roleRef"]["kind"] == "Role"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == namespaces
    for binding in bindings:
        assert binding["roleRef"]["name"] == "specserve-secrets"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "specserve", "namespace": "specserve"}
        ]
