"""The controller's I/O loop: shared reads, pushes to real HTTP sidecar stand-ins, faults, status."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
import pytest

from specserve_operator.tuner import core, observations
from specserve_operator.tuner.loop import BACKOFF_BASE_S, FleetController
from specserve_operator.tuner.reader import MetricsUnavailable
from specserve_operator.tuner.report import status_patch

NS = "ml"
TOKEN = "secret-token"


class FakeReader:
    """Stands in for PrometheusReader: returns the rows it is given, or raises the error it is given."""

    def __init__(self) -> None:
        self.rows: list[observations.Row] = []
        self.error: MetricsUnavailable | None = None
        self.reads = 0

    def read(self) -> observations.FleetSnapshot:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return observations.build_snapshot(self.rows, 300.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def harness(spec_factory, rows_for, bucket_load, sidecars):
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, ("pod-a", "pod-b"))
    prior = view.prior(spec.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=2000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0)),
    }
    reader = FakeReader()
    reader.rows = rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads)
    a, b = await sidecars(), await sidecars()
    clock = Clock()
    async with aiohttp.ClientSession() as session:
        controller = FleetController(
            "http://prometheus", session, clock=clock, reader_factory=lambda url: reader
        )
        yield controller, view, reader, {"pod-a": a, "pod-b": b}, clock


async def test_policy_reaches_every_pod_once(harness) -> None:
    controller, view, _reader, stands, clock = harness
    endpoints = {pod: s.url for pod, s in stands.items()}
    tick = await controller.tick(view, endpoints, TOKEN)
    assert tick.decision is not None and tick.decision.changed
    assert sorted(tick.pushed) == ["pod-a", "pod-b"] and not tick.unreachable
    for s in stands.values():
        assert s.policy["kByBucket"]["4"] > 0 and s.policy["policyVersion"] == tick.decision.policy_version
    # Nothing changed: nothing is sent again.
    clock.now += 30
    again = await controller.tick(view, endpoints, TOKEN)
    assert again.pushed == [] and all(len(s.puts) == 1 for s in stands.values())


async def test_one_read_serves_every_resource_in_a_tick(harness, spec_factory) -> None:
    controller, view, reader, _, _ = harness
    other = core.ResourceView(NS, "other", spec_factory(), ("pod-c",))
    await controller.decide(view)
    await controller.decide(other)
    assert reader.reads == 1


async def test_unreachable_sidecar_is_retried_and_the_others_served(harness, sidecars) -> None:
    controller, view, _, stands, clock = harness
    port = int(stands["pod-b"].url.rsplit(":", 1)[1])
    await stands["pod-b"].stop()
    endpoints = {pod: s.url for pod, s in stands.items()}
    tick = await controller.tick(view, endpoints, TOKEN)
    assert tick.pushed == ["pod-a"] and "pod-b" in tick.unreachable
    patch = status_patch(tick, view, {}, datetime.now(UTC))
    applied = next(c for c in patch["conditions"] if c["type"] == "PoliciesApplied")
    assert applied["status"] == "False" and "pod-b" in applied["message"]
    # The sidecar comes back: the next tick delivers the same policy.
    back = await sidecars(port=port)
    clock.now += 30
    retry = await controller.tick(view, endpoints, TOKEN)
    target = retry.decision.pods["pod-b"]
    assert retry.pushed == ["pod-b"]
    assert (back.policy["drafter"], back.policy["kByBucket"]) == (target.drafter, target.k_by_bucket)


async def test_wrong_token_is_reported_not_retried_forever(harness) -> None:
    controller, view, _, stands, _ = harness
    tick = await controller.tick(view, {pod: s.url for pod, s in stands.items()}, "wrong")
    assert set(tick.unreachable) == {"pod-a", "pod-b"}
    assert all("unauthorized" in e for e in tick.unreachable.values())


async def test_older_version_after_a_restart_is_renumbered(harness) -> None:
    controller, view, _, stands, _ = harness
    for s in stands.values():
        s.policy = {**s.policy, "policyVersion": 40}
    tick = await controller.tick(view, {pod: s.url for pod, s in stands.items()}, TOKEN)
    assert sorted(tick.pushed) == ["pod-a", "pod-b"]
    assert all(s.policy["policyVersion"] > 40 for s in stands.values())


async def test_prometheus_outage_keeps_the_policy_and_backs_off(harness) -> None:
    controller, view, reader, stands, clock = harness
    endpoints = {pod: s.url for pod, s in stands.items()}
    first = await controller.tick(view, endpoints, TOKEN)
    in_force = dict(stands["pod-a"].policy)
    reader.error = MetricsUnavailable("PrometheusDown", "connection refused")
    clock.now += 30
    down = await controller.tick(view, endpoints, TOKEN)
    assert down.decision is None and down.metrics_error is reader.error
    assert stands["pod-a"].policy == in_force and len(stands["pod-a"].puts) == 1  # fail static
    patch = status_patch(down, view, {"kByBucket": first.decision.k_by_bucket}, datetime.now(UTC))
    assert set(patch) == {"conditions"}  # the policy in status stays as it was
    cond = patch["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("MetricsAvailable", "False", "PrometheusDown")
    # Within the backoff Prometheus is not asked again; after it, it is.
    reads = reader.reads
    clock.now += BACKOFF_BASE_S / 2
    await controller.tick(view, endpoints, TOKEN)
    assert reader.reads == reads
    reader.error = None
    clock.now += BACKOFF_BASE_S
    recovered = await controller.tick(view, endpoints, TOKEN)
    assert recovered.decision is not None and reader.reads == reads + 1


async def test_status_after_a_decision(harness) -> None:
    controller, view, _, stands, _ = harness
    tick = await controller.tick(view, {pod: s.url for pod, s in stands.items()}, TOKEN)
    patch = status_patch(tick, view, {}, datetime.now(UTC))
    assert patch["activeDrafter"] == "draft" and patch["kByBucket"] == tick.decision.k_by_bucket
    assert patch["lastDecision"]["action"] == tick.decision.action
    assert {p["name"] for p in patch["pods"]} == {"pod-a", "pod-b"}
    assert patch["fleet"]["meanAcceptedLength"] > 2.0
    kinds = {c["type"]: c["status"] for c in patch["conditions"]}
    assert kinds == {"MetricsAvailable": "True", "SpeculationHealthy": "True", "PoliciesApplied": "True"}
