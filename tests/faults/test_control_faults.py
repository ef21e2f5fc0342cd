"""Faults around the control loop, one at a time: the operator (its own process, on kmock), real sidecars
at the pods' addresses, the real Prometheus behind a proxy that misbehaves on demand. Each scenario
checks what the issue asks of it: no draft call of a live sidecar fails, the policy in force afterwards,
the conditions and Events an operator would see, and nothing left behind (the `scenario` fixture).
What each fault looks like and what recovers it: docs/reliability.md."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from typing import Any

import numpy as np
import pytest

from specserve_engine import metric_names
from specserve_operator.render import children as render
from specserve_testing import fault_fleet as ff

pytestmark = pytest.mark.timeout(180)


def _valid_status(status: dict[str, Any]) -> None:
    """What the API server would accept: JSON without NaN or infinities, rates within the CRD's bounds."""
    json.dumps(status, allow_nan=False)
    fleet = status.get("fleet") or {}
    rate = fleet.get("acceptanceRate")
    assert rate is None or 0.0 <= rate <= 1.0, fleet


def _status_kept(status: dict[str, Any], before: dict[str, Any]) -> None:
    """The resource's status still names the policy it had `before`, and is valid."""
    assert (status["policyVersion"], status["kByBucket"]) == (before["policyVersion"], before["kByBucket"])
    _valid_status(status)


async def _start(fleet: ff.Fleet, pods: int = 2, name: str = ff.NAME, **resource: Any) -> list[ff.SidecarPod]:
    """The operator, one resource (auto mode unless told) on the proxy, its pods; wait until healthy."""
    await fleet.start_operator()
    await fleet.create(ff.resource(fleet.proxy.url, name=name, replicas=pods, **resource))
    started = await fleet.start_pods(pods, name=name)
    if resource.get("mode", "auto") == "auto":  # wait for the first decision from the data
        await ff.wait_for(lambda: fleet.status(name).get("policyVersion"), timeout=60)
    await fleet.healthy(name)
    return started


async def _unchanged(fleet: ff.Fleet, before: list[dict[str, Any] | None]) -> None:
    """Every pod still runs what it ran `before` (fail static); else fail with what the operator sees."""
    now = await fleet.states()
    if now != before:
        diff = [f"{_brief(b)} -> {_brief(a)}" for a, b in zip(now, before, strict=True)]
        raise AssertionError(f"the pods' policy changed: {diff}\n{await fleet.describe()}")


def _brief(state: dict[str, Any] | None) -> str:
    return "no answer" if state is None else f"v{state['policyVersion']} {state['mode']} {state['kByBucket']}"


def _unreachable_since(fleet: ff.Fleet, since: float) -> list[dict[str, Any]]:
    return [e for e in fleet.events("SidecarUnreachable") if _event_time(e) >= since]


def _event_time(event: dict[str, Any]) -> float:
    stamp = event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else 0.0


# ---- sidecars ----------------------------------------------------------------------------------------


async def test_sidecar_sigkill_and_restart_mid_switch(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """A drafter switch (n-gram -> the draft model) has reached a sidecar, which is loading the new
    drafter, when it is SIGKILLed; the kubelet restarts it at once with the file it started with (n-gram,
    version 0). The operator must notice the drift (the pod reports its policy) and push the switch
    again; the other pod must lose no draft call."""
    killed, survivor = await _start(fleet, mode="on", drafters=[dict(ff.NGRAM), dict(ff.TINY_DRAFT)])
    traffic = fleet.traffic_to(survivor)
    await fleet.patch_spec({"speculation": {"defaultDrafter": "tiny-draft"}})
    mid = await ff.wait_for(lambda: _switching(fleet, killed, "tiny-draft"), timeout=30, interval=0.02)
    killed.kill()
    restarted = time.monotonic()
    await asyncio.to_thread(killed.start)
    # it started from its file (the operator may have given it the switch again already)
    assert (killed.workdir / "sidecar.log").read_text().count("policy 0 in force: drafter=ngram") == 2
    states = await ff.wait_for(lambda: _all_on(fleet, ff.NAME, "tiny-draft"), timeout=30, interval=0.2)
    scenario.recovery_s = time.monotonic() - restarted
    scenario.notes.append(
        "killed while loading the drafter" if mid["pendingDrafter"] else "killed just after the switch"
    )
    await ff.wait_for(lambda: fleet.in_force(), timeout=30)
    await ff.wait_for(lambda: fleet.condition("PoliciesApplied", status="True"), timeout=30)
    restored = await ff.wait_for(
        lambda: [e for e in fleet.events("PolicyRestored") if e["message"].startswith(f"{killed.name}:")],
        timeout=30,
    )
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert {e["type"] for e in restored} == {"Warning"}
    status = fleet.status()
    assert [s["policyVersion"] for s in states] == [status["policyVersion"]] * 2
    assert status["activeDrafter"] == "tiny-draft"
    _valid_status(status)


async def _switching(fleet: ff.Fleet, pod: ff.SidecarPod, drafter: str) -> dict[str, Any] | None:
    """The pod's state once it has taken the switch to `drafter` (loading it, or done)."""
    state = await pod.state(fleet.session)
    if state is None or drafter not in (state["pendingDrafter"], state["drafter"]):
        return None
    return state


async def _mode_is(fleet: ff.Fleet, pod: ff.SidecarPod, mode: str) -> dict[str, Any] | None:
    state = await pod.state(fleet.session)
    return state if state is not None and state["mode"] == mode else None


# ---- Prometheus --------------------------------------------------------------------------------------

# fault -> the MetricsAvailable reason it must produce
UNAVAILABLE = {"down": "PrometheusDown", "hung": "PrometheusSlow", "garbage": "PrometheusGarbage"}


@pytest.mark.parametrize("fault", list(UNAVAILABLE))
async def test_prometheus(fleet: ff.Fleet, scenario: ff.Scenario, fault: str) -> None:
    """Prometheus refuses connections, accepts and never answers, or answers garbage: the controller
    decides nothing and pushes nothing (every pod keeps its policy), says why in MetricsAvailable and
    one Warning Event, and reads again once Prometheus is back (backing off meanwhile)."""
    scenario.name = f"prometheus_{fault}"
    pods = await _start(fleet)
    traffic = fleet.traffic_to(pods[0])
    before = await fleet.states()
    status_before = fleet.status()
    await fleet.proxy.set_fault(fault)
    cond = await ff.wait_for(lambda: fleet.condition("MetricsAvailable", status="False"), timeout=30)
    assert cond["reason"] == UNAVAILABLE[fault], cond
    await ff.wait_for(lambda: fleet.events("MetricsUnavailable"), timeout=30)
    await asyncio.sleep(3)  # three more ticks under the fault
    await _unchanged(fleet, before)
    _status_kept(fleet.status(), status_before)
    assert len(fleet.events("MetricsUnavailable")) == 1  # one Event per outage, not one per tick
    lifted = time.monotonic()
    await fleet.proxy.set_fault(None)
    await ff.wait_for(lambda: fleet.condition("MetricsAvailable", status="True"), timeout=60)
    scenario.recovery_s = time.monotonic() - lifted
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    await _unchanged(fleet, before)


# fault -> the reason the operator counts the rows it drops under
BAD_VALUES = {"inf": "non_finite", "negative": "negative"}


@pytest.mark.parametrize("fault", list(BAD_VALUES))
async def test_prometheus_bad_values(fleet: ff.Fleet, scenario: ff.Scenario, fault: str) -> None:
    """Prometheus answers values that parse but are wrong (+Inf accepted tokens; negative counters): the
    rows are dropped and counted, nothing they would imply is pushed (the pods keep their policy), the
    status stays valid JSON within the CRD's bounds, and a condition says why."""
    scenario.name = f"prometheus_{fault}"
    pods = await _start(fleet)
    traffic = fleet.traffic_to(pods[0])
    before = await fleet.states()
    status_before = fleet.status()
    await fleet.proxy.set_fault(fault)
    dropped = await ff.wait_for(lambda: _dropped_rows(fleet, BAD_VALUES[fault]), timeout=30)
    await asyncio.sleep(3)  # three more ticks under the fault
    await _unchanged(fleet, before)
    _status_kept(fleet.status(), status_before)
    cond = fleet.condition("MetricsAvailable")
    assert cond is not None and cond["status"] == "False", cond
    lifted = time.monotonic()
    await fleet.proxy.set_fault(None)
    await ff.wait_for(lambda: fleet.condition("MetricsAvailable", status="True"), timeout=60)
    scenario.recovery_s = time.monotonic() - lifted
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert dropped > 0
    await _unchanged(fleet, before)


async def _dropped_rows(fleet: ff.Fleet, reason: str) -> float:
    """The operator's count of Prometheus rows it rejected for `reason`."""
    samples = await fleet.operator.metrics(fleet.session)
    return ff.metric_sum(samples, metric_names.OPERATOR_DROPPED_ROWS.series[0], reason=reason)


async def test_prometheus_empty(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """Prometheus has nothing on the pods yet (a ServiceMonitor it never picked up): the pods keep the
    start-up policy (plain steps, the initial drafter named), the controller says it has no data
    (condition, Event) and changes nothing; once data arrives it decides and pushes."""
    await fleet.proxy.set_fault("empty")
    await fleet.start_operator()
    await fleet.create(ff.resource(fleet.proxy.url))
    pods = await fleet.start_pods(2)
    traffic = fleet.traffic_to(pods[0])
    startup = [await p.state(fleet.session) for p in pods]
    cond = await ff.wait_for(lambda: fleet.condition("MetricsAvailable", status="False"), timeout=30)
    await ff.wait_for(lambda: fleet.events("NoDecision"), timeout=30)
    await asyncio.sleep(3)  # three more ticks without data
    assert await fleet.states() == startup
    assert all(s["mode"] == "on" and not any(s["kByBucket"].values()) for s in startup)
    assert all(e["type"] == "Warning" for e in fleet.events("NoDecision"))
    status = fleet.status()
    assert not any((status.get("kByBucket") or {}).values()) or status["kByBucket"] == startup[0]["kByBucket"]
    _valid_status(status)
    assert "no metrics" in cond["message"] or "no data" in cond["message"].lower(), cond
    lifted = time.monotonic()
    await fleet.proxy.set_fault(None)
    await ff.wait_for(lambda: fleet.status().get("policyVersion"), timeout=60)  # decided from the data
    await fleet.healthy()
    scenario.recovery_s = time.monotonic() - lifted
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert fleet.condition("MetricsAvailable", status="True")


# ---- the operator and the resource -------------------------------------------------------------------


async def test_operator_restart_mid_rollout(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """A policy change is rolling out to three pods (one of them hung, so it is still under way) when
    the operator is SIGKILLed. Its successor resumes from status: every pod ends on the new policy, at
    one version, and no child object is created twice."""
    pods = await _start(fleet, pods=3, mode="on")
    traffic = fleet.traffic_to(pods[0])
    posts_before = len(fleet.emulator["post", ff.kmock.resource("apps/v1/deployments")])
    hung = pods[2]
    hung.pause()
    await fleet.patch_spec({"speculation": {"mode": "off"}})
    await ff.wait_for(lambda: _modes(fleet, pods[:2], "off"), timeout=30)
    fleet.operator.kill()
    hung.resume()
    assert (await hung.state(fleet.session))["mode"] == "on"  # the rollout had not reached it
    restarted = time.monotonic()
    await fleet.start_operator()
    states = await ff.wait_for(lambda: fleet.in_force(mode="off"), timeout=60, interval=0.2)
    scenario.recovery_s = time.monotonic() - restarted
    await ff.wait_for(lambda: fleet.condition("PoliciesApplied", status="True"), timeout=30)
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert len({s["policyVersion"] for s in states}) == 1
    assert states[0]["policyVersion"] == fleet.status()["policyVersion"]
    assert len(fleet.emulator["post", ff.kmock.resource("apps/v1/deployments")]) == posts_before
    _valid_status(fleet.status())


async def _modes(fleet: ff.Fleet, pods: list[ff.SidecarPod], mode: str) -> bool:
    states = [await p.state(fleet.session) for p in pods]
    return all(s is not None and s["mode"] == mode for s in states)


async def test_deleted_and_recreated_resource(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """A resource is deleted and created again under the same name: the new one starts afresh (its own
    token, policy versions from 1, nothing inherited from the old one's state) and a change to it reaches
    its pods."""
    await _start(fleet, mode="on")
    for mode in ("off", "on", "off"):  # a few policy versions the new resource must not continue from
        await fleet.patch_spec({"speculation": {"mode": mode}})
        await ff.wait_for(lambda: fleet.in_force(mode=mode), timeout=30)  # noqa: B023
    old = fleet.status()
    assert old["policyVersion"] >= 3
    old_token = ff.token_of(fleet.emulator)
    await fleet.delete()
    await ff.wait_for(lambda: not ff.serving(fleet.emulator), timeout=30)
    await ff.wait_for(lambda: ff.token_of(fleet.emulator) is None, timeout=30)
    await fleet.remove_pods()
    recreated = time.monotonic()
    await fleet.create(ff.resource(fleet.proxy.url, mode="off"))
    pods = await fleet.start_pods(2)
    traffic = fleet.traffic_to(pods[0])
    await fleet.healthy()  # the start-up policy (mode off, version 0)
    await fleet.patch_spec({"speculation": {"mode": "on"}})
    states = await ff.wait_for(lambda: fleet.in_force(mode="on"), timeout=30, interval=0.2)
    scenario.recovery_s = time.monotonic() - recreated
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    new_token = ff.token_of(fleet.emulator)
    assert new_token and new_token != old_token
    # The status is written after the push: wait for it (an old resource's state would show 4 or more).
    await ff.wait_for(lambda: fleet.status().get("policyVersion") == 1, timeout=30, interval=0.2)
    status = fleet.status()
    assert status["policyVersion"] == 1, status  # not continued from the old resource's state
    assert all(s["policyVersion"] == 1 for s in states)
    assert not fleet.events("SidecarUnreachable")  # no push with the old token
    _valid_status(status)


async def test_rotated_token(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """The control token is rotated (the Secret gets a new token; the kubelet updates the sidecars'
    files): the next change reaches every pod, with no push failing beyond one retry."""
    pods = await _start(fleet, mode="on")
    traffic = fleet.traffic_to(pods[0])
    secret = render.names(ff.NAME)["secret"]
    new = "rotated-" + "x" * 40
    rotated = time.monotonic()
    rotated_at = time.time()
    await fleet.emulator.patch(
        f"/api/v1/namespaces/{ff.NAMESPACE}/secrets/{secret}",
        json={"stringData": {render.TOKEN_KEY: new}},
        headers=ff.MERGE,
    )
    for pod in pods:
        pod.write_token(new)
    await ff.wait_for(lambda: _answers_with(fleet, pods, new), timeout=30)  # the sidecars use it
    await fleet.patch_spec({"speculation": {"mode": "off"}})
    await ff.wait_for(lambda: fleet.in_force(mode="off"), timeout=30, interval=0.2)
    scenario.recovery_s = time.monotonic() - rotated
    await ff.wait_for(lambda: fleet.condition("PoliciesApplied", status="True"), timeout=30)
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert _unreachable_since(fleet, rotated_at - 1) == []
    _valid_status(fleet.status())


async def _answers_with(fleet: ff.Fleet, pods: list[ff.SidecarPod], token: str) -> bool:
    """Every sidecar accepts `token` (and so no longer the old one)."""
    return all([await p.state(fleet.session) is not None for p in pods]) and all(
        p.token() == token for p in pods
    )


async def test_hung_sidecars_among_good_ones(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """Four sidecars hang (SIGSTOP: connections accepted, nothing answered) beside a good one: the good
    pod gets a change within a couple of seconds (pushes run side by side, each with a deadline), the
    condition names the hung pods, and they catch up when they answer again."""
    pods = await _start(fleet, pods=5, mode="on")
    *hung, good = pods
    traffic = fleet.traffic_to(good)
    for pod in hung:
        pod.pause()
    changed = time.monotonic()
    await fleet.patch_spec({"speculation": {"mode": "off"}})
    await ff.wait_for(lambda: _mode_is(fleet, good, "off"), timeout=30, interval=0.05)
    good_s = time.monotonic() - changed
    cond = await ff.wait_for(lambda: fleet.condition("PoliciesApplied", status="False"), timeout=30)
    await ff.wait_for(lambda: fleet.events("SidecarUnreachable"), timeout=30)
    resumed = time.monotonic()
    for pod in hung:
        pod.resume()
    await ff.wait_for(lambda: fleet.in_force(mode="off"), timeout=60, interval=0.2)
    scenario.recovery_s = time.monotonic() - resumed
    scenario.notes.append(f"the good pod had the change {good_s:.1f} s after it was made")
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert good_s < 5.0, f"the good pod waited {good_s:.1f} s behind the hung ones"
    assert all(p.name in cond["message"] for p in hung), cond
    await ff.wait_for(lambda: fleet.condition("PoliciesApplied", status="True"), timeout=30)


async def test_foreign_object_name_collision(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """Someone else's ConfigMap already has the name a new resource's child would take: the resource gets
    Conflict (condition, Warning Event) and touches nothing, while another resource keeps being served;
    once the name is free the resource deploys."""
    await _start(fleet, name="other", mode="on")
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": render.names(ff.NAME)["config_map"], "namespace": ff.NAMESPACE},
        "data": {"settings": "theirs"},
    }
    await fleet.emulator.post(f"/api/v1/namespaces/{ff.NAMESPACE}/configmaps", json=foreign)
    await fleet.create(ff.resource(fleet.proxy.url, mode="on"))
    cond = await ff.wait_for(lambda: fleet.condition("Conflict", status="True"), timeout=30)
    events = await ff.wait_for(lambda: fleet.events("Conflict"), timeout=30)
    assert "ConfigMap llm-sidecar" in cond["message"], cond
    assert {e["type"] for e in events} == {"Warning"}
    assert ff.get(fleet.emulator, "v1/configmaps", "llm-sidecar")["data"] == {"settings": "theirs"}
    assert ff.get(fleet.emulator, "apps/v1/deployments", ff.NAME) is None
    # the other resource is still served: a change reaches its pods
    await fleet.patch_spec({"speculation": {"mode": "off"}}, name="other")
    await ff.wait_for(lambda: fleet.in_force("other", mode="off"), timeout=30, interval=0.2)
    freed = time.monotonic()
    await fleet.emulator.delete(f"/api/v1/namespaces/{ff.NAMESPACE}/configmaps/llm-sidecar")
    await ff.wait_for(lambda: fleet.condition("Deployed", status="True"), timeout=30)
    scenario.recovery_s = time.monotonic() - freed
    assert fleet.condition("Conflict", status="False")


async def test_unknown_gpu_beside_a_good_one(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """A resource names a GPU the cost model does not know: it gets a generic prior, a GpuKnown condition
    and a Warning Event, and every other resource is served as before; naming a known GPU clears it."""
    await _start(fleet, mode="on")
    traffic = fleet.traffic_to(fleet.pods[ff.NAME][0])
    await fleet.create(ff.resource(fleet.proxy.url, name="odd", gpu="NVIDIA-A100-SXM4-80GB", replicas=1))
    cond = await fleet.until(lambda: fleet.condition("GpuKnown", "odd", status="False"), 30, name="odd")
    events = await ff.wait_for(lambda: fleet.events("UnknownGpu", name="odd"), timeout=30)
    assert cond["reason"] == "UnknownGpu" and "NVIDIA-A100-SXM4-80GB" in cond["message"], cond
    assert {e["type"] for e in events} == {"Warning"}
    # the good resource is still decided for and served: a change reaches its pods
    await fleet.patch_spec({"speculation": {"mode": "off"}})
    await ff.wait_for(lambda: fleet.in_force(mode="off"), timeout=30, interval=0.2)
    assert fleet.condition("GpuKnown") is None or fleet.condition("GpuKnown", status="True")
    fixed = time.monotonic()
    await fleet.patch_spec({"engine": {"gpu": {"product": "NVIDIA-H100"}}}, name="odd")
    await ff.wait_for(lambda: fleet.condition("GpuKnown", "odd", status="True"), timeout=30)
    scenario.recovery_s = time.monotonic() - fixed
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert not fleet.condition("DecisionFailed", status="True")
    _valid_status(fleet.status("odd"))


# ---- the draft socket --------------------------------------------------------------------------------

LONG_ROW = 128 * 1024


async def test_long_request_among_short_ones(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """A 128K-token request joins four short ones on an engine's draft connection (the real proposer
    client, the real draft socket): the short rows keep getting drafts on every step, no call goes
    unanswered, and the connection stays up."""
    (pod,) = await _start(fleet, pods=1, mode="on")
    traffic = fleet.traffic_to(pod, width=LONG_ROW + 4096)
    await ff.wait_for(lambda: traffic.drafted > 10, timeout=30)
    calls_before = traffic.calls
    added = time.monotonic()
    traffic.add_long_row(np.random.default_rng(0).integers(0, 512, LONG_ROW, dtype=np.int32))
    await ff.wait_for(lambda: traffic.calls_with_long > 50, timeout=60)
    scenario.recovery_s = None
    fleet.stop_traffic()
    with_long = traffic.calls - calls_before
    scenario.notes.append(
        f"{with_long} steps with the long row in {time.monotonic() - added:.1f} s; "
        f"{traffic.long_drafted} of them drafted it"
    )
    assert traffic.missed == 0
    assert traffic.drafted >= traffic.calls - 1, (traffic.drafted, traffic.calls)
    assert traffic.client.connected or traffic.calls > 0
    assert await pod.state(fleet.session) is not None


async def test_drafter_that_raises(fleet: ff.Fleet, scenario: ff.Scenario) -> None:
    """The drafter the pods start with raises on every call (a draft model that cannot take the engine's
    tokens), before it ever had a draft accepted: no draft call goes unanswered, the sidecar counts the
    errors and marks the drafter failed, and the controller demotes it: the pods move to the other
    drafter, which drafts again."""
    await fleet.start_operator()
    drafters = [dict(ff.TINY_DRAFT), dict(ff.NGRAM)]
    await fleet.create(ff.resource(fleet.proxy.url, name="raise", drafters=drafters))
    pods = await fleet.start_pods(2, name="raise")
    await fleet.healthy("raise")
    assert all(s["drafter"] == "tiny-draft" for s in await fleet.states("raise"))
    traffic = fleet.traffic_to(pods[0])
    await ff.wait_for(lambda: traffic.drafted > 5, timeout=30)
    started = time.monotonic()
    # token ids beyond the draft model's vocabulary: its embedding lookup raises on every call
    traffic.add_long_row(np.arange(600, 700, dtype=np.int32))
    errors = await ff.wait_for(lambda: _drafter_errors(fleet, pods[0], "tiny-draft"), timeout=30)
    await ff.wait_for(lambda: _drafter_status(fleet, pods[0], "tiny-draft", "failed"), timeout=30)
    await fleet.until(lambda: _all_on(fleet, "raise", "ngram"), timeout=60, name="raise", interval=0.2)
    drafted = traffic.drafted
    await ff.wait_for(lambda: traffic.drafted > drafted + 5, timeout=30)
    scenario.recovery_s = time.monotonic() - started
    fleet.stop_traffic()
    assert traffic.missed == 0 and traffic.calls > 0
    assert errors > 0
    status = fleet.status("raise")
    assert status["activeDrafter"] == "ngram"
    assert any("tiny-draft" in e["message"] for e in fleet.events(name="raise") if e["type"] == "Warning")
    _valid_status(status)


async def _drafter_status(fleet: ff.Fleet, pod: ff.SidecarPod, drafter: str, status: str) -> bool:
    state = await pod.state(fleet.session)
    return state is not None and {d["name"]: d["status"] for d in state["drafters"]}[drafter] == status


async def _drafter_errors(fleet: ff.Fleet, pod: ff.SidecarPod, drafter: str) -> float:
    samples = await pod.metrics(fleet.session)
    return ff.metric_sum(samples, "specserve_sidecar_drafter_errors_total", drafter=drafter)


async def _all_on(fleet: ff.Fleet, name: str, drafter: str) -> list[dict[str, Any]] | None:
    states = await fleet.states(name)
    return states if all(s is not None and s["drafter"] == drafter for s in states) else None  # type: ignore[return-value]
