"""Pods start plain (render.initial_policy, mode auto): the first interval measures plain steps, so the
controller's first decisions calibrate speculative step times against a measured plain step instead of
the prior's (docs/policy.md, "Cold start"). The simulator-level regression is in test_simulator.py."""

from __future__ import annotations

import pytest

from specserve_engine.buckets import bucket_labels
from specserve_operator.render.children import initial_policy
from specserve_operator.tuner import core, observations
from specserve_testing.tuner_loads import BUCKETS

NS = "ml"
PODS = ("pod-a", "pod-b")


def _plain(bucket_load, prior) -> dict:
    """What a pod that ran plain did: plain steps only, as fast as the prior predicts."""
    return {
        label: bucket_load(batch=batch, steps_plain=1000, step_s_plain=prior.step_s(batch, 0))
        for label, batch in BUCKETS
    }


def _decide(view, state, rows, now):
    snap = observations.build_snapshot(rows, 300.0)
    return core.decide(view, snap, state, core.FleetCosts([view], snap), now)


def test_auto_pods_start_plain_in_every_bucket_with_the_initial_drafter(spec_factory) -> None:
    spec = spec_factory(speculation__defaultDrafter="ngram")
    assert spec.speculation.mode == "auto"
    started = initial_policy(spec)
    assert (started.policy_version, started.drafter, started.mode) == (0, "ngram", "on")
    assert started.k_by_bucket == dict.fromkeys(bucket_labels(spec.speculation.batch_buckets), 0)


@pytest.mark.parametrize("mode", ["auto", "advise", "on", "off"])
def test_the_controller_remembers_the_policy_the_pods_start_with(spec_factory, mode: str) -> None:
    spec = spec_factory(speculation__mode=mode)
    started = initial_policy(spec)
    state = core.ResourceState.initial(spec)
    assert (state.drafter, state.k_by_bucket, state.decided) == (started.drafter, started.k_by_bucket, False)


def test_after_a_restart_without_a_table_the_controller_remembers_the_rendered_start(spec_factory) -> None:
    """Status names the drafter the pods were rendered with (activeDrafter) but no K table: the pods run
    that drafter's start, not the default drafter's."""
    drafters = [
        {"name": "draft", "method": "draftModel", "source": "hf://org/d", "maxSpeculativeTokens": 3},
        {"name": "ngram", "method": "ngram", "maxSpeculativeTokens": 6},
    ]
    spec = spec_factory(drafters=drafters, speculation__mode="on")
    state = core.ResourceState.initial(spec, {"activeDrafter": "ngram"})
    assert state.drafter == "ngram" and set(state.k_by_bucket.values()) == {6}


def test_the_first_decision_measures_before_it_speculates_fleet_wide(
    spec_factory, rows_for, bucket_load
) -> None:
    """Only plain steps measured: the prior alone turns nothing on for the fleet, a canary measures
    first. Without exploration nothing else would ever measure, and the prior decides at once."""
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    rows = [
        r
        for pod in PODS
        for r in rows_for(NS, pod, "draft", _plain(bucket_load, view.prior(spec.drafters[0])))
    ]
    d = _decide(view, core.ResourceState.initial(spec), rows, 30.0)
    assert d.push and not any(d.k_by_bucket.values()), d.reason
    speculating = {pod for pod, t in d.pods.items() if any(t.k_by_bucket.values())}
    assert len(speculating) == 1 and d.action in ("trial", "explore"), d.reason

    no_canaries = spec_factory(speculation__explorationShare=0.0)
    view = core.ResourceView(NS, "llm", no_canaries, PODS)
    d = _decide(view, core.ResourceState.initial(no_canaries), rows, 30.0)
    assert d.action == "enable" and d.k_by_bucket["4"] > 0, d.reason
    assert all(t.k_by_bucket == d.k_by_bucket for t in d.pods.values())
