"""The observation builder rejects what parses but is wrong (docs/policy.md, "Inputs the controller
rejects"): non-finite, negative, implausible and inconsistent values, and steps that took no time. What it
drops it counts by reason, and nothing it lets through can make a decision raise or a status invalid."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from specserve_operator.api.models import SpeculativeServingStatus
from specserve_operator.tuner import core, observations
from specserve_operator.tuner.loop import ResourceTick
from specserve_operator.tuner.observations import build_snapshot
from specserve_operator.tuner.report import status_patch
from specserve_testing.tuner_loads import shadow_rows

NS = "ml"
PODS = ("pod-a", "pod-b")


def view_of(spec) -> core.ResourceView:
    return core.ResourceView(NS, "llm", spec, PODS)


def loads_of(bucket_load, prior) -> dict:
    """Bucket 4 speculating with K=3, bucket 64 plain, both at the prior's step times."""
    return {
        "4": bucket_load(batch=3, steps_spec=2000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0)),
    }


def fleet_rows(rows_for, loads, alphas=(0.1,) * 8) -> list[observations.Row]:
    return [r for pod in PODS for r in rows_for(NS, pod, "draft", loads, alphas=alphas)]


def replaced(rows: list[observations.Row], kind: str, pod: str, bucket: str | None, value: float) -> list:
    """The rows with one pod's `kind` row (in `bucket`, if given) set to `value`."""
    out = []
    for k, labels, v in rows:
        if k == kind and labels["pod"] == pod and (bucket is None or labels.get("bucket") == bucket):
            v = value
        out.append((k, labels, v))
    return out


def decide_on(view: core.ResourceView, rows: list, state: core.ResourceState, now: float) -> core.Decision:
    """A decision from these rows, at `now`, updating `state`."""
    snap = build_snapshot(rows, 300.0)
    return core.decide(view, snap, state, core.FleetCosts([view], snap), now)


def decide_and_report(spec, rows) -> tuple[core.Decision, dict]:
    """A decision from these rows, and the status patch it writes; the patch must be valid JSON and
    valid against the CRD's status schema."""
    view = view_of(spec)
    d = decide_on(view, rows, core.ResourceState.initial(spec), 0.0)
    patch = status_patch(ResourceTick(d), view, {}, datetime.now(UTC))
    SpeculativeServingStatus.model_validate(json.loads(json.dumps(patch, allow_nan=False)))
    return d, patch


def test_infinite_accepted_tokens_are_dropped_and_never_reach_status(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    loads = loads_of(bucket_load, view_of(spec).prior(spec.drafters[0]))
    rows = fleet_rows(rows_for, loads)
    poisoned = replaced(rows, observations.ACCEPTED, "pod-a", "4", float("inf"))
    d, patch = decide_and_report(spec, poisoned)
    # Acceptance 0.1 does not pay at K>0: the +Inf row must not turn bucket 4 on.
    assert d.k_by_bucket["4"] == decide_and_report(spec, rows)[0].k_by_bucket["4"] == 0
    assert 0.0 <= patch["fleet"]["acceptanceRate"] <= 1.0
    snap = build_snapshot(poisoned, 300.0)
    assert snap.dropped == {observations.DROP_NON_FINITE: 1}
    assert snap.pods[(NS, "pod-a")].by_drafter["draft"]["4"].accepted == 0.0  # the row is gone


def test_negative_counter_increases_are_dropped(spec_factory, rows_for, bucket_load) -> None:
    spec = spec_factory()
    loads = loads_of(bucket_load, view_of(spec).prior(spec.drafters[0]))
    rows = fleet_rows(rows_for, loads)
    negative = replaced(rows, observations.STEP_SECONDS, "pod-a", "64", -5.0)
    snap = build_snapshot(negative, 300.0)
    assert snap.dropped[observations.DROP_NEGATIVE] == 1
    # The refused seconds take that side of the bucket's steps and tokens with them (not then read as
    # steps that took no time).
    assert observations.DROP_ZERO_DURATION not in snap.dropped
    assert snap.pods[(NS, "pod-a")].buckets["64"].steps_plain == 0.0
    decide_and_report(spec, negative)


def test_more_accepted_than_drafted_drops_that_buckets_spec_counters_only(
    spec_factory, rows_for, bucket_load
) -> None:
    """Accepted and drafted tokens arrive in different rows: only folded can they be compared."""
    spec = spec_factory()
    prior = view_of(spec).prior(spec.drafters[0])
    loads = loads_of(bucket_load, prior)
    loads["16"] = bucket_load(batch=12, steps_spec=1000, step_s_spec=prior.step_s(12, 3), k=3)
    rows = fleet_rows(rows_for, loads)
    drafted = next(
        v
        for k, lab, v in rows
        if k == observations.DRAFT_TOKENS and lab["pod"] == "pod-a" and lab["bucket"] == "4"
    )
    rows = replaced(rows, observations.ACCEPTED, "pod-a", "4", 2 * drafted)
    snap = build_snapshot(rows, 300.0)
    assert snap.dropped == {observations.DROP_INCONSISTENT: 1}
    a = snap.pods[(NS, "pod-a")]
    assert (a.buckets["4"].drafts, a.buckets["4"].accepted) == (0.0, 0.0)
    assert a.buckets["4"].steps_spec == 2000  # the step counters of the bucket stay
    assert a.buckets["16"].drafts > 0 and a.buckets["16"].accepted <= a.buckets["16"].draft_tokens
    _, patch = decide_and_report(spec, rows)
    assert patch["fleet"]["acceptanceRate"] <= 1.0


@pytest.mark.parametrize(
    ("drafts", "draft_tokens", "accepted"),
    [(100.0, 50.0, 10.0), (0.0, 40.0, 0.0), (10.0, 10.0 * 17, 5.0)],
    ids=["fewer-tokens-than-drafts", "tokens-without-drafts", "drafts-longer-than-any-k"],
)
def test_contradicting_draft_counters_are_dropped(drafts, draft_tokens, accepted) -> None:
    lab = {"namespace": NS, "pod": "p", "bucket": "4", "drafter": "d"}
    rows = [
        (observations.DRAFTS, lab, drafts),
        (observations.DRAFT_TOKENS, lab, draft_tokens),
        (observations.ACCEPTED, lab, accepted),
    ]
    snap = build_snapshot(rows, 300.0)
    assert snap.dropped == {observations.DROP_INCONSISTENT: 1}
    assert snap.pods[(NS, "p")].buckets["4"].drafts == 0.0


def test_counters_equal_on_the_engine_but_ulps_apart_after_increase_are_kept() -> None:
    """At K = 1 drafts and draft tokens are the same count, and at a position every draft passed so are
    accepted and proposed; PromQL's increase() returns them a few ulps apart (as measured in the fleet
    simulator's windows). That is no contradiction: the drafts and positions stay."""
    drafts = 109821.22754409048
    lab = {"namespace": NS, "pod": "p", "bucket": "128", "drafter": "d"}
    pos = {"namespace": NS, "pod": "p", "drafter": "d", "position": "0"}
    rows = [
        (observations.DRAFTS, lab, drafts),
        (observations.DRAFT_TOKENS, lab, 109821.22754408652),
        (observations.ACCEPTED, lab, 58490.2),
        (observations.ACCEPTED_POS, pos, 1000.0000000001),
        (observations.PROPOSED_POS, pos, 1000.0),
    ]
    snap = build_snapshot(rows, 300.0)
    assert snap.dropped == {}
    stats = snap.pods[(NS, "p")].by_drafter["d"]
    assert stats["128"].drafts == drafts and stats[observations.ALL_BUCKETS].accepted_pos


def test_more_accepted_than_proposed_at_a_position_drops_the_positions() -> None:
    base = {"namespace": NS, "pod": "p", "drafter": "d"}
    rows = [
        (observations.ACCEPTED_POS, {**base, "position": "0"}, 80.0),
        (observations.PROPOSED_POS, {**base, "position": "0"}, 100.0),
        (observations.ACCEPTED_POS, {**base, "position": "1"}, 120.0),
        (observations.PROPOSED_POS, {**base, "position": "1"}, 100.0),
    ]
    snap = build_snapshot(rows, 300.0)
    assert snap.dropped == {observations.DROP_INCONSISTENT: 1}
    pooled = snap.pods[(NS, "p")].by_drafter["d"][observations.ALL_BUCKETS]
    assert pooled.accepted_pos == {} and pooled.proposed_pos == {}


def test_zero_step_seconds_are_dropped_instead_of_dividing_by_zero(
    spec_factory, rows_for, bucket_load
) -> None:
    """Steps counted with no time: today a ZeroDivisionError on every tick."""
    spec = spec_factory()
    prior = view_of(spec).prior(spec.drafters[0])
    loads = {
        label: bucket_load(
            batch=batch, steps_spec=2000, step_s_spec=0.0, steps_plain=2000, step_s_plain=0.0, k=3
        )
        for label, batch in (("4", 3), ("16", 12))
    }
    loads["64"] = bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0))
    rows = fleet_rows(rows_for, loads, alphas=(0.8,) * 8)
    d, _ = decide_and_report(spec, rows)
    assert d.action != "noData"
    snap = build_snapshot(rows, 300.0)
    # 2 pods x 2 buckets x (plain, spec, and the spec steps' copy under their drafter)
    assert snap.dropped == {observations.DROP_ZERO_DURATION: 12}
    assert snap.pods[(NS, "pod-a")].buckets["4"].steps_spec == 0.0
    assert snap.pods[(NS, "pod-a")].buckets["64"].steps_plain == 2000


@pytest.mark.parametrize(
    ("kind", "labels", "value", "reason"),
    [
        (
            observations.STEPS,
            {"bucket": "4", "speculating": "false"},
            float("nan"),
            observations.DROP_NON_FINITE,
        ),
        (observations.STEPS, {"bucket": "4", "speculating": "false"}, -1.0, observations.DROP_NEGATIVE),
        (observations.STEPS, {"speculating": "false"}, 1.0, observations.DROP_LABELS),
        (observations.TOKENS, {"bucket": "4"}, 1e300, observations.DROP_IMPLAUSIBLE),
        (observations.GPU_UTIL, {}, 250.0, observations.DROP_IMPLAUSIBLE),
        (observations.RECENT_STEPS, {}, 10.0, observations.DROP_LABELS),
        (observations.RECENT_STEPS, {"bucket": "4"}, float("inf"), observations.DROP_NON_FINITE),
        (observations.RECENT_STEPS, {"bucket": "4"}, -3.0, observations.DROP_NEGATIVE),
        (observations.ACCEPTED_POS, {"drafter": "d", "position": "²"}, 1.0, observations.DROP_LABELS),
        (observations.ACCEPTED_POS, {"drafter": "d", "position": "99"}, 1.0, observations.DROP_IMPLAUSIBLE),
        (observations.ACCEPTED_POS, {"drafter": "d", "position": "16"}, 1.0, observations.DROP_IMPLAUSIBLE),
        (
            observations.STEPS,
            {"bucket": "4", "speculating": "true", "k": "4x"},
            1.0,
            observations.DROP_LABELS,
        ),
        (
            observations.STEPS,
            {"bucket": "4", "speculating": "true", "k": "17"},
            1.0,
            observations.DROP_IMPLAUSIBLE,
        ),
        ("something_else", {}, 1.0, observations.DROP_KIND),
    ],
)
def test_each_rejected_row_is_counted_by_reason(kind, labels, value, reason) -> None:
    snap = build_snapshot([(kind, {"namespace": NS, "pod": "p", **labels}, value)], 300.0)
    assert snap.dropped == {reason: 1}
    assert not any(obs.has_engine_data for obs in snap.pods.values())


def test_k_and_position_labels_fold_by_their_number_however_written() -> None:
    """The engine writes "4" and "1"; a K or position written "04" or "01" is the same number (parsed,
    not looked up among the engine's spellings), and the largest of each is accepted."""
    spec = {"namespace": NS, "pod": "p", "bucket": "4", "speculating": "true", "drafter": "d"}
    pos = {"namespace": NS, "pod": "p", "drafter": "d"}
    rows = [
        (observations.STEPS, {**spec, "k": "4"}, 100.0),
        (observations.STEPS, {**spec, "k": "04"}, 50.0),
        (observations.STEPS, {**spec, "k": "16"}, 10.0),
        (observations.STEP_SECONDS, {**spec, "k": "4"}, 1.0),
        (observations.STEP_SECONDS, {**spec, "k": "16"}, 0.2),
        (observations.PROPOSED_POS, {**pos, "position": "1"}, 10.0),
        (observations.PROPOSED_POS, {**pos, "position": "01"}, 5.0),
        (observations.PROPOSED_POS, {**pos, "position": "15"}, 2.0),
    ]
    snap = build_snapshot(rows, 300.0)
    assert snap.dropped == {}
    stats = snap.pods[(NS, "p")].by_drafter["d"]
    assert stats["4"].steps_by_k == {4: 150.0, 16: 10.0}
    assert stats[observations.ALL_BUCKETS].proposed_pos == {1: 15.0, 15: 2.0}


def test_a_policy_version_that_is_not_a_small_decimal_is_ignored() -> None:
    """`"²".isdigit()` is true and `int("²")` raises: the label must not crash the read."""
    info = {"namespace": NS, "pod": "p", "drafter": "d", "mode": "on"}
    for version in ("²", "9" * 30, "-1", "3"):
        snap = build_snapshot([(observations.POLICY_INFO, {**info, "policy_version": version}, 1.0)], 300.0)
        assert snap.pods[(NS, "p")].policy_version == (3 if version == "3" else None)


def test_the_largest_speculative_k_is_the_crds() -> None:
    from specserve_operator.api.models import DrafterSpec

    bounds = [m.le for m in DrafterSpec.model_fields["max_speculative_tokens"].metadata if hasattr(m, "le")]
    assert bounds == [observations.MAX_SPECULATIVE_TOKENS]


@pytest.mark.parametrize("bad", [float("inf"), -5.0])
def test_a_refused_counter_takes_its_siblings_with_it(spec_factory, rows_for, bucket_load, bad) -> None:
    """+Inf (or negative) accepted tokens on every pod: the buckets' drafts must not then read as drafts
    of which none was accepted (that turned speculation off everywhere); they read as not measured, the
    K table stays, and the resource says its metrics were refused."""
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_of(bucket_load, view.prior(spec.drafters[0]))
    good = fleet_rows(rows_for, loads, alphas=(0.8,) * 8)
    bad_rows = replaced(
        replaced(good, observations.ACCEPTED, "pod-a", "4", bad), observations.ACCEPTED, "pod-b", "4", bad
    )
    state = core.ResourceState.initial(spec)
    first = decide_on(view, good, state, 0.0)
    snap = build_snapshot(bad_rows, 300.0)
    for pod in PODS:
        obs = snap.pods[(NS, pod)]
        assert obs.dropped == 1 and obs.by_drafter["draft"]["4"].drafts == 0.0
    d = core.decide(view, snap, state, core.FleetCosts([view], snap), 60.0)
    assert d.k_by_bucket["4"] == first.k_by_bucket["4"] > 0, d.reason
    assert core.INVALID_METRICS in d.warnings
    patch = status_patch(ResourceTick(d), view, {}, datetime.now(UTC))
    available = next(c for c in patch["conditions"] if c["type"] == "MetricsAvailable")
    assert (available["status"], available["reason"]) == ("False", core.INVALID_METRICS)


def test_refused_live_counts_hold_the_last_measurement_not_the_shadows(
    spec_factory, rows_for, bucket_load
) -> None:
    """+Inf accepted tokens, totals and per position, on every pod (the fault-fleet case): the drafter in
    force is no longer measured by its live drafts. Its shadow drafts, on other steps, say it accepts
    nearly everything; standing in for the refused counts they would move the K table on what the bad
    values took away. The last good measurement holds instead, and so does the table."""
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_of(bucket_load, view.prior(spec.drafters[0]))
    good = fleet_rows(rows_for, loads, alphas=(0.6,) * 8)
    good += [r for pod in PODS for r in shadow_rows(pod, "draft", (0.99,) * 4, namespace=NS)]
    bad = good
    for kind in (observations.ACCEPTED, observations.ACCEPTED_POS):
        for pod in PODS:
            bad = replaced(bad, kind, pod, None, float("inf"))
    state = core.ResourceState.initial(spec)
    first = decide_on(view, good, state, 0.0)
    measured = state.acceptance_seen["draft"]
    assert measured[0].source == "measured" and measured[0].alphas[0] < 0.7, first.reason
    snap = build_snapshot(bad, 300.0)
    assert all(obs.refused_drafters == {"draft"} for obs in snap.pods.values())
    drafters = {d.name: d for d in spec.drafters}
    assert core.measured_acceptance(drafters, list(snap.pods.values()))["draft"].source == core.REFUSED
    held = decide_on(view, bad, state, 60.0)
    assert state.acceptance_seen["draft"] == measured  # held as it was, not refreshed
    assert held.k_by_bucket == first.k_by_bucket, held.reason
    # Without the refusal the shadow would have moved it: the test would not pass by accident.
    shadow_only = [r for r in good if r[0] not in (observations.ACCEPTED, observations.ACCEPTED_POS)]
    moved = decide_on(view, shadow_only, core.ResourceState.initial(spec), 0.0)
    assert moved.k_by_bucket != first.k_by_bucket, moved.reason
