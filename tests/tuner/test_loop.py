"""The controller's I/O loop against real sidecars (tests/tuner/conftest.py): shared reads, pushes,
reconciling what pods run, concurrency, tokens, forgetting, faults, status."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
import types
import weakref
from datetime import UTC, datetime

import aiohttp
import pytest
from prometheus_client import REGISTRY

from specserve_engine import metric_names
from specserve_engine.api import PolicyRequest
from specserve_engine.client import SidecarClient
from specserve_operator.tuner import core, observations
from specserve_operator.tuner.loop import BACKOFF_BASE_S, SIDECAR_TIMEOUT_S, FleetController
from specserve_operator.tuner.reader import MetricsUnavailable
from specserve_operator.tuner.report import status_patch

NS = "ml"
TOKEN = "secret-token"


class FakeReader:
    """Stands in for PrometheusReader: returns the rows it is given, or raises the error it is given."""

    def __init__(self) -> None:
        self.rows: list[observations.Row] = []
        self.snapshot: observations.FleetSnapshot | None = None  # instead of the rows' snapshot
        self.error: MetricsUnavailable | None = None
        self.reads = 0

    def read(self) -> observations.FleetSnapshot:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.snapshot or observations.build_snapshot(self.rows, 300.0)


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


async def test_the_expired_read_is_let_go_before_the_next_one_is_made(harness) -> None:
    """A large fleet's snapshot is tens of megabytes: held while the next one was folded, it raised a
    steady operator's peak memory at 1,000 resources × 8 pods from about 250 to 315 MB
    (benchmarks/controller_bench.py --scale)."""
    controller, view, reader, _, clock = harness
    await controller.decide(view)
    last = weakref.ref(controller._reads["http://prometheus"].snapshot)
    alive_at_read: list[bool] = []
    read = reader.read

    def read_checking() -> observations.FleetSnapshot:
        alive_at_read.append(last() is not None)
        return read()

    reader.read = read_checking
    clock.now += 30
    tick = await controller.decide(view)
    assert tick.decision is not None and alive_at_read == [False]


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
    assert all("wrong bearer token" in e for e in tick.unreachable.values())


async def test_older_version_after_a_restart_is_renumbered(harness) -> None:
    controller, view, _, stands, _ = harness
    async with aiohttp.ClientSession() as session:  # another operator numbered higher
        for s in stands.values():
            start_up = PolicyRequest.model_validate({**s.policy, "policyVersion": 40})
            await SidecarClient(s.url, TOKEN, session).put_policy(start_up)
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


async def test_a_restarted_sidecar_is_given_its_policy_again_at_the_next_tick(harness) -> None:
    controller, view, _, stands, clock = harness
    endpoints = {pod: s.url for pod, s in stands.items()}
    first = await controller.tick(view, endpoints, TOKEN)
    in_force = stands["pod-b"].policy
    await stands["pod-b"].restart()  # back at its start-up policy, version 0
    assert stands["pod-b"].policy["policyVersion"] == 0 and stands["pod-b"].policy != in_force
    clock.now += 30
    again = await controller.tick(view, endpoints, TOKEN)
    assert again.pushed == ["pod-b"] and "version 0" in again.restored["pod-b"]
    assert stands["pod-b"].policy == in_force
    version = first.decision.policy_version
    assert stands["pod-b"].policy_info() == (in_force["drafter"], in_force["mode"], version)
    assert len(stands["pod-a"].puts) == 1  # the pod that kept its policy is not pushed again


async def test_a_restarted_sidecar_gets_the_policy_in_force_back_while_prometheus_is_down(harness) -> None:
    controller, view, reader, stands, clock = harness
    endpoints = {pod: s.url for pod, s in stands.items()}
    await controller.tick(view, endpoints, TOKEN)
    in_force = stands["pod-a"].policy
    reader.error = MetricsUnavailable("PrometheusDown", "connection refused")
    await stands["pod-a"].restart()
    clock.now += 30
    down = await controller.tick(view, endpoints, TOKEN)
    assert down.decision is None and down.pushed == ["pod-a"]  # nothing decided, nothing lost
    assert stands["pod-a"].policy == in_force


async def test_a_pod_started_later_gets_the_policy_at_the_next_tick(harness, sidecars) -> None:
    controller, view, _, stands, clock = harness
    endpoints = {pod: s.url for pod, s in stands.items()}
    await controller.tick(view, endpoints, TOKEN)
    stands["pod-c"] = await sidecars()
    endpoints["pod-c"] = stands["pod-c"].url
    clock.now += 30
    grown = await controller.tick(dataclasses.replace(view, pods=(*view.pods, "pod-c")), endpoints, TOKEN)
    assert grown.pushed == ["pod-c"] and not grown.restored
    target = grown.decision.pods["pod-c"]
    held = stands["pod-c"].policy
    assert (held["drafter"], held["mode"], held["kByBucket"]) == (
        target.drafter,
        target.mode,
        target.k_by_bucket,
    )


async def _hung_server() -> tuple[asyncio.Server, str]:
    """Accepts connections and never answers (a hung sidecar)."""

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_hung_sidecars_cost_a_tick_one_deadline_not_one_each(harness, spec_factory) -> None:
    controller, _view, _, stands, _ = harness
    hung = [await _hung_server() for _ in range(4)]
    try:
        pods = ("pod-a", "hung-0", "hung-1", "hung-2", "hung-3")
        endpoints = {"pod-a": stands["pod-a"].url} | {f"hung-{i}": url for i, (_, url) in enumerate(hung)}
        view = core.ResourceView(NS, "llm", spec_factory(), pods)
        started = time.monotonic()
        tick = await controller.tick(view, endpoints, TOKEN)
        elapsed = time.monotonic() - started
    finally:
        for server, _ in hung:
            server.close()
            await server.wait_closed()
    assert set(tick.unreachable) == set(pods) - {"pod-a"}
    # One per-call deadline (SIDECAR_TIMEOUT_S) for all four, not 2 tries x 2 calls x 4 pods in a row.
    assert elapsed < 2 * SIDECAR_TIMEOUT_S, elapsed


async def test_a_rotated_token_costs_one_retry_not_a_failed_push(harness) -> None:
    controller, view, _, stands, _ = harness
    for s in stands.values():
        await s.restart(token="rotated-token")  # a new Secret, mounted after a restart
    reads = []

    async def read_secret() -> str:
        reads.append(1)
        return "rotated-token"

    tick = await controller.tick(
        view, {pod: s.url for pod, s in stands.items()}, TOKEN, refresh_token=read_secret
    )
    assert tick.pushed == ["pod-a", "pod-b"] and not tick.unreachable
    assert len(reads) == 1  # re-read once for the resource, not per pod or per call


async def test_a_deleted_resource_is_forgotten_and_one_made_again_starts_afresh(harness) -> None:
    controller, view, _, stands, clock = harness
    endpoints = {pod: s.url for pod, s in stands.items()}
    first = await controller.tick(view, endpoints, TOKEN, uid="uid-1")
    assert first.decision.changed and _recommended(view) is not None
    old_state = controller.states[view.key]
    # Made again under the same name (a new uid): nothing of the old one is inherited.
    clock.now += 30
    again = await controller.tick(view, endpoints, TOKEN, uid="uid-2")
    assert controller.states[view.key] is not old_state and again.decision.changed
    controller.forget(view.key)
    assert view.key not in controller.states and view.key not in controller.views
    assert view.key not in controller.applied and view.key not in controller.uids
    assert _recommended(view) is None
    assert not controller.readers and not controller._backoff  # no resource reads that Prometheus now
    decisions = REGISTRY.get_sample_value(
        metric_names.OPERATOR_DECISIONS.series[0],
        {"namespace": NS, "name": view.name, "action": first.decision.action},
    )
    assert decisions is None


def _recommended(view: core.ResourceView) -> float | None:
    labels = {"namespace": NS, "name": view.name, "mode": "auto", "drafter": "draft", "bucket": "4"}
    return REGISTRY.get_sample_value(metric_names.OPERATOR_RECOMMENDED_K.name, labels)


async def test_backing_off_raises_a_new_exception_each_time(harness) -> None:
    controller, view, reader, _, clock = harness
    reader.error = MetricsUnavailable("PrometheusDown", "connection refused")
    errors = []
    for _ in range(3):
        errors.append((await controller.tick(view, {}, TOKEN)).metrics_error)
        clock.now += 0.1  # within the backoff: Prometheus is not asked
    assert reader.reads == 1
    assert len({id(e) for e in errors}) == 3
    assert all((e.reason, str(e)) == ("PrometheusDown", "connection refused") for e in errors)
    assert all(e.__traceback__ is None or _depth(e.__traceback__) < 10 for e in errors[1:])


def _depth(tb: types.TracebackType | None) -> int:
    n = 0
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def test_durations_are_measured_on_a_monotonic_clock() -> None:
    assert FleetController("http://prometheus", None).clock is time.monotonic  # type: ignore[arg-type]


async def test_a_resource_that_fails_to_decide_does_not_stop_the_others(harness, spec_factory) -> None:
    controller, view, reader, _, _ = harness
    bad = core.ResourceView(NS, "bad", spec_factory(), ("pod-x",))
    snapshot = observations.build_snapshot(reader.rows, 300.0)
    # A pod observation no boundary check let through: deciding for its resource raises.
    snapshot.pods[(NS, "pod-x")] = observations.PodObservation(
        NS, "pod-x", drafter="draft", by_drafter={"draft": {"4": None}}
    )
    reader.snapshot = snapshot
    ticks = await controller.decide_all([bad, view])
    assert ticks[bad.key].decision is None and ticks[bad.key].error
    assert ticks[view.key].decision is not None and ticks[view.key].error is None


def test_the_state_rolled_back_to_is_not_changed_by_the_decision_that_failed(spec_factory) -> None:
    """`ResourceState.copy` (what a failed decision rolls back to) shares no container with the state
    the decision goes on to change."""
    state = core.ResourceState.initial(spec_factory())
    state.canary = core.Canary("pod-0", "draft", {"1": 2}, 10.0, "explore")
    before = copy.deepcopy(state)
    rollback = state.copy()
    assert rollback == before
    for f in dataclasses.fields(state):
        container = getattr(state, f.name)
        if isinstance(container, dict):
            container["changed"] = 0
        elif isinstance(container, set):
            container.add("changed")
    state.canary = None
    assert rollback == before
