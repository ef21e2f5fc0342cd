"""Step counters labelled with the drafter in force: a pod that switched drafters inside the metrics
window still gives each drafter its own speculative step times (one pod can run a trial)."""

from __future__ import annotations

import pytest

from specserve_operator.tuner import core, observations

NS = "ml"


def _steps(pod: str, bucket: str, speculating: bool, drafter: str, steps: float, step_s: float) -> list:
    labels = {
        "namespace": NS,
        "pod": pod,
        "bucket": bucket,
        "speculating": "true" if speculating else "false",
        "drafter": drafter,
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
    # pod-a ran the draft model, then a trial of n-gram, in the same window: the draft model's steps
    # took 2x what the prior predicts, n-gram's as predicted.
    rows = (
        _policy("pod-a", ngram.name)
        + _steps("pod-a", "4", False, "", 500, t_plain)
        + _steps("pod-a", "4", True, draft.name, 300, 2 * t_spec)
        + _drafts("pod-a", "4", draft.name, 300)
        + _steps("pod-a", "4", True, ngram.name, 300, view.prior(ngram).step_s(3.0, 3))
        + _drafts("pod-a", "4", ngram.name, 300)
    )
    snap = observations.build_snapshot(rows, 300.0)
    costs = core.FleetCosts([view], snap, mixed={(NS, "pod-a")})  # switched: labels still attribute
    assert costs.cost(view, draft).spec_ratio["4"] == pytest.approx(2.0, rel=0.02)
    assert costs.cost(view, ngram).spec_ratio["4"] == pytest.approx(1.0, rel=0.02)

    # The same steps without drafter labels (an engine from before them) mix two drafters: left out.
    unlabelled = [
        (k, {n: v for n, v in lab.items() if n != "drafter" or k not in _ENGINE}, x) for k, lab, x in rows
    ]
    snap = observations.build_snapshot(unlabelled, 300.0)
    costs = core.FleetCosts([view], snap, mixed={(NS, "pod-a")})
    assert costs.cost(view, draft).spec_ratio == {} and costs.cost(view, ngram).spec_ratio == {}


_ENGINE = (observations.STEPS, observations.STEP_SECONDS, observations.TOKENS)
