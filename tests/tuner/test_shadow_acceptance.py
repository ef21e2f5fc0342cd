"""Shadow acceptance in the controller: the sidecars' scores of shadow drafts (shadow.py) read, validated
and used where a drafter has no live drafts in the window, so a drafter not in force is ranked on the
traffic of this window and takes over within a tick when the traffic turns its way."""

from __future__ import annotations

import pytest

from specserve_operator.tuner import core, observations, policy
from specserve_testing.tuner_loads import loads_at_prior, shadow_rows

NS = "ml"


def view_of(spec) -> core.ResourceView:
    return core.ResourceView(NS, "llm", spec, ("pod-a", "pod-b"))


def decide(
    view: core.ResourceView,
    rows: list,
    state: core.ResourceState,
    now: float,
    memory: policy.RatioMemory | None = None,
) -> core.Decision:
    snap = observations.build_snapshot(rows, 300.0)
    return core.decide(view, snap, state, core.FleetCosts([view], snap, (), memory, now), now)


def test_shadow_counts_are_folded_per_drafter_and_checked() -> None:
    good = shadow_rows("pod-a", "ngram", (0.9, 0.8, 0.5, 0.5))
    snap = observations.build_snapshot(good, 300.0)
    shadow = snap.pods[(NS, "pod-a")].shadow["ngram"]
    assert shadow.proposed_pos == {0: 400.0, 1: 400.0, 2: 400.0, 3: 400.0}
    assert shadow.accepted_pos[1] == pytest.approx(400.0 * 0.9 * 0.8)
    # Without a drafter label, or at a position no draft reaches, a row is refused; more accepted than
    # proposed at a position drops that drafter's shadow counts.
    labels = {"namespace": NS, "pod": "pod-a", "position": "0"}
    snap = observations.build_snapshot([(observations.SHADOW_PROPOSED_POS, labels, 5.0)], 300.0)
    assert snap.dropped == {observations.DROP_LABELS: 1}
    far = {**labels, "drafter": "ngram", "position": "99"}
    snap = observations.build_snapshot([(observations.SHADOW_PROPOSED_POS, far, 5.0)], 300.0)
    assert snap.dropped == {observations.DROP_IMPLAUSIBLE: 1}
    ngram = {**labels, "drafter": "ngram"}
    bad = [(observations.SHADOW_PROPOSED_POS, ngram, 10.0), (observations.SHADOW_ACCEPTED_POS, ngram, 50.0)]
    snap = observations.build_snapshot(bad, 300.0)
    assert snap.pods[(NS, "pod-a")].shadow == {} and snap.dropped == {observations.DROP_INCONSISTENT: 1}


def test_shadow_rows_are_folded_per_drafter_and_checked() -> None:
    """The rows a drafter shadow-drafted for sum over series per pod and drafter; without a drafter label
    a row is refused; more shadow drafts than rows cannot be true, and the rows are dropped (the
    per-position counts stand: without rows the proposal rate is unknown)."""
    counts = shadow_rows("pod-a", "ngram", (0.9,) * 4, drafted_for=500.0)
    more = (observations.SHADOW_ROWS, {"namespace": NS, "pod": "pod-a", "drafter": "ngram"}, 300.0)
    obs = observations.build_snapshot([*counts, more], 300.0).pods[(NS, "pod-a")]
    assert obs.shadow_rows == {"ngram": 800.0}
    unnamed = (observations.SHADOW_ROWS, {"namespace": NS, "pod": "pod-a"}, 5.0)
    assert observations.build_snapshot([unnamed], 300.0).dropped == {observations.DROP_LABELS: 1}
    snap = observations.build_snapshot(shadow_rows("pod-a", "ngram", (0.9,) * 4, drafted_for=100.0), 300.0)
    obs = snap.pods[(NS, "pod-a")]
    assert obs.shadow_rows == {} and obs.shadow["ngram"].proposed_pos[0] == 400.0
    assert snap.dropped == {observations.DROP_INCONSISTENT: 1}


def test_a_shadow_drafter_is_measured_at_its_proposal_rate(spec_factory, rows_for, bucket_load) -> None:
    """n-gram shadow-drafted for 1,600 rows over two pods and found a match for 400 of them: its shadow
    acceptance is conditional on proposing, like a live one, and its proposal rate is 0.25, which prices
    its steps as the live rate does (3/4 of the rows verify one token). Without rows counted (a sidecar
    that does not count them), or too few, the rate is 1."""
    spec = spec_factory()
    view = view_of(spec)
    drafters = {d.name: d for d in spec.drafters}
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    live = rows_for(NS, "pod-a", "draft", loads, alphas=(0.6,) * 8)

    def ngram(drafted_for: float | None) -> policy.Acceptance:
        rows = live + [
            row
            for pod in ("pod-a", "pod-b")
            for row in shadow_rows(pod, "ngram", (0.9,) * 4, drafts=200.0, drafted_for=drafted_for)
        ]
        snap = observations.build_snapshot(rows, 300.0)
        return core.measured_acceptance(drafters, list(snap.pods.values()))["ngram"]

    rated = ngram(800.0)
    assert rated.source == "shadow" and rated.proposal_rate == pytest.approx(0.25)
    assert round(rated.alphas[0], 3) == 0.9
    assert ngram(None).proposal_rate == ngram(20.0).proposal_rate == 1.0
    cost = core.FleetCosts([view], observations.build_snapshot(live, 300.0)).cost(view, drafters["ngram"])
    assert policy.best_k(rated, cost, "1", 4).gain < policy.best_k(ngram(None), cost, "1", 4).gain


def test_live_drafts_come_first_and_shadow_drafts_measure_the_others(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    rows = rows_for(NS, "pod-a", "draft", loads, alphas=(0.6,) * 8)
    rows += shadow_rows("pod-a", "ngram", (0.9,) * 4) + shadow_rows("pod-a", "draft", (0.1,) * 4)
    snap = observations.build_snapshot(rows, 300.0)
    accs = core.measured_acceptance({d.name: d for d in spec.drafters}, list(snap.pods.values()))
    assert accs["draft"].source == "measured" and round(accs["draft"].alphas[0], 3) == 0.6
    assert accs["ngram"].source == "shadow" and round(accs["ngram"].alphas[0], 3) == 0.9
    # Too few shadow drafts to measure: the prior stands.
    few = rows_for(NS, "pod-a", "draft", loads) + shadow_rows("pod-a", "ngram", (0.9,) * 4, drafts=3)
    snap = observations.build_snapshot(few, 300.0)
    accs = core.measured_acceptance({d.name: d for d in spec.drafters}, list(snap.pods.values()))
    assert accs["ngram"].source == "prior"


def test_shadow_scores_come_before_live_totals_from_before_a_switch(
    spec_factory, rows_for, bucket_load
) -> None:
    """n-gram was switched out 30 s ago: the metrics window still holds its live drafts' totals (from the
    traffic before the switch), the acceptance window holds none of its live per-position counts but
    its shadow scores on the traffic of now, which are what it is ranked by."""
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    before_switch = [
        row
        for row in rows_for(NS, "pod-a", "ngram", loads, alphas=(0.9,) * 8)
        if row[0] in (observations.DRAFTS, observations.DRAFT_TOKENS, observations.ACCEPTED)
    ]
    rows = rows_for(NS, "pod-a", "draft", loads, alphas=(0.6,) * 8) + before_switch
    drafters = {d.name: d for d in spec.drafters}
    snap = observations.build_snapshot(rows, 300.0)
    assert core.measured_acceptance(drafters, list(snap.pods.values()))["ngram"].source == "totals"
    snap = observations.build_snapshot(rows + shadow_rows("pod-a", "ngram", (0.3,) * 4), 300.0)
    ngram = core.measured_acceptance(drafters, list(snap.pods.values()))["ngram"]
    assert ngram.source == "shadow" and round(ngram.alphas[0], 3) == 0.3


def test_a_drafter_whose_shadow_drafts_win_takes_over_without_a_trial(
    spec_factory, rows_for, bucket_load
) -> None:
    """Both pods run the draft model, above the MAL floor; the traffic turned code-like and n-gram's
    shadow drafts are now accepted far more often: n-gram's steps were timed when it was in force
    earlier, so the next decision switches every pod to n-gram, without a trial."""
    spec = spec_factory()
    view = view_of(spec)
    state = core.ResourceState.initial(spec)
    timed = policy.RatioMemory()
    timed.record(view.cost_group(spec.drafters[1]), {}, {"4": 1.0, "16": 1.0}, 0.0)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    rows = []
    for pod in ("pod-a", "pod-b"):
        rows += rows_for(NS, pod, "draft", loads, alphas=(0.6,) * 8)
    first = decide(view, rows, state, now=0, memory=timed)
    assert first.drafter == "draft" and "ngram" not in first.scores  # nothing measured n-gram yet
    later = rows + shadow_rows("pod-a", "ngram", (0.95,) * 4) + shadow_rows("pod-b", "ngram", (0.95,) * 4)
    d = decide(view, later, state, now=spec.speculation.cooldown_seconds + 1, memory=timed)
    assert not d.demoted and "trial" not in d.reason
    assert d.scores["ngram"] > d.scores["draft"]
    assert d.drafter == "ngram" and d.action == "switchDrafter"
    assert {p.drafter for p in d.pods.values()} == {"ngram"}


def test_a_poor_shadow_score_does_not_demote_a_drafter_not_in_force(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    state = core.ResourceState.initial(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    rows = rows_for(NS, "pod-a", "draft", loads, alphas=(0.8,) * 8)
    rows += rows_for(NS, "pod-b", "draft", loads, alphas=(0.8,) * 8) + shadow_rows(
        "pod-a", "ngram", (0.05,) * 4
    )
    decide(view, rows, state, now=0)
    d = decide(view, rows, state, now=spec.speculation.cooldown_seconds + 1)
    assert "ngram" not in d.demoted and d.drafter == "draft"


def test_a_drafter_measured_in_the_shadow_gets_a_trial_only_where_its_score_cannot_decide(
    spec_factory, rows_for, bucket_load
) -> None:
    """A trial runs a canary on another drafter to learn its acceptance and its step times. The shadow
    gives the acceptance; so n-gram, scored in the shadow, is tried only while its own speculative steps
    were never timed and its score (on borrowed step times) comes within the switch margin of the drafter
    in force: not when it is clearly worse, and not once its steps were timed (here: remembered from an
    earlier time in force)."""
    spec = spec_factory()
    view = view_of(spec)
    ngram = next(d for d in spec.drafters if d.name == "ngram")
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))

    def first_decision(ngram_alpha: float, memory: policy.RatioMemory) -> core.Decision:
        rows = []
        for pod in ("pod-a", "pod-b"):
            rows += rows_for(NS, pod, "draft", loads, alphas=(0.8,) * 8)
            rows += shadow_rows(pod, "ngram", (ngram_alpha,) * 4)
        return decide(view, rows, core.ResourceState.initial(spec), 0.0, memory)

    close = first_decision(0.65, policy.RatioMemory())
    assert abs(close.scores["ngram"] / close.scores["draft"] - 1) < core.SWITCH_MARGIN
    assert "trial of drafter ngram" in close.reason
    assert {p.drafter for p in close.pods.values()} == {"draft", "ngram"}  # a canary pod
    worse = first_decision(0.3, policy.RatioMemory())
    assert worse.scores["ngram"] * (1 + core.SWITCH_MARGIN) < worse.scores["draft"]
    assert "trial" not in worse.reason and {p.drafter for p in worse.pods.values()} == {"draft"}
    timed = policy.RatioMemory()
    timed.record(view.cost_group(ngram), {}, {"4": 1.0, "16": 1.0}, 0.0)
    known = first_decision(0.65, timed)
    assert "trial" not in known.reason and {p.drafter for p in known.pods.values()} == {"draft"}
