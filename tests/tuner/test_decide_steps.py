"""The steps of `core.decide`, each on its own: the mode's override, the data gate, acceptance, scores,
demotion, the drafter choice, the K table, the canary, the action's name, and the pooled step costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specserve_operator.tuner import core, policy
from specserve_operator.tuner.observations import POLICY_INFO, RECENT_STEPS, FleetSnapshot, build_snapshot
from specserve_operator.tuner.policy import MIN_STEPS
from specserve_testing.tuner_loads import loads_at_prior

NS = "ml"


def view_of(spec, pods=("pod-a", "pod-b")) -> core.ResourceView:
    return core.ResourceView(NS, "llm", spec, tuple(pods))


def recent_rows(recent: dict[str, float]) -> list:
    """pod-a's steps per bucket in the acceptance window, as the reader returns them."""
    return [(RECENT_STEPS, {"namespace": NS, "pod": "pod-a", "bucket": b}, n) for b, n in recent.items()]


def acceptance(alpha: float, source: str = "measured", max_k: int = 4) -> policy.Acceptance:
    return policy.Acceptance((alpha,) * max_k, source)


def test_the_mode_forces_a_policy_only_when_it_is_not_auto(spec_factory) -> None:
    off = core.forced_policy(spec_factory(speculation__mode="off"))
    on = core.forced_policy(spec_factory(speculation__mode="on"))
    assert off is not None and (off.mode, off.drafter, set(off.k_by_bucket.values())) == ("off", None, {0})
    assert on is not None and (on.mode, on.drafter, set(on.k_by_bucket.values())) == ("on", "draft", {4})
    assert core.forced_policy(spec_factory(speculation__mode="auto")) is None


def test_nothing_is_decided_without_every_pods_metrics(spec_factory, rows_for, bucket_load) -> None:
    spec = spec_factory()
    loads = {"4": bucket_load(batch=3.0, steps_plain=1000, step_s_plain=0.01)}
    one = build_snapshot(rows_for(NS, "pod-a", "draft", loads), 300.0)
    both = build_snapshot(
        rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads), 300.0
    )
    assert core.missing_data(view_of(spec, pods=()), both) == core.MissingData(
        "hold", "no ready pods", None, push=True
    )
    partial = core.missing_data(view_of(spec), one)
    assert partial == core.MissingData("noData", "no metrics for pods pod-b", core.PARTIAL_DATA, push=True)
    none = core.missing_data(view_of(spec), build_snapshot([], 300.0))
    assert none is not None and none.action == "noData" and none.warning == core.METRICS_MISSING
    assert not none.push
    assert core.missing_data(view_of(spec), both) is None


def test_acceptance_is_measured_per_drafter_and_a_prior_without_drafts(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    snap = build_snapshot(rows_for(NS, "pod-a", "draft", loads, alphas=(0.6,) * 8), 300.0)
    accs = core.measured_acceptance({d.name: d for d in spec.drafters}, list(snap.pods.values()))
    assert accs["draft"].source == "measured"
    assert accs["draft"].alphas[:3] == pytest.approx((0.6, 0.6, 0.6))
    assert accs["ngram"].source == "prior"


def test_only_measured_drafters_are_scored_and_the_better_scores_higher(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    snap = build_snapshot(rows_for(NS, "pod-a", "draft", loads), 300.0)
    observations = list(snap.pods.values())
    costs = core.FleetCosts([view], snap)
    assert set(
        core.drafter_scores(
            view, {"draft": acceptance(0.8), "ngram": acceptance(0.8, "prior")}, costs, observations
        )
    ) == {"draft"}
    good = core.drafter_scores(
        view, {"draft": acceptance(0.9), "ngram": acceptance(0.9)}, costs, observations
    )
    poor = core.drafter_scores(
        view, {"draft": acceptance(0.3), "ngram": acceptance(0.3)}, costs, observations
    )
    assert good["draft"] > poor["draft"] > 0


def test_drafters_are_scored_on_the_batch_mix_of_the_acceptance_window(
    spec_factory, rows_for, bucket_load
) -> None:
    # Ranked on acceptance measured now, a drafter must also be weighed at the batch sizes running now:
    # the metrics window's mix is mostly the traffic before a change of load.
    spec = spec_factory()
    view = view_of(spec)
    draft = spec.drafters[0]
    loads = loads_at_prior(bucket_load, view.prior(draft))
    rows = rows_for(NS, "pod-a", "draft", loads)
    accs = {"draft": acceptance(0.8)}
    costs = core.FleetCosts([view], build_snapshot(rows, 300.0))
    gains = {
        label: max(1.0, choice.gain)
        for label, choice in policy.choose_table(
            accs["draft"],
            costs.cost(view, draft),
            spec.speculation.batch_buckets,
            draft.max_speculative_tokens,
        ).items()
    }

    def score(recent: dict[str, float]) -> float:
        snap = build_snapshot(rows + recent_rows(recent), 300.0)
        return core.drafter_scores(view, accs, costs, list(snap.pods.values()))["draft"]

    assert gains["4"] > gains["64"] * 1.05  # the test means something only if the buckets differ
    assert score({"4": 50.0}) == pytest.approx(gains["4"])
    assert score({"64": 50.0}) == pytest.approx(gains["64"])
    assert score({"4": 50.0, "64": 50.0}) == pytest.approx((gains["4"] + gains["64"]) / 2)
    # Without the short window's steps (an engine that does not report them), the metrics window's mix.
    assert score({}) == pytest.approx(sum(gains[b] for b in ("4", "16", "64")) / 3)


def test_a_drafter_under_the_floor_is_demoted_after_the_cooldown_and_reconsidered_later(spec_factory) -> None:
    spec = spec_factory(speculation__malFloor=1.5)
    drafters = {d.name: d for d in spec.drafters}
    cooldown = spec.speculation.cooldown_seconds
    accs = {"draft": acceptance(0.1), "ngram": acceptance(0.9)}
    first = core.demotions(drafters, accs, {}, {}, spec.speculation, now=0.0)
    assert (first.demoted, first.under_floor_since, first.notes) == ({}, {"draft": 0.0}, [])
    later = core.demotions(drafters, accs, {}, first.under_floor_since, spec.speculation, now=cooldown)
    assert later.demoted == {"draft": cooldown} and later.under_floor_since == {}
    assert later.notes == ["demoted draft: MAL 1.11 < floor 1.5"]
    expired = core.demotions(
        drafters,
        {"draft": acceptance(0.9), "ngram": acceptance(0.9)},
        later.demoted,
        {},
        spec.speculation,
        now=cooldown + core.DEMOTION_TTL_S,
    )
    assert expired.demoted == {}
    # Back above the floor before the cooldown: the clock restarts.
    recovered = core.demotions(
        drafters,
        {"draft": acceptance(0.9), "ngram": acceptance(0.9)},
        {},
        {"draft": 0.0},
        spec.speculation,
        1.0,
    )
    assert recovered.under_floor_since == {}


def test_a_better_drafter_needs_a_margin_and_a_cooled_down_switch() -> None:
    names = ["a", "b", "c"]
    assert core.better_drafter("a", names, {"a": 1.0, "b": 1.2}, {}, {}, cooled_down=True) == "b"
    assert core.better_drafter("a", names, {"a": 1.0, "b": 1.04}, {}, {}, cooled_down=True) is None
    assert core.better_drafter("a", names, {"a": 1.0, "b": 1.2}, {}, {}, cooled_down=False) is None
    assert core.better_drafter("a", names, {"a": 1.0, "b": 1.2}, {}, {"b": 0.0}, cooled_down=True) is None


def test_a_drafter_in_force_that_sat_out_counts_at_its_last_score() -> None:
    """With every bucket off the drafter in force makes no drafts and is not measured now; a trial of
    another drafter must beat its last score (else plain decoding), not nothing."""
    names = ["a", "b"]
    assert core.better_drafter("a", names, {"b": 1.2}, {"a": 1.3, "b": 1.2}, {}, cooled_down=True) is None
    assert core.better_drafter("a", names, {"b": 1.02}, {}, {}, cooled_down=True) is None  # plain: 1.0
    assert core.better_drafter("a", names, {"b": 1.2}, {"a": 1.0}, {}, cooled_down=True) == "b"


def test_a_demoted_drafter_in_force_gives_way_at_once() -> None:
    names = ["a", "b", "c"]
    demoted = {"a": 0.0}
    # To the best measured one, even within the cooldown...
    assert core.better_drafter("a", names, {"b": 1.1, "c": 1.3}, {}, demoted, cooled_down=False) == "c"
    # ...else to the best remembered one...
    assert core.better_drafter("a", names, {}, {"b": 1.5, "c": 1.2}, demoted, cooled_down=False) == "b"
    # ...and to none when every drafter is demoted.
    assert core.better_drafter("a", names, {}, {}, {"a": 0.0, "b": 0.0, "c": 0.0}, cooled_down=True) is None


def test_the_k_table_turns_on_where_speculation_pays_and_finds_the_cliff(spec_factory) -> None:
    spec = spec_factory()
    view = view_of(spec)
    labels = policy.bucket_labels(spec.speculation.batch_buckets)
    # Speculative steps measured earlier, as fast as the prior says (remembered ratios of 1).
    cost = policy.CalibratedCost(
        view.prior(spec.drafters[0]), {}, spec.speculation.batch_buckets, remembered=({}, {labels[0]: 1.0})
    )
    off = dict.fromkeys(labels, 0)
    update, cliff = core.k_table(acceptance(0.8), cost, 4, off, {}, spec.speculation, now=0.0)
    assert update.k_by_bucket[labels[0]] > 0 and set(update.flipped) <= set(labels)
    assert cliff is None or cliff > 1
    assert all(r.startswith("bucket ") for r in update.reasons)
    # A bucket flipped within the cooldown keeps its state (hysteresis).
    held, _ = core.k_table(acceptance(0.8), cost, 4, off, {labels[0]: 0.0}, spec.speculation, now=1.0)
    assert held.k_by_bucket[labels[0]] == 0
    # Unless a canary is measuring acceptance there again (the load fell): on a fresh acceptance, until
    # the tick after it ends.
    interval = spec.speculation.evaluation_interval_seconds

    def within_cooldown(acc: policy.Acceptance, until: float) -> int:
        update, _ = core.k_table(
            acc, cost, 4, off, {labels[0]: 0.0}, spec.speculation, 1.0, (), {labels[0]: until}
        )
        return update.k_by_bucket[labels[0]]

    assert within_cooldown(acceptance(0.8), until=1.0) > 0
    assert within_cooldown(acceptance(0.8), until=1.0 - interval) == 0
    assert within_cooldown(acceptance(0.8, "remembered"), until=1.0) == 0
    # A K above the drafter's maximum is capped first.
    capped, _ = core.k_table(acceptance(0.8), cost, 2, dict.fromkeys(labels, 9), {}, spec.speculation, 0.0)
    assert max(capped.k_by_bucket.values()) <= 2


def test_the_prior_alone_turns_nothing_on_fleet_wide_while_a_canary_can_measure(spec_factory) -> None:
    spec = spec_factory()
    view = view_of(spec)
    never = core.FleetCosts([view], FleetSnapshot(window_s=300.0)).cost(view, spec.drafters[0])
    assert not never.any_spec_measured
    off = dict.fromkeys(policy.bucket_labels(spec.speculation.batch_buckets), 0)
    waiting, _ = core.k_table(acceptance(0.8), never, 4, off, {}, spec.speculation, now=0.0)
    assert not any(waiting.k_by_bucket.values()) and not waiting.flipped
    assert waiting.reasons[-1].endswith("wait for a canary's measurement (prior only)")
    # Without exploration nothing would ever measure it: the prior decides.
    no_canaries = spec.speculation.model_copy(update={"exploration_share": 0.0})
    prior_only, _ = core.k_table(acceptance(0.8), never, 4, off, {}, no_canaries, now=0.0)
    assert any(prior_only.k_by_bucket.values())


def test_a_canary_tries_a_drafter_not_measured_for_a_trial_period(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    state = core.ResourceState.initial(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    snap = build_snapshot(
        rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads), 300.0
    )
    accs = {"draft": acceptance(0.8), "ngram": acceptance(0.8, "prior")}
    canary, note = core.next_canary(
        view, state, accs, core.FleetCosts([view], snap), list(snap.pods.values()), 0.0
    )
    assert canary is not None and (canary.pod, canary.drafter, canary.purpose) == ("pod-a", "ngram", "trial")
    assert note == "trial of drafter ngram on pod pod-a" and any(canary.k_by_bucket.values())
    assert state.canary is None  # the step only proposes; decide records it
    # A live canary is kept; with no exploration share, none is started.
    state.canary = canary
    kept, note = core.next_canary(view, state, accs, core.FleetCosts([view], snap), [], 1.0)
    assert (kept, note) == (canary, None)
    quiet = view_of(spec_factory(speculation__explorationShare=0.0))
    state.canary = None
    assert core.next_canary(quiet, state, accs, core.FleetCosts([quiet], snap), [], 0.0) == (None, None)


def test_a_canary_explores_an_off_bucket_with_traffic_and_no_measurement(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    state = core.ResourceState.initial(spec)
    prior = view.prior(spec.drafters[0])
    loads = loads_at_prior(bucket_load, prior)
    loads["128"] = bucket_load(batch=100, steps_plain=5 * MIN_STEPS, step_s_plain=prior.step_s(100, 0))
    snap = build_snapshot(
        rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads), 300.0
    )
    costs = core.FleetCosts([view], snap)
    state.k_by_bucket = {label: (3 if label in ("4", "16", "64") else 0) for label in state.k_by_bucket}
    canary, note = core.next_canary(
        view, state, {"draft": acceptance(0.8)}, costs, list(snap.pods.values()), 0.0
    )
    assert canary is not None and canary.purpose == "explore" and canary.drafter == "draft"
    assert canary.k_by_bucket["128"] > 0 and note is not None and note.startswith("explore bucket 128")
    assert {k: v for k, v in canary.k_by_bucket.items() if k != "128"} == {
        k: v for k, v in state.k_by_bucket.items() if k != "128"
    }


def test_a_drafter_scored_well_on_other_batches_gets_no_early_trial(
    spec_factory, rows_for, bucket_load
) -> None:
    """A trial comes before its period when the drafter's last score beats the one in force's, and
    when it also wins on this tick's batches: a draft model scored at batch 1 in a quiet phase is no
    candidate at batch 16 in a busy one, where its own steps were never measured. The drafter a switch
    left behind faces the same tests (it had a trial due one cooldown after the switch, which on the
    local fleet ran the draft model at batch 16 for 20 s of a busy phase)."""
    spec = spec_factory()
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[1]))
    rows = rows_for(NS, "pod-a", "ngram", loads) + rows_for(NS, "pod-b", "ngram", loads)
    # The draft model's own steps, measured at batch 1 only (a quiet phase, the window before).
    prior = view.prior(spec.drafters[0])
    quiet = {"1": bucket_load(batch=1, steps_spec=1000, step_s_spec=prior.step_s(1, 4), k=4)}
    rows += [r for r in rows_for(NS, "pod-a", "draft", quiet) if r[0] != POLICY_INFO]
    accs = {"ngram": acceptance(0.5), "draft": acceptance(0.8, "remembered")}
    interval = spec.speculation.evaluation_interval_seconds
    now = 10_000.0

    def tick_at(bucket: str) -> tuple[core.FleetCosts, list]:
        """This tick's window: the batches of the acceptance window all in `bucket`."""
        snap = build_snapshot(rows + recent_rows({bucket: 500.0}), 300.0)
        return core.FleetCosts([view], snap), list(snap.pods.values())

    def trial_of_draft(bucket: str, switched_ago: float | None = None) -> bool:
        state = core.ResourceState.initial(spec)
        if switched_ago is not None:  # in force until a switch to n-gram that long ago
            state.drafter = "draft"
            core._switch_drafter(view, state, spec.drafter("ngram"), 1.0, [], now - switched_ago)
        else:  # tried since the last trial period began, but long enough ago for an early one
            state.drafter = "ngram"
            state.last_trial_at = {"draft": now - (core.EARLY_TRIAL_GAP_TICKS + 1) * interval}
        state.last_score = {"ngram": 1.05, "draft": 1.8}
        canary, _ = core.next_canary(view, state, accs, *tick_at(bucket), now)
        return canary is not None and canary.purpose == "trial" and canary.drafter == "draft"

    scores = {
        b: core.drafter_scores(view, accs, *tick_at(b), ["draft"], "ngram")["draft"] for b in ("1", "+Inf")
    }
    # Far above the batches it was measured at, the draft model counts as off (policy.MAX_EXTRAPOLATION).
    assert scores["1"] > 1.05 * 1.05 > scores["+Inf"] == 1.0
    assert trial_of_draft("1")
    assert not trial_of_draft("+Inf")
    # Left behind: it may come back at once, where its successor's fleet-wide measurement disappoints;
    # never where it would not win on the tick's batches, then or after a cooldown.
    assert trial_of_draft("1", switched_ago=interval)
    cooled = spec.speculation.cooldown_seconds + interval
    assert not trial_of_draft("+Inf", switched_ago=interval)
    assert not trial_of_draft("+Inf", switched_ago=cooled)


def _measured_and_off(spec_factory, rows_for, bucket_load, slow: float = 1.0):
    """One drafter, every bucket's step times measured (at the prior's speed times `slow`), all off."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]), slow=slow)
    snap = build_snapshot(
        rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads), 300.0
    )
    state = core.ResourceState.initial(spec)
    state.k_by_bucket = {label: 0 for label in state.k_by_bucket}
    state.last_score["draft"] = 1.0  # measured before: not a cold start
    return view, state, core.FleetCosts([view], snap), list(snap.pods.values())


@pytest.mark.parametrize("source", ["remembered", "totals", "prior"])
def test_a_stale_acceptance_is_measured_again_where_a_bucket_could_pay(
    spec_factory, rows_for, bucket_load, source
) -> None:
    """Every bucket off and no drafts in the acceptance window: the acceptance in hand came from other
    traffic (a busy phase's prose), and nothing else would measure it again. The lowest off bucket with
    traffic speculates on the canary at the largest K."""
    view, state, costs, observations = _measured_and_off(spec_factory, rows_for, bucket_load)
    canary, note = core.next_canary(view, state, {"draft": acceptance(0.3, source)}, costs, observations, 0.0)
    assert canary is not None and canary.purpose == "explore" and canary.remeasure
    assert canary.k_by_bucket == {**state.k_by_bucket, "4": 4}
    assert note == f"explore bucket 4 with k=4 on pod pod-a: acceptance {source}, not measured now"


def test_the_canary_goes_where_the_batches_are_now(spec_factory, rows_for, bucket_load) -> None:
    """In a burst the metrics window still holds the quiet minutes' small batches, but the acceptance
    window's steps are all at large ones: a canary in bucket 4 would draft nothing and measure nothing
    (a demoted n-gram drafter stayed off through a code burst that way in the simulator)."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    rows = rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads)
    state = core.ResourceState.initial(spec)
    state.k_by_bucket = {label: 0 for label in state.k_by_bucket}
    state.last_score["draft"] = 1.0

    def explored(recent: dict[str, float]) -> str | None:
        snap = build_snapshot(rows + recent_rows(recent), 300.0)
        costs = core.FleetCosts([view], snap)
        _, note = core.next_canary(
            view, state, {"draft": acceptance(0.3, "remembered")}, costs, list(snap.pods.values()), 0.0
        )
        return note

    assert (
        explored({"64": 500.0})
        == "explore bucket 64 with k=4 on pod pod-a: acceptance remembered, not measured now"
    )
    assert explored({"4": 10.0, "64": 500.0}).startswith("explore bucket 4 ")  # type: ignore[union-attr]
    # Without the short window's steps (an engine that does not report them), the lowest bucket.
    assert explored({}).startswith("explore bucket 4 ")  # type: ignore[union-attr]


def test_when_the_load_falls_the_bucket_it_fell_into_is_explored_at_once(
    spec_factory, rows_for, bucket_load
) -> None:
    """A busy phase ended with every bucket off: the acceptance in hand is the busy traffic's, and the
    quiet traffic's value waits for the next explore, up to a period away (a whole phase of the local
    fleet). When the batches move to a smaller bucket, that explore goes at once, once a period, and
    measures acceptance there again even where the acceptance in hand is fresh: it was measured largely
    on the traffic before. Not when the load rises."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    loads = loads_at_prior(bucket_load, view.prior(spec.drafters[0]))
    rows = rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads)
    interval = spec.speculation.evaluation_interval_seconds
    period = core.EXPLORE_TICKS * interval / (spec.speculation.exploration_share * 2)
    assert period > 3 * core.EXPLORE_TICKS * interval  # an early explore is early
    stale = {"draft": acceptance(0.3, "remembered")}

    def tick(
        state: core.ResourceState, recent: dict[str, float], now: float, accs=stale, window=rows
    ) -> str | None:
        snap = build_snapshot(window + recent_rows(recent), 300.0)
        canary, note = core.next_canary(
            view, state, accs, core.FleetCosts([view], snap), list(snap.pods.values()), now
        )
        if canary is not None and note is not None:
            core._started(state, canary, now)
        state.canary = None  # ended: each tick asks afresh
        return note

    def busy_then(now: float) -> core.ResourceState:
        state = core.ResourceState.initial(spec)
        state.k_by_bucket = {label: 0 for label in state.k_by_bucket}
        state.last_score["draft"] = 1.0
        state.last_explore_at = now - 2 * core.EXPLORE_TICKS * interval  # an explore in the busy phase
        assert tick(state, {"64": 500.0}, now) is None
        return state

    state = busy_then(1000.0)
    note = tick(state, {"4": 400.0, "64": 100.0}, 1000.0 + interval)
    assert note == (
        "explore bucket 4 with k=4 on pod pod-a: acceptance remembered, not measured now; "
        "the batches moved to a smaller bucket"
    )
    # Its bucket may turn on inside the cooldown until the tick after the canary ends (k_table).
    assert state.remeasured_until == {"4": 1000.0 + interval + core.EXPLORE_TICKS * interval}
    # Once a period: the next fall waits for the period.
    assert tick(state, {"64": 500.0}, 1000.0 + 4 * core.EXPLORE_TICKS * interval) is None
    assert tick(state, {"4": 500.0}, 1000.0 + 5 * core.EXPLORE_TICKS * interval) is None
    assert tick(state, {"4": 500.0}, 1000.0 + interval + period).startswith("explore bucket 4 ")  # type: ignore[union-attr]
    # Never sooner than EXPLORE_TICKS after the last explore.
    state = busy_then(1000.0)
    state.last_explore_at = 1000.0
    assert tick(state, {"4": 500.0}, 1000.0 + interval) is None
    assert tick(state, {"4": 500.0}, 1000.0 + core.EXPLORE_TICKS * interval) is not None
    # The load rose: no early explore.
    state = core.ResourceState.initial(spec)
    state.k_by_bucket = {label: 0 for label in state.k_by_bucket}
    state.last_score["draft"] = 1.0
    state.last_explore_at = 1000.0 - 2 * core.EXPLORE_TICKS * interval
    assert tick(state, {"4": 500.0}, 1000.0) is None
    assert tick(state, {"64": 500.0}, 1000.0 + interval) is None
    # A fresh acceptance was measured largely on the traffic before: the bucket the batches moved to
    # is measured again all the same, and only it.
    state = busy_then(1000.0)
    fresh = {"draft": acceptance(0.3, "measured")}
    assert tick(state, {"4": 400.0, "64": 100.0}, 1000.0 + interval, fresh) == (
        "explore bucket 4 with k=4 on pod pod-a: acceptance measured on the traffic before the batches "
        "moved here"
    )
    state = busy_then(1000.0)
    assert tick(state, {"16": 400.0, "4": 100.0}, 1000.0 + interval, fresh).startswith(  # type: ignore[union-attr]
        "explore bucket 16 "
    )
    # Once the period is over, a fresh acceptance gets no explore of step times measured now, as before.
    state = busy_then(1000.0)
    state.last_explore_at = 0.0
    assert tick(state, {"64": 500.0}, 1000.0 + interval, fresh) is None
    # Turned off this very tick, after running speculative steps only: the batches are there all the same.
    spec_only = dict(loads)
    spec_only["4"] = replace(loads["4"], steps_plain=0.0)
    only_spec_rows = rows_for(NS, "pod-a", "draft", spec_only) + rows_for(NS, "pod-b", "draft", spec_only)
    state = busy_then(1000.0)
    assert tick(state, {"4": 500.0}, 1000.0 + interval, fresh, only_spec_rows).startswith(  # type: ignore[union-attr]
        "explore bucket 4 with k=4 "
    )
    # Step times that say no drafter could pay there were timed on the traffic before as well (a busy
    # phase's batch-1 steps): the bucket the batches moved to is measured again all the same, and a
    # stale acceptance alone measures no bucket they say that of.
    slow = loads_at_prior(bucket_load, view.prior(spec.drafters[0]), slow=8.0)
    slow_rows = rows_for(NS, "pod-a", "draft", slow) + rows_for(NS, "pod-b", "draft", slow)
    state = busy_then(1000.0)
    assert tick(state, {"4": 500.0}, 1000.0 + interval, stale, slow_rows).startswith(  # type: ignore[union-attr]
        "explore bucket 4 with k=4 "
    )
    state = busy_then(1000.0)
    state.last_explore_at = 0.0
    assert tick(state, {"4": 200.0, "64": 500.0}, 1000.0 + interval, stale, slow_rows) is None
    assert tick(state, {"4": 200.0, "64": 500.0}, 1000.0 + interval, stale) is not None
    # Where the batches moved to is on, an early explore has nothing to measure, and the probe of the
    # next K (bucket 4 measured at one K) keeps to the period.
    state = busy_then(1000.0)
    state.k_by_bucket["4"] = 3
    assert tick(state, {"4": 500.0}, 1000.0 + interval, fresh) is None
    assert tick(state, {"4": 500.0}, 1000.0 + period, fresh).startswith("probe bucket 4 ")  # type: ignore[union-attr]


def test_a_fresh_acceptance_or_a_bucket_that_cannot_pay_gets_no_canary(
    spec_factory, rows_for, bucket_load
) -> None:
    view, state, costs, observations = _measured_and_off(spec_factory, rows_for, bucket_load)
    for fresh in ("measured", "shadow"):
        assert core.next_canary(view, state, {"draft": acceptance(0.3, fresh)}, costs, observations, 0.0) == (
            None,
            None,
        )
    # Speculative steps 20 times dearer than the prior's: K + 1 tokens a step would not pay.
    view, state, costs, observations = _measured_and_off(spec_factory, rows_for, bucket_load, slow=20.0)
    assert all(
        policy.ceiling_gain(costs.cost(view, view.spec.drafters[0]), label, 4)
        < view.spec.speculation.min_gain
        for label in ("4", "16", "64")
    )
    stale = {"draft": acceptance(0.3, "remembered")}
    assert core.next_canary(view, state, stale, costs, observations, 0.0) == (None, None)


def _remembered_off(spec_factory, rows_for, bucket_load, slow: float):
    """Bucket 64's speculative step times measured an hour ago (`slow` times the prior's), only its plain
    steps now, and it is off; buckets 4 and 16 on at K 4."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    prior = view.prior(spec.drafters[0])
    memory = policy.RatioMemory()
    then = loads_at_prior(bucket_load, prior, k=4, slow=slow)
    rows = rows_for(NS, "pod-a", "draft", then) + rows_for(NS, "pod-b", "draft", then)
    core.FleetCosts([view], build_snapshot(rows, 300.0), memory=memory, now=0.0)
    now = loads_at_prior(bucket_load, prior, k=4)
    now["64"] = bucket_load(batch=48.0, steps_plain=1000, step_s_plain=prior.step_s(48.0, 0))
    snap = build_snapshot(rows_for(NS, "pod-a", "draft", now) + rows_for(NS, "pod-b", "draft", now), 300.0)
    state = core.ResourceState.initial(spec)
    state.k_by_bucket = {label: (4 if label in ("4", "16") else 0) for label in state.k_by_bucket}
    state.last_score["draft"] = 1.5
    costs = core.FleetCosts([view], snap, memory=memory, now=3600.0)
    return view, state, costs, list(snap.pods.values())


def test_a_bucket_off_on_remembered_step_times_is_measured_again_where_it_could_pay(
    spec_factory, rows_for, bucket_load
) -> None:
    """Remembered step times that predict a gain between plain decoding's and minGain keep a bucket off,
    and nothing else would measure it again: the canary speculates there at its predicted best K. Where
    they predict a loss, or the bucket's step times are measured now, no canary goes there."""
    view, state, costs, observations = _remembered_off(spec_factory, rows_for, bucket_load, slow=1.2)
    cost = costs.cost(view, view.spec.drafters[0])
    accs = {"draft": acceptance(0.5)}
    choice = policy.best_k(accs["draft"], cost, "64", 4)
    assert cost.measured_spec("64") and not cost.measured_spec_now("64") and choice.gain >= 1.0
    canary, note = core.next_canary(view, state, accs, costs, observations, 0.0)
    assert canary is not None and canary.purpose == "explore" and not canary.remeasure
    assert canary.k_by_bucket == {**state.k_by_bucket, "64": choice.k}
    assert note == (
        f"explore bucket 64 with k={choice.k} on pod pod-a: step times remembered (gain {choice.gain:.2f}), "
        "not measured now"
    )
    # Speculation 20 times dearer than the prior there: slower than plain decoding, no canary.
    view, state, costs, observations = _remembered_off(spec_factory, rows_for, bucket_load, slow=20.0)
    assert policy.best_k(accs["draft"], costs.cost(view, view.spec.drafters[0]), "64", 4).gain < 1.0
    canary, _ = core.next_canary(view, state, accs, costs, observations, 0.0)
    assert canary is not None and canary.k_by_bucket["64"] == 0  # a probe of an on bucket's K, not 64
    # The same step times as the first case, measured in the window: they stand.
    loads = loads_at_prior(bucket_load, view.prior(view.spec.drafters[0]), k=4, slow=1.2)
    snap = build_snapshot(
        rows_for(NS, "pod-a", "draft", loads) + rows_for(NS, "pod-b", "draft", loads), 300.0
    )
    costs = core.FleetCosts([view], snap)
    assert costs.cost(view, view.spec.drafters[0]).measured_spec_now("64")
    canary, _ = core.next_canary(view, state, accs, costs, list(snap.pods.values()), 0.0)
    assert canary is not None and canary.k_by_bucket["64"] == 0


def _on_at(spec_factory, rows_for, bucket_load, ks: tuple[int, ...], slow: float = 1.0):
    """One drafter, buckets 4, 16 and 64 on at the first K of `ks`, each pod's speculative steps there
    at one K of `ks` (pod-a the first, pod-b the last), `slow` times the prior's step time."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    prior = view.prior(spec.drafters[0])
    rows = rows_for(NS, "pod-a", "draft", loads_at_prior(bucket_load, prior, k=ks[0], slow=slow))
    rows += rows_for(NS, "pod-b", "draft", loads_at_prior(bucket_load, prior, k=ks[-1], slow=slow))
    snap = build_snapshot(rows, 300.0)
    state = core.ResourceState.initial(spec)
    on = ("4", "16", "64")
    state.k_by_bucket = {label: (ks[0] if label in on else 0) for label in state.k_by_bucket}
    state.last_score["draft"] = 1.5
    return view, state, core.FleetCosts([view], snap), list(snap.pods.values())


def test_a_k_measured_alone_in_its_bucket_has_its_neighbour_probed_on_a_canary(
    spec_factory, rows_for, bucket_load
) -> None:
    """Every bucket with traffic is on, its step time measured at the K in force only: the prior's shape
    prices every other K. The canary runs the neighbouring K predicted best in one bucket, so the window
    holds two Ks there; once it does, or while acceptance is not measured now, no probe goes."""
    view, state, costs, observations = _on_at(spec_factory, rows_for, bucket_load, (3,))
    accs = {"draft": acceptance(0.8)}
    canary, note = core.next_canary(view, state, accs, costs, observations, 0.0)
    assert canary is not None and canary.purpose == "explore" and not canary.remeasure
    changed = {b: k for b, k in canary.k_by_bucket.items() if k != state.k_by_bucket[b]}
    assert len(changed) == 1
    ((label, k),) = changed.items()
    cost = costs.cost(view, view.spec.drafters[0])
    choice = policy.best_k(accs["draft"], cost, label, 4)
    assert k in (2, 4) and choice.gain_at(k) >= choice.gain_at(3) * (1 - core.PROBE_SHORTFALL)
    assert choice.gain_at(k) >= choice.gain_at(6 - k)  # the better neighbour
    assert note == f"probe bucket {label} at k={k} on pod pod-a: its step time is not measured now"
    stale = {"draft": acceptance(0.8, "remembered")}
    assert core.next_canary(view, state, stale, costs, observations, 0.0) == (None, None)
    view, state, costs, observations = _on_at(spec_factory, rows_for, bucket_load, (3, 4))
    assert costs.cost(view, view.spec.drafters[0]).measured_ks_now("16") == (3, 4)
    assert core.next_canary(view, state, accs, costs, observations, 0.0) == (None, None)
    # K = 1 in force, speculation 20 times dearer than the prior: K = 2 predicted far below it, no probe.
    view, state, costs, observations = _on_at(spec_factory, rows_for, bucket_load, (1,), slow=20.0)
    cost = costs.cost(view, view.spec.drafters[0])
    for label in ("4", "16", "64"):
        choice = policy.best_k(accs["draft"], cost, label, 4)
        assert choice.gain_at(2) < choice.gain_at(1) * (1 - core.PROBE_SHORTFALL)
    assert core.next_canary(view, state, accs, costs, observations, 0.0) == (None, None)


def test_an_off_bucket_measured_at_one_k_has_another_k_probed(spec_factory, rows_for, bucket_load) -> None:
    """Every bucket off, its step times measured in the window at K = 3 only, at a gain between plain
    decoding's and minGain: the other Ks are priced from that one. The lowest bucket with traffic runs,
    on the canary, the K not measured predicted best, if it predicts at least plain decoding's speed.
    None where the K measured was slower than plain decoding, where every K was measured, or at a cold
    start (the drafter is measured as it runs first)."""
    accs = {"draft": acceptance(0.4)}
    view, state, costs, observations = _measured_and_off(spec_factory, rows_for, bucket_load, slow=1.1)
    cost = costs.cost(view, view.spec.drafters[0])
    choice = policy.best_k(accs["draft"], cost, "4", 4)
    assert cost.measured_ks_now("4") == (3,) and 1.0 <= choice.gain_at(3) < view.spec.speculation.min_gain
    assert max(choice.gain_at(k) for k in (2, 4)) < choice.gain_at(1)
    canary, note = core.next_canary(view, state, accs, costs, observations, 0.0)
    assert canary is not None and canary.purpose == "explore" and not canary.remeasure
    assert canary.k_by_bucket == {**state.k_by_bucket, "4": 1}
    assert note == (
        "probe bucket 4 at k=1 on pod pod-a: measured off at other Ks, this one predicted at least plain "
        "decoding's speed"
    )
    cold = replace(state, last_score={})
    assert core.next_canary(view, cold, accs, costs, observations, 0.0) == (None, None)
    # Measured slower than plain decoding at K = 3: K = 1, priced from it, is not measured on a line.
    view, state, costs, observations = _measured_and_off(spec_factory, rows_for, bucket_load, slow=1.2)
    slower = policy.best_k(accs["draft"], costs.cost(view, view.spec.drafters[0]), "4", 4)
    assert slower.gain_at(3) < 1.0 <= slower.gain_at(1)
    assert core.next_canary(view, state, accs, costs, observations, 0.0) == (None, None)
    # Every K measured in the window (a pod at each), K = 1 at a gain between plain decoding's and
    # minGain: it was measured to stay off, and nothing is priced from another K.
    spec = view.spec
    pods = ("pod-a", "pod-b", "pod-c", "pod-d")
    prior = view.prior(spec.drafters[0])
    rows = [
        row
        for k, pod in enumerate(pods, start=1)
        for row in rows_for(NS, pod, "draft", loads_at_prior(bucket_load, prior, k=k, slow=1.05))
    ]
    view = view_of(spec, pods)
    snap = build_snapshot(rows, 300.0)
    costs = core.FleetCosts([view], snap)
    cost = costs.cost(view, spec.drafters[0])
    low = {"draft": acceptance(0.3)}
    assert cost.measured_ks_now("4") == (1, 2, 3, 4)
    assert 1.0 <= policy.best_k(low["draft"], cost, "4", 4).gain < view.spec.speculation.min_gain
    assert core.next_canary(view, state, low, costs, list(snap.pods.values()), 0.0) == (None, None)


def test_a_remeasuring_canary_that_measured_nothing_does_not_use_up_the_share(
    spec_factory, rows_for, bucket_load
) -> None:
    """Its bucket saw too few steps to measure acceptance (and cost as little): it goes on, on the same
    pod and without a new policy, or the next one goes at once. Any other explore waits out the
    exploration period."""
    view, state, costs, observations = _measured_and_off(spec_factory, rows_for, bucket_load)
    stale = {"draft": acceptance(0.3, "remembered")}
    remeasure_4 = {**state.k_by_bucket, "4": 4}
    # The same measurement is still the one to make: the canary goes on.
    state.last_explore_at = 0.0
    ended = core.Canary("pod-b", "draft", dict(remeasure_4), 10.0, "explore", True)
    state.canary = ended
    canary, note = core.next_canary(view, state, stale, costs, observations, 15.0)
    assert canary is ended and note is None and canary.until > 15.0 and state.last_explore_at == 15.0
    # Another bucket had been measuring: the next canary starts now, on the same pod.
    state.last_explore_at = 0.0
    state.canary = core.Canary("pod-b", "draft", {**state.k_by_bucket, "16": 4}, 10.0, "explore", True)
    canary, note = core.next_canary(view, state, stale, costs, observations, 15.0)
    assert canary is not None and canary.pod == "pod-b" and canary.k_by_bucket == remeasure_4
    assert note is not None and note.startswith("explore bucket 4")
    # An explore of unmeasured step times, or a remeasure that measured: the period holds.
    for ended, accs in (
        (core.Canary("pod-b", "draft", dict(remeasure_4), 10.0, "explore", False), stale),
        (core.Canary("pod-b", "draft", dict(remeasure_4), 10.0, "explore", True), {"draft": acceptance(0.9)}),
    ):
        state.last_explore_at, state.canary = 0.0, ended
        assert core.next_canary(view, state, accs, costs, observations, 15.0) == (None, None)
        assert state.last_explore_at == 0.0


def test_a_table_change_is_named_by_its_weightiest_bucket_change() -> None:
    assert core.table_action({"1": 2, "2": 0}, {"1": 0, "2": 3}) == "disable"
    assert core.table_action({"1": 2, "2": 0}, {"1": 2, "2": 3}) == "enable"
    assert core.table_action({"1": 2}, {"1": 3}) == "setK"
    assert core.table_action({"1": 2}, {"1": 2}) == "hold"


def test_the_action_names_the_weightiest_change() -> None:
    table = {"1": 2, "2": 2}
    old = core.PolicyInForce("a", table, None)
    trial = core.Canary("pod-a", "b", table, 100.0, "trial")
    assert core.action_name(old, core.PolicyInForce("b", table, None), "b", False, False) == "rollout"
    assert core.action_name(old, core.PolicyInForce("b", table, None), None, True, False) == "switchDrafter"
    assert core.action_name(old, core.PolicyInForce("a", table, None), None, True, False) == "demote"
    assert (
        core.action_name(old, core.PolicyInForce("a", {"1": 2, "2": 0}, None), None, False, False)
        == "disable"
    )
    assert core.action_name(old, core.PolicyInForce("a", table, trial), None, False, False) == "trial"
    assert core.action_name(old, old, None, False, False) == "hold"
    # Every drafter demoted: a demotion if pods get a new policy, else a hold.
    zeros = {"1": 0, "2": 0}
    assert core.action_name(old, core.PolicyInForce("a", zeros, None), None, False, True) == "demote"
    assert core.action_name(old, old, None, False, True) == "hold"


def test_with_every_drafter_demoted_only_the_table_and_canary_change_the_policy() -> None:
    old = core.PolicyInForce("a", {"1": 0}, None)
    assert core.policy_changed(old, core.PolicyInForce("b", {"1": 0}, None), every_drafter_demoted=False)
    assert not core.policy_changed(old, core.PolicyInForce("b", {"1": 0}, None), every_drafter_demoted=True)
    assert core.policy_changed(old, core.PolicyInForce("a", {"1": 1}, None), every_drafter_demoted=True)


def test_a_drafter_without_speculative_steps_borrows_its_siblings_excess(
    spec_factory, rows_for, bucket_load
) -> None:
    spec = spec_factory()
    view = view_of(spec)
    draft, ngram = spec.drafters
    prior = view.prior(draft)
    slow = loads_at_prior(bucket_load, prior)
    for label, load in slow.items():  # speculation adds twice what the prior predicts
        slow[label] = bucket_load(
            batch=load.batch,
            steps_plain=load.steps_plain,
            step_s_plain=load.step_s_plain,
            steps_spec=load.steps_spec,
            step_s_spec=load.step_s_plain + 2 * (load.step_s_spec - load.step_s_plain),
            k=load.k,
        )
    snap = build_snapshot(rows_for(NS, "pod-a", "draft", slow) + rows_for(NS, "pod-b", "draft", slow), 300.0)
    costs = core.FleetCosts([view], snap)
    measured = costs.cost(view, draft)
    assert measured.measured_excess == pytest.approx(2.0, rel=0.05)
    borrowed = costs.cost(view, ngram)  # never ran: no speculative steps of its own
    assert not borrowed.excess_ratio and borrowed.ratio("4", 3) == pytest.approx(2.0, rel=0.05)
    alone = core.FleetCosts([view], FleetSnapshot(window_s=300.0)).cost(view, ngram)
    assert alone.ratio("4", 3) == pytest.approx(1.0)
    assert costs.cost(view, ngram) is borrowed  # one calibration per group per tick


def test_every_drafter_of_an_engine_calibrates_its_plain_step_on_all_its_plain_steps(
    spec_factory, rows_for, bucket_load
) -> None:
    """Plain steps run the target alone: the drafter in force measures them for every drafter of the same
    engine. A drafter measured only on a canary (speculative steps alone) then has the plain step the
    pods measured, not the prior's, and its excess is what it adds to that step, not the plain step's
    error as well. The memory keeps plain steps per engine too."""
    spec = spec_factory()
    view = view_of(spec)
    draft, ngram = spec.drafters
    prior = view.prior(ngram)
    plain_s = 1.5 * prior.step_s(48.0, 0)  # the prior under-predicts the plain step by a third
    excess_s = prior.step_s(48.0, 3) - prior.step_s(48.0, 0)  # what n-gram adds: as predicted
    in_force = {"64": bucket_load(batch=48.0, steps_plain=1000, step_s_plain=plain_s)}
    canary = {"64": bucket_load(batch=48.0, steps_spec=1000, step_s_spec=plain_s + excess_s, k=3)}
    rows = rows_for(NS, "pod-a", "draft", in_force) + rows_for(NS, "pod-b", "ngram", canary)
    memory = policy.RatioMemory()
    cost = core.FleetCosts([view], build_snapshot(rows, 300.0), memory=memory, now=0.0).cost(view, ngram)
    assert cost.measured_plain_now("64") and cost.ratio("64", 0) == pytest.approx(1.5, rel=0.02)
    assert cost.ratio("64", 3) == pytest.approx(1.0, rel=0.02)
    assert cost.step_s("64", 0) == pytest.approx(plain_s, rel=0.02)
    # A tick later nothing is measured: both drafters recall the engine's plain step.
    later = core.FleetCosts([view], FleetSnapshot(window_s=300.0), memory=memory, now=60.0)
    for drafter in (draft, ngram):
        recalled = later.cost(view, drafter)
        assert not recalled.measured_plain_now("64") and recalled.ratio("64", 0) == pytest.approx(
            1.5, rel=0.02
        )


def test_a_bucket_turned_off_on_a_remembered_plain_step_turns_on_when_its_plain_step_says_so(
    spec_factory, rows_for, bucket_load
) -> None:
    """Bucket 64 speculates; its plain step is remembered from a quieter time, half what it takes now,
    so the gain reads under 1 and the bucket goes off at once. One tick later its plain steps are
    measured and say speculation pays: it is on again, inside the cooldown. A bucket turned off on a
    plain step measured in the window waits the cooldown out."""
    spec = spec_factory()
    spec = spec.model_copy(update={"drafters": spec.drafters[:1]})
    view = view_of(spec)
    draft = spec.drafters[0]
    prior = view.prior(draft)
    plain_then = prior.step_s(48.0, 0)
    plain_now, spec_now = 2 * plain_then, 3.2 * plain_then
    memory = policy.RatioMemory()
    then = {"64": bucket_load(batch=48.0, steps_plain=1000, step_s_plain=plain_then)}
    core.FleetCosts([view], build_snapshot(rows_for(NS, "pod-a", "draft", then), 300.0), memory=memory)

    def retune(state: core.ResourceState, loads: dict, now: float) -> list[str]:
        """What changed in bucket 64 (the others borrow its ratios and may change too)."""
        snap = build_snapshot(rows_for(NS, "pod-a", "draft", loads), 300.0)
        costs = core.FleetCosts([view], snap, memory=memory, now=now)
        return [n for n in core._retune(view, state, draft, acceptance(0.7), costs, now) if "bucket 64 " in n]

    state = core.ResourceState.initial(spec)
    state.k_by_bucket = {label: (3 if label == "64" else 0) for label in state.k_by_bucket}
    on = {"64": bucket_load(batch=48.0, steps_spec=1000, step_s_spec=spec_now, k=3)}
    assert retune(state, on, 100.0)[0].startswith("bucket 64 off")
    assert state.off_on_estimate == {"64"}
    off = {"64": bucket_load(batch=48.0, steps_plain=1000, step_s_plain=plain_now)}
    assert retune(state, off, 130.0)[0].startswith("bucket 64 on")
    assert state.k_by_bucket["64"] > 0 and not state.off_on_estimate
    # Plain and speculative steps both measured in the window, speculation slower: off, on a measurement.
    state = core.ResourceState.initial(spec)
    state.k_by_bucket = {label: (3 if label == "64" else 0) for label in state.k_by_bucket}
    both = {
        "64": bucket_load(
            batch=48.0,
            steps_plain=1000,
            step_s_plain=plain_now,
            steps_spec=1000,
            step_s_spec=7 * plain_then,
            k=3,
        )
    }
    assert retune(state, both, 200.0)[0].startswith("bucket 64 off")
    assert not state.off_on_estimate
    # Plain steps three times dearer a tick later: speculation would pay, and the cooldown holds it off.
    dearer = {"64": bucket_load(batch=48.0, steps_plain=1000, step_s_plain=6 * plain_then)}
    choice = policy.best_k(
        acceptance(0.7),
        core.FleetCosts(
            [view], build_snapshot(rows_for(NS, "pod-a", "draft", dearer), 300.0), memory=memory, now=230.0
        ).cost(view, draft),
        "64",
        draft.max_speculative_tokens,
    )
    assert choice.gain >= spec.speculation.min_gain
    assert retune(state, dearer, 230.0) == [] and state.k_by_bucket["64"] == 0


def test_a_drafter_not_in_force_counts_as_off_far_above_the_batch_sizes_it_was_measured_at(
    spec_factory, rows_for, bucket_load
) -> None:
    """The draft model speculated at batch 3 only; the traffic now runs at batch 48, more than 8 times
    the bucket it was measured in. In force, it is scored at its extrapolated gain there (it turns the
    bucket on and is measured a tick later); as a candidate to switch to, bucket 64 counts as off, so no
    switch rests on the extrapolation."""
    spec = spec_factory()
    view = view_of(spec)
    prior = view.prior(spec.drafters[0])
    loads = loads_at_prior(bucket_load, prior, buckets=(("4", 3.0),))
    loads["64"] = bucket_load(batch=48.0, steps_plain=5000, step_s_plain=prior.step_s(48, 0))
    snap = build_snapshot(rows_for(NS, "pod-a", "draft", loads), 300.0)
    costs = core.FleetCosts([view], snap)
    cost = costs.cost(view, spec.drafters[0])
    # Batches above 8 x 4: from bucket 64 (33-64) on; 16 and 32 are extrapolated as before.
    labels = policy.bucket_labels(spec.speculation.batch_buckets)
    assert cost.above_measured_range == set(labels[labels.index("64") :])
    accs = {"draft": acceptance(0.8), "ngram": acceptance(0.8, "prior")}
    observed = list(snap.pods.values())
    in_force = core.drafter_scores(view, accs, costs, observed, in_force="draft")["draft"]
    candidate = core.drafter_scores(view, accs, costs, observed, in_force="ngram")["draft"]
    choices = policy.choose_table(accs["draft"], cost, spec.speculation.batch_buckets, 4)
    assert choices["64"].gain > 1.0  # the extrapolation would have counted
    assert candidate == pytest.approx((2000 * choices["4"].gain + 5000 * 1.0) / 7000)
    assert in_force == pytest.approx((2000 * choices["4"].gain + 5000 * choices["64"].gain) / 7000)
    # Measured nowhere: every step time is the prior's, and nothing is held back (a trial measures first).
    never = core.FleetCosts([view], FleetSnapshot(window_s=300.0)).cost(view, spec.drafters[1])
    assert never.above_measured_range == set()
