"""The controller inside the operator: kopf (all handler modules) against the kmock API server, a real
Prometheus holding the pods' history, and real sidecars (tests/tuner/conftest.py) at the pods' addresses."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import time
from typing import Any

import jsonschema
import kmock
import pytest
from prometheus_client import REGISTRY
from rich.console import Console

from specserve_engine import metric_names
from specserve_operator import cli, status_cli
from specserve_operator.api import crd
from specserve_operator.api.models import parse_spec
from specserve_operator.render import children as render
from specserve_operator.tuner import timer
from specserve_testing.kmock_emulator import NAMESPACE, SERVINGS, RVEmulator, eventually, pod_object

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="prometheus and promtool are not installed (scripts/setup.sh installs them)",
    ),
]
NAME = "llm"
PODS = ("llm-engine-0", "llm-engine-1")


def _loopback_hosts() -> tuple[str, str]:
    """Two loopback addresses (all of 127/8 reaches this host) free on the sidecar port, one per pod."""
    base = 20 + os.getpid() % 200
    hosts = []
    for i in range(1, 250):
        host = f"127.{base}.{i}.1"
        with socket.socket() as s:
            try:
                s.bind((host, render.SIDECAR_PORT))
            except OSError:
                continue
        hosts.append(host)
        if len(hosts) == 2:
            return hosts[0], hosts[1]
    pytest.skip("no free loopback address for the sidecar port")


@pytest.fixture
def resource(spec_body_factory) -> dict[str, Any]:
    """The controller tests' resource with its first drafter only, evaluated every second."""
    spec = spec_body_factory(
        speculation={"evaluationInterval": "1s", "cooldown": "5m"}, monitoring={"serviceMonitor": False}
    )
    spec["drafters"] = spec["drafters"][:1]
    return {
        "apiVersion": "specserve.io/v1alpha1",
        "kind": "SpeculativeServing",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": spec,
    }


def _serving(emulator: RVEmulator) -> dict[str, Any]:
    return dict(emulator.objects[(kmock.resource(SERVINGS), NAMESPACE, NAME)].raw)


def _token(emulator: RVEmulator) -> str | None:
    key = (kmock.resource("v1/secrets"), NAMESPACE, render.names(NAME)["secret"])
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    secret = emulator.objects[key].raw
    return (secret.get("stringData") or {}).get(render.TOKEN_KEY)


def _condition(serving: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next(
        (c for c in (serving.get("status") or {}).get("conditions") or [] if c["type"] == type_), None
    )


@pytest.fixture
def history(rows_for, bucket_load, openmetrics_of, spec_factory) -> str:
    """Ten minutes of both pods: speculating at batch ≤ 4, plain and far slower per token at batch 64."""
    from specserve_operator.tuner.core import ResourceView

    spec = spec_factory()
    prior = ResourceView(NAMESPACE, NAME, spec, PODS).prior(spec.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=6000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=3000, step_s_plain=prior.step_s(50, 0)),
    }
    rows = [r for pod in PODS for r in rows_for(NAMESPACE, pod, "draft", loads, running=3)]
    end = time.time() - 5
    return openmetrics_of(rows, end - 600, end)


async def _start_fleet(emulator: RVEmulator, sidecars, resource: dict[str, Any]) -> list:
    await emulator.post(
        f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings", json=resource
    )
    token = await eventually(lambda: _token(emulator), timeout=30)
    spec = parse_spec(resource["spec"])
    stands = []
    for pod, host in zip(PODS, _loopback_hosts(), strict=True):
        stands.append(await sidecars(spec=spec, host=host, port=render.SIDECAR_PORT, token=token))
        await emulator.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod_object(pod, NAME, host))
    return stands


async def test_operator_pushes_a_policy_learned_from_prometheus(
    kube_emulator: RVEmulator, operator_runner, prometheus_factory, history, sidecars, resource, monkeypatch
) -> None:
    prom = prometheus_factory(openmetrics=history)
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", prom.url)
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        serving = await eventually(
            lambda: (
                _serving(kube_emulator)
                if (_serving(kube_emulator).get("status") or {}).get("kByBucket")
                else None
            ),
            timeout=60,
        )
        status = serving["status"]
        assert _condition(serving, "MetricsAvailable")["status"] == "True"
        assert status["activeDrafter"] == "draft"
        assert status["kByBucket"]["4"] > 0
        assert status["fleet"]["meanAcceptedLength"] > 2.0
        assert {p["name"] for p in status["pods"]} == set(PODS)
        assert status["lastDecision"]["action"] in {"enable", "setK", "disable", "trial", "explore"}
        await eventually(lambda: all(s.puts for s in stands), timeout=30)
        for s in stands:
            assert s.policy["kByBucket"]["4"] > 0 and s.policy["drafter"] == "draft"

        def policy_events() -> list:
            return [
                o.raw
                for (res, _, _), o in kube_emulator.objects.items()
                if res.plural == "events" and str(o.raw.get("reason", "")).startswith("Policy")
            ]

        # kopf posts events from a queue of its own: they arrive a moment after the status.
        await eventually(policy_events, timeout=30)


async def test_prometheus_down_marks_the_condition_and_pushes_nothing(
    kube_emulator: RVEmulator, operator_runner, sidecars, resource, monkeypatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", f"http://127.0.0.1:{closed}")
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        serving = await eventually(
            lambda: (
                _serving(kube_emulator) if _condition(_serving(kube_emulator), "MetricsAvailable") else None
            ),
            timeout=60,
        )
        cond = _condition(serving, "MetricsAvailable")
        assert (cond["status"], cond["reason"]) == ("False", "PrometheusDown")
        assert not (serving.get("status") or {}).get("kByBucket")
        assert all(not s.puts for s in stands)


async def _patch_mode(emulator: RVEmulator, mode: str) -> None:
    await emulator.patch(
        f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/{NAME}",
        json={"spec": {"speculation": {"mode": mode}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )


def _events(emulator: RVEmulator, prefix: str) -> list[dict[str, Any]]:
    return [
        o.raw
        for (res, _, _), o in emulator.objects.items()
        if res.plural == "events" and str(o.raw.get("reason", "")).startswith(prefix)
    ]


async def _specserve_status(*args: str) -> dict[str, Any]:
    """`specserve status ... -o json` in-process (its own event loop, in a thread: kmock serves this one)."""
    out = io.StringIO()
    parsed = cli.build_parser().parse_args(["status", *args, "-o", "json"])
    code = await asyncio.to_thread(status_cli.run, parsed, Console(file=out, width=200))
    assert code == 0
    return json.loads(out.getvalue())


async def test_advise_mode_pushes_nothing_shows_the_recommendation_and_auto_applies_it(
    kube_emulator: RVEmulator, operator_runner, prometheus_factory, history, sidecars, resource, monkeypatch
) -> None:
    resource["spec"]["speculation"]["mode"] = "advise"
    prom = prometheus_factory(openmetrics=history)
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", prom.url)
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        serving = await eventually(
            lambda: (
                _serving(kube_emulator)
                if (_serving(kube_emulator).get("status") or {}).get("recommendation")
                else None
            ),
            timeout=60,
        )
        await eventually(lambda: _events(kube_emulator, "Advise"), timeout=30)
        await asyncio.sleep(3)  # a few more ticks: still nothing pushed
        status = _serving(kube_emulator)["status"]
        recommendation = status["recommendation"]
        assert recommendation["mode"] == "advise" and recommendation["drafter"] == "draft"
        assert recommendation["kByBucket"]["4"] > 0 and recommendation["predictedGain"] > 1.0
        assert "kByBucket" not in status and "activeDrafter" not in status  # nothing in force changed
        assert all(not s.puts for s in stands)
        applied = _condition(serving, "PoliciesApplied")
        assert (applied["status"], applied["reason"]) == ("False", "AdviseOnly")
        event = _events(kube_emulator, "Advise")[0]
        assert "recommend drafter draft" in event["message"] and "predicted gain" in event["message"]
        assert status["lastDecision"]["action"].startswith("advise:")
        # what the operator wrote fits the CRD's status schema (a real API server would prune the rest)
        jsonschema.Draft4Validator(crd.open_api_schema()["properties"]["status"]).validate(status)
        shown = await _specserve_status(NAME, "-n", NAMESPACE)
        assert shown["mode"] == "advise" and shown["predictedGain"] == recommendation["predictedGain"]
        by_bucket = {b["bucket"]: b for b in shown["buckets"]}
        assert by_bucket["4"]["recommendedK"] == recommendation["kByBucket"]["4"]
        assert by_bucket["4"]["k"] is None  # nothing in force yet
        assert any(d["action"].startswith("Advise") for d in shown["decisions"])

        # advise -> auto: the next tick puts the recommendation in force on every pod.
        await _patch_mode(kube_emulator, "auto")
        await eventually(lambda: all(s.puts for s in stands), timeout=30)
        for s in stands:
            assert s.policy["kByBucket"] == recommendation["kByBucket"]
        status = await eventually(
            lambda: (s := _serving(kube_emulator)["status"]).get("kByBucket") and s, timeout=30
        )
        assert status["kByBucket"] == recommendation["kByBucket"] and status["activeDrafter"] == "draft"
        await eventually(
            lambda: any("advise mode" in e["message"] for e in _events(kube_emulator, "Policy")), timeout=30
        )
        shown = await _specserve_status(NAME, "-n", NAMESPACE)
        assert shown["mode"] == "auto" and shown["policyVersion"] == status["policyVersion"]
        assert {p["name"] for p in shown["pods"]} == set(PODS)
        assert all(p["policyVersion"] == 1 for p in shown["pods"])  # what the history's sidecars report

        # auto -> advise: the pods keep the policy in force; nothing more is pushed.
        await _patch_mode(kube_emulator, "advise")
        await eventually(
            lambda: _serving(kube_emulator)["status"]["recommendation"]["mode"] == "advise", timeout=30
        )
        puts = [len(s.puts) for s in stands]
        await asyncio.sleep(3)
        assert [len(s.puts) for s in stands] == puts
        assert _serving(kube_emulator)["status"]["kByBucket"] == status["kByBucket"]


def _secret_path() -> str:
    return f"/api/v1/namespaces/{NAMESPACE}/secrets/{render.names(NAME)['secret']}"


def _in_force(emulator: RVEmulator, stands: list) -> bool:
    """Every sidecar runs the policy the status says is in force."""
    status = _serving(emulator).get("status") or {}
    return bool(status.get("kByBucket")) and all(
        (s.policy["policyVersion"], s.policy["kByBucket"]) == (status["policyVersion"], status["kByBucket"])
        for s in stands
    )


async def test_a_restarted_sidecar_a_rotated_token_and_a_deleted_secret_are_caught_up(
    kube_emulator: RVEmulator, operator_runner, prometheus_factory, history, sidecars, resource, monkeypatch
) -> None:
    prom = prometheus_factory(openmetrics=history)
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", prom.url)
    monkeypatch.setattr(timer, "TOKEN_TTL_S", 1.0)  # a deleted Secret is noticed within a second
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=60)

        # A sidecar restarts at its start-up policy (version 0): it is given the policy again.
        await stands[0].restart()
        assert not _in_force(kube_emulator, stands)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=20)
        restored = await eventually(lambda: _events(kube_emulator, "PolicyRestored"), timeout=20)
        assert restored[0]["message"].startswith(f"{PODS[0]}: ran policy version 0")

        # The Secret is rotated and the sidecars take the new token up: one 401, re-read, pushed.
        await kube_emulator.patch(
            _secret_path(),
            json={"stringData": {render.TOKEN_KEY: "rotated-token"}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        await asyncio.gather(*(s.restart(token="rotated-token") for s in stands))
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=20)
        assert not [e for e in _events(kube_emulator, "SidecarUnreachable") if "token" in e["message"]]

        # The Secret is deleted: the operator makes it again, with a new token of the resource's own.
        await kube_emulator.delete(_secret_path())
        token = await eventually(lambda: (t := _token(kube_emulator)) not in (None, "rotated-token") and t)
        secret = kube_emulator.objects[
            (kmock.resource("v1/secrets"), NAMESPACE, render.names(NAME)["secret"])
        ]
        owners = [o["uid"] for o in secret.raw["metadata"]["ownerReferences"]]
        assert owners == [_serving(kube_emulator)["metadata"]["uid"]]
        await eventually(lambda: _events(kube_emulator, "ControlTokenRecreated"), timeout=20)
        for s in stands:
            await s.restart(token=token)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=20)


def _recommended_k() -> float | None:
    """The operator's recommended-K series for the resource (it runs in this process)."""
    labels = {"namespace": NAMESPACE, "name": NAME, "mode": "auto", "drafter": "draft", "bucket": "4"}
    return REGISTRY.get_sample_value(metric_names.OPERATOR_RECOMMENDED_K.name, labels)


async def test_a_resource_made_again_under_its_name_inherits_no_state_and_no_token(
    kube_emulator: RVEmulator, operator_runner, prometheus_factory, history, sidecars, resource, monkeypatch
) -> None:
    prom = prometheus_factory(openmetrics=history)
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", prom.url)
    path = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings/{NAME}"
    key = (kmock.resource(SERVINGS), NAMESPACE, NAME)
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=60)
        old_token = _token(kube_emulator)
        assert _recommended_k() is not None
        await kube_emulator.delete(path)
        await eventually(lambda: kube_emulator.objects[key].deleted, timeout=30)
        assert _recommended_k() is None  # forgotten: the operator exports nothing more about it
        await kube_emulator.post(path.rsplit("/", 1)[0], json=resource)
        token = await eventually(
            lambda: (t := _token(kube_emulator)) not in (None, old_token) and t, timeout=30
        )
        for s in stands:  # the new resource's pods: started with its own Secret
            await s.restart(token=token)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=30)
        uid = _serving(kube_emulator)["metadata"]["uid"]

        def decided_afresh() -> list:
            # The old resource's state would make the first decision a `hold`: no Policy Event for it.
            return [e for e in _events(kube_emulator, "Policy") if e["involvedObject"]["uid"] == uid]

        await eventually(decided_afresh, timeout=20)


async def test_a_failing_tick_gives_the_resource_a_condition_and_an_event(
    kube_emulator: RVEmulator, operator_runner, prometheus_factory, history, sidecars, resource, monkeypatch
) -> None:
    prom = prometheus_factory(openmetrics=history)
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", prom.url)
    monkeypatch.setattr(timer, "TOKEN_TTL_S", 0.5)  # the Secret is read at every tick
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=60)
        kube_emulator["get", kmock.resource("v1/secrets")] << kmock.KubernetesError(
            status=500, reason="InternalError", message="etcd is having a bad day"
        )
        failed = await eventually(
            lambda: (
                (c := _condition(_serving(kube_emulator), "DecisionFailed")) and c["status"] == "True" and c
            ),
            timeout=20,
        )
        assert "etcd is having a bad day" in failed["message"]
        events = await eventually(lambda: _events(kube_emulator, "DecisionFailed"), timeout=20)
        await asyncio.sleep(6)  # another tick, the same failure: no second Event
        assert len(_events(kube_emulator, "DecisionFailed")) == len(events) == 1
        assert _in_force(kube_emulator, stands)  # fail static: the pods keep their policy


async def test_a_warning_about_the_resource_is_an_event_once_not_every_interval(
    kube_emulator: RVEmulator, operator_runner, prometheus_factory, history, sidecars, resource, monkeypatch
) -> None:
    resource["spec"]["engine"]["gpu"]["product"] = "NVIDIA-A100-SXM4-80GB"  # not in the cost model
    prom = prometheus_factory(openmetrics=history)
    monkeypatch.setenv("SPECSERVE_PROMETHEUS_URL", prom.url)
    async with operator_runner():
        stands = await _start_fleet(kube_emulator, sidecars, resource)
        await eventually(lambda: _in_force(kube_emulator, stands), timeout=60)
        events = await eventually(lambda: _events(kube_emulator, "UnknownGpu"), timeout=20)
        assert "NVIDIA-A100-SXM4-80GB" in events[0]["message"]
        await asyncio.sleep(6)  # another evaluation with the same warning
        assert len(_events(kube_emulator, "UnknownGpu")) == 1
