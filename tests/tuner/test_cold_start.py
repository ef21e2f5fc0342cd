"""Pods start plain (render.initial_policy, mode auto): the first interval measures plain steps, so the
controller's first decisions calibrate speculative step times against a measured plain step instead of
the prior's (docs/policy.md, "Cold start"). The simulator-level regression is in test_simulator.py."""

from __future__ import annotations

import pytest

from specserve_engine.buckets import bucket_labels
from specserve_operator.render.children import initial_policy
from specserve_operator.tuner import core, observations
from specserve_testing.tuner_loads import BUCKETS, shadow_rows

NS = "ml"
PODS = ("pod-a", "pod-b")


def _plain(bucket_load, prior) -> dict:
    """What a pod that ran plain did: plain steps only, as fast as the prior predicts."""
    return {
        label: bucket_load(batch=batch, steps_plain=1000, step_s_plain=prior.step_s(batch, 0))
        for label, batch in BUCKETS
    }


def _speculating(bucket_load, plain_prior, spec_prior, steps_plain: int) -> dict:
    """A pod that speculated at K 3 in most steps: plain and speculative steps as fast as the priors say."""
    return {
        label: bucket_load(
            batch=batch,
            steps_plain=steps_plain,
            step_s_plain=plain_prior.step_s(batch, 0),
            steps_spec=1000,
            step_s_spec=spec_prior.step_s(batch, 3),
            k=3,
        )
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
    # The drafter the pods loaded is measured first (an exploration), before another is tried, at its
    # largest K: its drafts measure acceptance at every position.
    assert len(speculating) == 1 and d.action == "explore", d.reason
    (canary,) = (d.pods[pod] for pod in speculating)
    assert canary.drafter == d.drafter == spec.drafters[0].name
    assert {k for k in canary.k_by_bucket.values() if k} == {spec.drafters[0].max_speculative_tokens}

    no_canaries = spec_factory(speculation__explorationShare=0.0)
    view = core.ResourceView(NS, "llm", no_canaries, PODS)
    d = _decide(view, core.ResourceState.initial(no_canaries), rows, 30.0)
    assert d.action == "enable" and d.k_by_bucket["4"] > 0, d.reason
    assert all(t.k_by_bucket == d.k_by_bucket for t in d.pods.values())


def test_a_drafter_in_force_never_measured_stands_at_its_prior_against_a_trial(
    spec_factory, rows_for, bucket_load
) -> None:
    """A trial measured n-gram on one pod; the draft model in force has run plain since the pods started.
    It stands at what the prior predicts for it, not at plain decoding: n-gram's measurement must beat
    that to be switched to, and the draft model is turned on to be measured."""
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    draft, ngram = view.prior(spec.drafters[0]), view.prior(spec.drafters[1])
    trial = _speculating(bucket_load, draft, ngram, steps_plain=500)
    rows = rows_for(NS, "pod-a", "ngram", trial, alphas=(0.4,) * 8)
    rows += rows_for(NS, "pod-b", "draft", _plain(bucket_load, draft))
    state = core.ResourceState.initial(spec)
    d = _decide(view, state, rows, 30.0)
    assert d.scores["ngram"] > 1.05 and "draft" not in d.scores  # n-gram beats plain decoding...
    assert d.drafter == "draft" and d.action == "enable", d.reason  # ...not the draft model's prior
    assert "draft" not in state.last_score  # a prediction, not a measurement


def test_the_standing_of_a_drafter_in_force_without_a_score() -> None:
    names = ["a", "b"]
    assert core.better_drafter("a", names, {"b": 1.3}, {}, {}, cooled_down=True) == "b"  # plain: 1.0
    assert core.better_drafter("a", names, {"b": 1.3}, {}, {}, cooled_down=True, never_measured=1.5) is None
    # A score, measured now or before, outranks the prediction.
    assert core.better_drafter("a", names, {"b": 1.3}, {"a": 1.1}, {}, True, never_measured=1.5) == "b"


def test_a_drafter_known_only_from_its_shadow_is_tried_before_the_fleet_switches(
    spec_factory, rows_for, bucket_load
) -> None:
    """Shadow drafts measured n-gram's acceptance well above the draft model's, but n-gram's own steps
    were never timed (its step times are borrowed): no fleet-wide switch on that, a trial first."""
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    draft = view.prior(spec.drafters[0])
    spec_steps = _speculating(bucket_load, draft, draft, steps_plain=200)
    rows = [r for pod in PODS for r in rows_for(NS, pod, "draft", spec_steps, alphas=(0.5,) * 8)]
    rows += shadow_rows("pod-a", "ngram", (0.9,) * 4) + shadow_rows("pod-b", "ngram", (0.9,) * 4)
    d = _decide(view, core.ResourceState.initial(spec), rows, 30.0)
    assert d.scores["ngram"] > 1.05 * d.scores["draft"], d.scores  # the shadow ranks n-gram first...
    assert d.drafter == "draft" and "trial of drafter ngram" in d.reason, d.reason  # ...a trial measures it


def test_a_cold_start_explores_the_drafter_in_force_where_the_prior_sees_no_gain(
    spec_factory, rows_for, bucket_load, monkeypatch
) -> None:
    """A prior that prices every K as slower than plain (a GPU roofline over a tiny draft model on a CPU)
    does not keep the drafter the pods loaded from its first measurement; once it has a score, such a
    bucket gets no exploration."""
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    prior = view.prior(spec.drafters[0])
    rows = [r for pod in PODS for r in rows_for(NS, pod, "draft", _plain(bucket_load, prior))]
    monkeypatch.setattr(core.policy, "best_k", lambda *a, **k: core.policy.BucketChoice(1, 0.5, (0.5,)))
    state = core.ResourceState.initial(spec)
    assert _decide(view, state, rows, 30.0).action == "explore"
    scored = core.ResourceState.initial(spec)
    scored.last_score["draft"] = 0.9
    assert _decide(view, scored, rows, 30.0).action != "explore"


@pytest.mark.parametrize(
    ("ngram_alpha", "ends"),
    [(0.2, True), (0.6, False)],
    ids=["measured-clearly-worse", "within-the-margin"],
)
def test_a_trial_ends_early_once_it_measured_its_drafter_clearly_worse(
    spec_factory, rows_for, bucket_load, ngram_alpha: float, ends: bool
) -> None:
    """A trial of n-gram on pod-a has measured its own steps and acceptance one tick in; the draft model
    in force speculates on pod-b. Clearly worse (below the draft model's score by the switch margin), the
    trial ends now instead of after TRIAL_TICKS: on a one-pod fleet it is the fleet. Not clearly worse,
    it runs its length."""
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    draft, ngram = view.prior(spec.drafters[0]), view.prior(spec.drafters[1])
    rows = rows_for(
        NS, "pod-a", "ngram", _speculating(bucket_load, draft, ngram, 200), alphas=(ngram_alpha,) * 8
    )
    rows += rows_for(NS, "pod-b", "draft", _speculating(bucket_load, draft, draft, 200), alphas=(0.8,) * 8)
    state = core.ResourceState.initial(spec)
    state.decided, state.last_score = True, {"draft": 1.3}
    state.k_by_bucket = dict.fromkeys(state.k_by_bucket, 3)
    trial = core.Canary(
        "pod-a", "ngram", dict.fromkeys(state.k_by_bucket, 3), 30.0 * core.TRIAL_TICKS, "trial"
    )
    state.canary, state.last_trial_at = trial, {"ngram": 0.0}
    d = _decide(view, state, rows, 30.0)
    assert d.drafter == "draft", d.reason
    if ends:
        assert d.scores["ngram"] * (1 + core.SWITCH_MARGIN) < d.scores["draft"]
        assert state.canary is not trial and d.pods["pod-a"].drafter == "draft", d.reason
    else:
        assert d.scores["ngram"] * (1 + core.SWITCH_MARGIN) >= d.scores["draft"]
        assert state.canary is trial and d.pods["pod-a"].drafter == "ngram", d.reason
