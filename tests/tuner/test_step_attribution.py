"""Step counters labelled with the drafter and the K in force: a pod that switched drafters inside the
metrics window still gives each drafter its own speculative step times (one pod can run a trial), and
one that switched K gives the step time at each K."""

from __future__ import annotations

import pytest

from specserve_operator.tuner import core, observations

NS = "ml"


def _steps(
    pod: str, bucket: str, speculating: bool, drafter: str, steps: float, step_s: float, k: str = ""
) -> list:
    labels = {
        "namespace": NS,
        "pod": pod,
        "bucket": bucket,
        "speculating": "true" if speculating else "false",
        "drafter": drafter,
        "k": k,
    }
    return [
        (observations.STEPS, labels, steps),
        (observations.STEP_SECONDS, labels, steps * step_s),
        (observations.TOKENS, labels, steps * 3.0 * (2.0 if speculating else 1.0)),
    ]


def _drafts(pod: str, bucket: str, drafter: str, steps: float) -> list:
    labels = {"namespace": NS, "pod": pod, "bucket": bucket, "drafter": drafter}
    return [
        (observations.DRAFTS, labels, steps * 3.0),
        (observations.DRAFT_TOKENS, labels, steps * 3.0 * 3),
        (observations.ACCEPTED, labels, steps * 3.0),
    ]


def _policy(pod: str, drafter: str) -> list:
    labels = {"namespace": NS, "pod": pod, "drafter": drafter, "mode": "on", "policy_version": "2"}
    return [(observations.POLICY_INFO, labels, 1.0)]


def test_a_pod_that_switched_drafters_calibrates_both(spec_factory) -> None:
    spec = spec_factory()
    draft, ngram = spec.drafters[0], spec.drafters[1]
    view = core.ResourceView(NS, "llm", spec, ("pod-a",))
    prior = view.prior(draft)
    t_plain, t_spec = prior.step_s(3.0, 0), prior.step_s(3.0, 3)
    # pod-a ran the draft model, then a trial of n-gram, in the same window: speculation with the draft
    # model added 2x what the prior predicts, n-gram's steps took what it predicts.
    rows = (
        _policy("pod-a", ngram.name)
        + _steps("pod-a", "4", False, "", 500, t_plain)
        + _steps("pod-a", "4", True, draft.name, 300, t_plain + 2 * (t_spec - t_plain))
        + _drafts("pod-a", "4", draft.name, 300)
        + _steps("pod-a", "4", True, ngram.name, 300, view.prior(ngram).step_s(3.0, 3))
        + _drafts("pod-a", "4", ngram.name, 300)
    )
    snap = observations.build_snapshot(rows, 300.0)
    costs = core.FleetCosts([view], snap, mixed={(NS, "pod-a")})  # switched: labels still attribute
    assert costs.cost(view, draft).excess_ratio["4"] == pytest.approx(2.0, rel=0.02)
    assert costs.cost(view, ngram).excess_ratio["4"] == pytest.approx(1.0, rel=0.02)

    # The same steps without drafter labels (an engine from before them) mix two drafters: left out.
    unlabelled = [
        (k, {n: v for n, v in lab.items() if n != "drafter" or k not in _ENGINE}, x) for k, lab, x in rows
    ]
    snap = observations.build_snapshot(unlabelled, 300.0)
    costs = core.FleetCosts([view], snap, mixed={(NS, "pod-a")})
    assert costs.cost(view, draft).excess_ratio == {} and costs.cost(view, ngram).excess_ratio == {}


_ENGINE = (observations.STEPS, observations.STEP_SECONDS, observations.TOKENS)


def test_a_pod_that_changed_k_calibrates_each_k_at_its_own_cost(spec_factory) -> None:
    spec = spec_factory()
    draft = spec.drafters[0]
    view = core.ResourceView(NS, "llm", spec, ("pod-a",))
    prior = view.prior(draft)

    def adding(factor: float, k: int) -> float:
        return prior.step_s(3.0, 0) + factor * (prior.step_s(3.0, k) - prior.step_s(3.0, 0))

    # Half the window at K = 1, half at K = 4 (3 requests per step), speculation adding 1.5x what the
    # prior predicts at each step's K. Predicted at the mean draft length (2.5, rounded) the ratio would
    # come out wrong.
    drafts = {"namespace": NS, "pod": "pod-a", "bucket": "4", "drafter": draft.name}
    rows = (
        _policy("pod-a", draft.name)
        + _steps("pod-a", "4", True, draft.name, 300, adding(1.5, 1), k="1")
        + _steps("pod-a", "4", True, draft.name, 300, adding(1.5, 4), k="4")
        + [
            (observations.DRAFTS, drafts, 1800.0),
            (observations.DRAFT_TOKENS, drafts, 900.0 * 1 + 900.0 * 4),
            (observations.ACCEPTED, drafts, 1800.0),
        ]
    )
    snap = observations.build_snapshot(rows, 300.0)
    bucket = snap.pods[(NS, "pod-a")].by_drafter[draft.name]["4"]
    assert (bucket.steps_by_k, bucket.steps_spec) == ({1: 300, 4: 300}, 600)
    cost = core.FleetCosts([view], snap).cost(view, draft)
    assert cost.excess_ratio["4"] == pytest.approx(1.5, rel=1e-6)
    # The same steps without K labels (an engine from before they were added): the mean-K estimate.
    unlabelled = [(kind, {**labels, "k": ""}, value) for kind, labels, value in rows]
    mean_k = core.FleetCosts([view], observations.build_snapshot(unlabelled, 300.0)).cost(view, draft)
    assert mean_k.excess_ratio["4"] != pytest.approx(1.5, rel=0.01)


@pytest.mark.parametrize(
    ("k", "reason"), [("x", observations.DROP_LABELS), ("17", observations.DROP_IMPLAUSIBLE)]
)
def test_a_k_label_that_cannot_be_true_is_refused(k: str, reason: str) -> None:
    rows = _steps("pod-a", "4", True, "d", 300, 0.01, k=k)
    snap = observations.build_snapshot(rows, 300.0)
    assert snap.dropped == {reason: 3}


def test_k_counters_without_their_step_count_are_dropped() -> None:
    rows = [r for r in _steps("pod-a", "4", True, "d", 300, 0.01, k="2") if r[0] != observations.STEPS]
    rows += _steps("pod-a", "4", True, "d", 300, 0.01)  # the unlabelled total is there
    snap = observations.build_snapshot(rows, 300.0)
    bucket = snap.pods[(NS, "pod-a")].buckets["4"]
    assert bucket.seconds_by_k == {} and bucket.steps_spec == 300
    assert snap.dropped.get(observations.DROP_INCONSISTENT)


def test_a_k_that_ran_before_the_window_is_not_a_fault() -> None:
    # K 2 ran earlier: its series exist and did not grow in the window. That is no contradiction (a
    # real engine whose controller moved K reported it so, and the pod was flagged as sending bad data).
    rows = _steps("pod-a", "4", True, "d", 300, 0.01, k="4") + _steps("pod-a", "4", True, "d", 0, 0.01, k="2")
    snap = observations.build_snapshot(rows, 300.0)
    obs = snap.pods[(NS, "pod-a")]
    assert snap.dropped == {} and obs.dropped == 0
    assert obs.by_drafter["d"]["4"].steps_by_k == {4: 300}
