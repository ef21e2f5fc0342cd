"""No metrics yet (a new resource, a ServiceMonitor Prometheus never picks up): the decision keeps the
policy the pods start with and is not pushed, and says why (MetricsMissing)."""

from __future__ import annotations

from datetime import UTC, datetime

from specserve_operator.render.children import initial_policy
from specserve_operator.tuner import core, observations
from specserve_operator.tuner.loop import ResourceTick
from specserve_operator.tuner.report import METRICS_AVAILABLE, status_patch

NS = "ml"
PODS = ("pod-a", "pod-b")


def test_a_new_resource_without_metrics_keeps_the_policy_its_pods_start_with(spec_factory) -> None:
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    nothing = observations.build_snapshot([], 300.0)
    state = core.ResourceState.initial(spec)
    d = core.decide(view, nothing, state, core.FleetCosts([view], nothing), 0.0)
    started = initial_policy(spec)
    assert d.action == "noData" and not d.changed
    # What the controller remembers is what the pods were started with (render.initial_policy).
    assert d.k_by_bucket == started.k_by_bucket and d.drafter == started.drafter
    assert all(t.k_by_bucket == started.k_by_bucket and t.mode == started.mode for t in d.pods.values())
    assert not d.push
    assert core.METRICS_MISSING in d.warnings
    patch = status_patch(ResourceTick(d), view, {}, datetime.now(UTC))
    available = next(c for c in patch["conditions"] if c["type"] == METRICS_AVAILABLE)
    assert (available["status"], available["reason"]) == ("False", core.METRICS_MISSING)


def test_mode_off_starts_with_speculation_off(spec_factory) -> None:
    spec = spec_factory(speculation__mode="off")
    assert set(core.ResourceState.initial(spec).k_by_bucket.values()) == {0}
    assert initial_policy(spec).mode == "off"


def test_once_decided_on_metrics_the_policy_is_pushed_to_pods_without_them(
    spec_factory, rows_for, bucket_load
) -> None:
    """A pod started later (or after an outage of its metrics) gets the policy decided for the fleet."""
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    prior = view.prior(spec.drafters[0])
    loads = {"64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0))}
    rows = [r for pod in PODS for r in rows_for(NS, pod, "draft", loads)]
    snap = observations.build_snapshot(rows, 300.0)
    state = core.ResourceState.initial(spec)
    decided = core.decide(view, snap, state, core.FleetCosts([view], snap), 0.0)
    assert decided.push and decided.action != "noData"
    later = core.ResourceView(NS, "llm", spec, ("pod-c", "pod-d"))
    nothing = observations.build_snapshot([], 300.0)
    d = core.decide(later, nothing, state, core.FleetCosts([later], nothing), 30.0)
    assert d.action == "noData" and d.push and d.k_by_bucket == decided.k_by_bucket


def test_an_operator_restart_resumes_the_pushed_policy(spec_factory) -> None:
    spec = spec_factory()
    status = {"activeDrafter": "ngram", "kByBucket": {"4": 2}, "policyVersion": 7}
    state = core.ResourceState.initial(spec, status)
    assert state.decided and state.drafter == "ngram" and state.k_by_bucket["4"] == 2
    assert state.k_by_bucket["64"] == 0
