"""Measurement first, prior second: once a drafter and a bucket have been measured, the prior never
decides for them again while the measurement is remembered, even after it leaves the metrics window."""

from __future__ import annotations

from specserve_operator.tuner import core, observations, policy
from specserve_testing.tuner_loads import BUCKETS, loads_at_prior

NS = "ml"


def view_of(spec, pods=("pod-a", "pod-b")) -> core.ResourceView:
    return core.ResourceView(NS, "llm", spec, tuple(pods))


def acceptance(alpha: float, source: str) -> policy.Acceptance:
    return policy.Acceptance((alpha,) * 4, source)


def test_a_drafter_without_drafts_keeps_its_last_measured_acceptance() -> None:
    measured = {"a": acceptance(0.3, "measured"), "b": acceptance(0.6, "prior")}
    accs, memory = core.recalled_acceptance(measured, {}, now=0.0)
    assert accs == measured and set(memory) == {"a"}
    # Every bucket off: no drafts in the window, so the measurement stands in, marked as remembered.
    quiet = {"a": acceptance(0.6, "prior"), "b": acceptance(0.6, "prior")}
    accs, memory = core.recalled_acceptance(quiet, memory, now=600.0)
    assert accs["a"].source == "remembered" and accs["a"].alphas == measured["a"].alphas
    assert accs["b"].source == "prior"  # never measured: the prior stands
    later = core.ACCEPTANCE_TTL_S + 1
    accs, memory = core.recalled_acceptance(quiet, memory, now=later)
    assert accs["a"].source == "prior" and memory == {}


def test_an_unmeasured_bucket_borrows_remembered_ratios_before_the_prior(spec_factory) -> None:
    spec = spec_factory()
    prior = view_of(spec).prior(spec.drafters[0])
    bounds = tuple(spec.speculation.batch_buckets)
    # Nothing speculated in this window; two buckets were measured 8x slower than the prior earlier.
    cost = policy.CalibratedCost(prior, {}, bounds, remembered=({}, {"4": 8.0, "16": 8.0}))
    assert cost.ratio("64", 3) == 8.0 and cost.measured_spec("4") and not cost.measured_spec("64")
    assert policy.CalibratedCost(prior, {}, bounds).ratio("64", 3) == 1.0  # never measured: the prior


def test_speculation_measured_slow_stays_off_after_the_window_forgets_it(
    spec_factory, rows_for, bucket_load
) -> None:
    """Speculation measured 10x slower than the prior says (a CPU-like truth) is turned off; windows later,
    with no draft left in the window, neither the K table nor an exploration canary turns it back on
    from the prior."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    prior = view.prior(spec.drafters[0])
    slow = loads_at_prior(bucket_load, prior, slow=10.0, buckets=BUCKETS[:2])
    plain = {
        label: bucket_load(batch=b, steps_plain=1000, step_s_plain=prior.step_s(b, 0))
        for label, b in (("4", 3.0), ("16", 12.0))
    }
    memory = policy.RatioMemory()
    state = core.ResourceState.initial(spec)
    state.k_by_bucket = dict.fromkeys(state.k_by_bucket, 3)
    cooldown = spec.speculation.cooldown_seconds
    windows = [(0.0, slow)] + [(cooldown * t + 600.0, plain) for t in range(1, 8)]
    for now, loads in windows:
        rows = rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads)
        snap = observations.build_snapshot(rows, 300.0)
        d = core.decide(view, snap, state, core.FleetCosts([view], snap, (), memory, now), now)
        assert not any(d.k_by_bucket.values()), (now, d.reason)
        assert all(not any(t.k_by_bucket.values()) for t in d.pods.values()), (now, d.reason)


def test_a_pod_first_seen_has_not_switched_drafters(spec_factory, rows_for, bucket_load) -> None:
    """Pods start speculating with the drafter they were rendered with: the tuner's first look at them is
    not a drafter switch, so their speculative steps calibrate the step times at once."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})  # one drafter: no trial canary
    view = view_of(spec)
    prior = view.prior(spec.drafters[0])
    loads = loads_at_prior(bucket_load, prior, slow=10.0, buckets=BUCKETS[:2])
    rows = rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads)
    snap = observations.build_snapshot(rows, 300.0)
    state = core.ResourceState.initial(spec)
    d = core.decide(view, snap, state, core.FleetCosts([view], snap), 30.0)
    assert state.switched_pods(60.0, 300.0) == set()
    assert d.k_by_bucket["4"] == 0 and d.k_by_bucket["16"] == 0, d.reason  # measured 10x slow: off


def test_a_measurement_of_the_acceptance_window_outranks_the_totals_while_the_windows_overlap() -> None:
    """Live drafts fall under the acceptance window's minimum (a switch turned every bucket off, say):
    the metrics window's totals then reach back to the traffic before a mix change (on the local fleet,
    n-gram's totals said α 0.35 from a trial on the code phase, its shadow 0.66 on prose five seconds
    before, and the draft model it had just left won an early trial on it). The last measurement from
    the acceptance window stands while that window overlaps this one."""
    fresh = {"a": acceptance(0.66, "shadow")}
    _, memory = core.recalled_acceptance(fresh, {}, now=100.0, acceptance_window_s=12.0)
    stale = {"a": acceptance(0.35, "totals")}
    accs, kept = core.recalled_acceptance(stale, memory, now=105.0, acceptance_window_s=12.0)
    assert accs["a"].source == "remembered" and accs["a"].alphas == fresh["a"].alphas
    assert kept == memory  # still dated when it was measured: it gives way one window on
    accs, kept = core.recalled_acceptance(stale, memory, now=112.0, acceptance_window_s=12.0)
    assert accs["a"] == stale["a"] and kept["a"] == (stale["a"], 112.0)
    # Totals remembered are no measurement of the acceptance window: the totals of now stand.
    _, memory = core.recalled_acceptance(stale, {}, now=100.0, acceptance_window_s=12.0)
    accs, _ = core.recalled_acceptance({"a": acceptance(0.5, "totals")}, memory, 105.0, 12.0)
    assert accs["a"].alphas == (0.5,) * 4


def test_decide_keeps_a_recent_acceptance_window_measurement_over_the_totals(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafter("ngram")))
    per_position = (observations.ACCEPTED_POS, observations.PROPOSED_POS)
    rows = [
        r
        for pod in view.pods
        for r in rows_for(NS, pod, "ngram", loads, alphas=(0.35,) * 8)
        if r[0] not in per_position  # few live drafts in the acceptance window: totals only
    ]
    snapshot = observations.build_snapshot(rows, 300.0)
    now = 10_000.0
    window = observations.acceptance_window_of(300.0)
    for measured_ago, kept in ((window / 2, True), (window + 1, False)):
        state = core.ResourceState.initial(spec)
        state.drafter, state.decided = "ngram", True
        shadow = (acceptance(0.66, "shadow"), now - measured_ago)
        state.acceptance_seen = {"ngram": shadow}
        core.decide(view, snapshot, state, core.FleetCosts([view], snapshot), now)
        assert (state.acceptance_seen["ngram"] == shadow) is kept
        if not kept:
            assert state.acceptance_seen["ngram"][0].source == "totals"
