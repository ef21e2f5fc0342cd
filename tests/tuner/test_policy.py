"""The policy and the cost model as pure functions."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specserve_operator.tuner import costmodel
from specserve_operator.tuner import policy as tuner_policy
from specserve_operator.tuner.observations import BucketStats

BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128)


def prior(
    method: str = "eagle3", gpu: str = "NVIDIA-H200", model: str = "llama-3.1-8b", context: float = 1024.0
) -> costmodel.StepCostPrior:
    return costmodel.StepCostPrior(
        costmodel.model_shape(model), costmodel.gpu_spec(gpu), costmodel.drafter_cost(method), context
    )


def flat_acceptance(alpha: float, n: int = 8) -> tuner_policy.Acceptance:
    return tuner_policy.Acceptance((alpha,) * n, "measured")


def measured_at(p: costmodel.StepCostPrior, batch: float, spec_factor: float) -> BucketStats:
    """A bucket's counters: 1,000 plain steps as the prior predicts, 1,000 at K = 3 where speculation adds
    `spec_factor` times what the prior predicts."""
    return BucketStats(
        steps_plain=1000,
        seconds_plain=1000 * p.step_s(batch, 0),
        tokens_plain=1000 * batch,
        steps_spec=1000,
        seconds_spec=1000 * (p.step_s(batch, 0) + spec_factor * (p.step_s(batch, 3) - p.step_s(batch, 0))),
        drafts=1000 * batch,
        draft_tokens=3000 * batch,
    )


# ---- cost model -------------------------------------------------------------------------------------


def test_gpu_lookup_by_node_label_and_a_generic_prior_for_an_unknown_gpu() -> None:
    assert costmodel.gpu_spec("NVIDIA-H100-80GB-HBM3").name == "H100"
    assert costmodel.gpu_spec("NVIDIA-H200").name == "H200"
    assert costmodel.known_gpu("NVIDIA-A100-SXM4-80GB") is None
    generic = costmodel.gpu_spec("NVIDIA-A100-SXM4-80GB")
    assert generic == costmodel.GENERIC_GPU
    # Not promised more than the known GPUs give before it is measured.
    assert all(generic.hbm_bytes_per_s < g.hbm_bytes_per_s for g in costmodel.GPUS.values())


def test_model_shape_from_served_name() -> None:
    assert costmodel.model_shape("llama-3.1-70b-instruct").layers == 80
    assert costmodel.model_shape("Llama-3.1-8B-Instruct").params == pytest.approx(8.0e9)
    assert costmodel.model_shape("qwen-14b").params == pytest.approx(14e9)


def test_decode_is_memory_bound_at_small_batch_and_compute_bound_at_large() -> None:
    m, g = costmodel.MODELS["8b"], costmodel.gpu_spec("H200")
    t1 = costmodel.verify_step_s(m, g, 1, 1, 0)
    assert t1 == pytest.approx(m.weight_bytes / g.hbm_bytes_per_s + g.step_overhead_s, rel=1e-3)
    # Below the ridge, verifying 4 tokens per sequence costs almost nothing more than one.
    assert costmodel.verify_step_s(m, g, 4, 4, 0) / costmodel.verify_step_s(m, g, 4, 1, 0) < 1.01
    # Far above it, time grows with the tokens verified.
    big = costmodel.verify_step_s(m, g, 256, 4, 0) / costmodel.verify_step_s(m, g, 256, 1, 0)
    assert big > 3.0


def test_h200_bandwidth_makes_small_batches_faster_than_h100() -> None:
    assert prior(gpu="NVIDIA-H200").step_s(1, 0) < prior(gpu="NVIDIA-H100").step_s(1, 0)


def test_kv_traffic_grows_with_context() -> None:
    m, g = costmodel.MODELS["8b"], costmodel.gpu_spec("H100")
    assert costmodel.verify_step_s(m, g, 64, 1, 8000) > 1.5 * costmodel.verify_step_s(m, g, 64, 1, 500)


def test_drafter_costs_by_kind() -> None:
    g = costmodel.gpu_spec("H100")
    model_drafter, parallel, lookup = (
        costmodel.drafter_cost("draftModel"),
        costmodel.drafter_cost("medusa"),
        costmodel.drafter_cost("ngram"),
    )
    assert model_drafter.draft_s(g, 4, 4, 1000) == pytest.approx(4 * model_drafter.draft_s(g, 4, 1, 1000))
    assert parallel.draft_s(g, 4, 4, 1000) == pytest.approx(parallel.draft_s(g, 4, 1, 1000))
    assert lookup.draft_s(g, 4, 4, 1000) < 1e-3
    assert model_drafter.draft_s(g, 4, 0, 1000) == 0.0
    with pytest.raises(ValueError, match=r"drafters\[\]\.method"):
        costmodel.drafter_cost("telepathy")


# ---- acceptance -------------------------------------------------------------------------------------


def test_expected_tokens_matches_leviathan_for_iid_acceptance() -> None:
    for alpha in (0.3, 0.6, 0.8, 0.9):
        for k in range(0, 8):
            closed = (1 - alpha ** (k + 1)) / (1 - alpha)
            assert tuner_policy.expected_tokens((alpha,) * 8, k) == pytest.approx(closed)


def test_expected_tokens_uses_per_position_products() -> None:
    assert tuner_policy.expected_tokens((0.9, 0.5, 0.1), 3) == pytest.approx(1 + 0.9 + 0.45 + 0.045)


def test_iid_alpha_inverts_mal() -> None:
    for alpha in (0.2, 0.5, 0.8):
        mal = (1 - alpha**5) / (1 - alpha)
        assert tuner_policy.iid_alpha_from_mal(mal, 4) == pytest.approx(alpha, abs=1e-6)
    assert tuner_policy.iid_alpha_from_mal(1.0, 4) == 0.0


def test_conditional_acceptance_from_per_position_counters() -> None:
    # Survival 0.8, 0.6, 0.3 → conditional 0.8, 0.75, 0.5.
    stats = BucketStats(
        drafts=1000,
        accepted_pos={0: 800, 1: 600, 2: 300},
        proposed_pos={0: 1000, 1: 1000, 2: 1000},
    )
    acc = tuner_policy.acceptance(stats, max_k=5)
    assert acc.source == "measured"
    assert acc.alphas[:3] == pytest.approx((0.8, 0.75, 0.5))
    # Positions never proposed continue the last one, a little lower (over-dispersion).
    assert acc.alphas[3] == pytest.approx(0.5 * tuner_policy.EXTRAPOLATION_DECAY)


def test_acceptance_denominator_is_per_position() -> None:
    # Only half the drafts reached position 1 (K varied): its survival is 200/500, not 200/1000.
    stats = BucketStats(drafts=1000, accepted_pos={0: 800, 1: 200}, proposed_pos={0: 1000, 1: 500})
    assert tuner_policy.acceptance(stats, 2).alphas == pytest.approx((0.8, 0.5))


def test_acceptance_falls_back_to_totals_then_prior() -> None:
    alpha = 0.7
    totals = BucketStats(drafts=1000, draft_tokens=3000, accepted=1000 * (alpha + alpha**2 + alpha**3))
    acc = tuner_policy.acceptance(totals, 3)
    assert acc.source == "totals"
    assert acc.alphas[0] == pytest.approx(alpha, abs=1e-4)
    empty = tuner_policy.acceptance(BucketStats(), 3)
    assert empty.source == "prior" and empty.alphas == (tuner_policy.PRIOR_ALPHA,) * 3
    # vLLM's own counters (no buckets) when the plugin's are absent.
    assert tuner_policy.acceptance(BucketStats(), 3, fallback=totals).source == "totals"


# ---- choosing K, the cliff, hysteresis --------------------------------------------------------------


def test_calibration_reproduces_measured_steps_and_scales_what_speculation_adds() -> None:
    p = prior()
    label = "8"
    batch = 6.0
    measured = BucketStats(
        steps_plain=1000,
        seconds_plain=1000 * p.step_s(batch, 0) * 1.3,
        tokens_plain=1000 * batch,
        steps_spec=1000,
        seconds_spec=1000 * p.step_s(batch, 3) * 1.6,
        drafts=1000 * batch,
        draft_tokens=3000 * batch,
    )
    cost = tuner_policy.CalibratedCost(p, {label: measured}, BOUNDS)
    assert cost.batch[label] == pytest.approx(batch)
    assert cost.step_s(label, 0) == pytest.approx(p.step_s(batch, 0) * 1.3)
    assert cost.step_s(label, 3) == pytest.approx(p.step_s(batch, 3) * 1.6)
    # Another K costs the measured plain step plus the prior's excess at that K, scaled as K = 3's was.
    excess = (p.step_s(batch, 3) * 1.6 - p.step_s(batch, 0) * 1.3) / (p.step_s(batch, 3) - p.step_s(batch, 0))
    assert cost.ratio(label, 1) == pytest.approx(excess)
    assert cost.step_s(label, 1) == pytest.approx(
        p.step_s(batch, 0) * 1.3 + (p.step_s(batch, 1) - p.step_s(batch, 0)) * excess
    )
    # An unmeasured bucket borrows the measured ratios.
    assert cost.ratio("64", 2) == pytest.approx(excess) and cost.ratio("64", 0) == pytest.approx(1.3)
    assert cost.measured_spec(label) and not cost.measured_spec("64")


def test_an_excess_dearer_than_the_prior_makes_large_k_dear_not_small_k() -> None:
    """Plain steps as the prior predicts, speculation adding three times what it predicts (verification
    turning compute-bound): measured at K = 4, K = 1 keeps its small excess. One factor on the whole step
    (measured / predicted at K = 4) would price K = 1 far above what it costs, and prefer large K."""
    p = prior()
    label, batch = "32", 24.0

    def true_step(k: int) -> float:
        return p.step_s(batch, 0) + 3 * (p.step_s(batch, k) - p.step_s(batch, 0))

    measured = BucketStats(
        steps_plain=500,
        seconds_plain=500 * true_step(0),
        tokens_plain=500 * batch,
        steps_spec=500,
        seconds_spec=500 * true_step(4),
        drafts=500 * batch,
        draft_tokens=4 * 500 * batch,
        steps_by_k={4: 500},
        seconds_by_k={4: 500 * true_step(4)},
    )
    cost = tuner_policy.CalibratedCost(p, {label: measured}, BOUNDS)
    for k in range(1, 6):
        assert cost.step_s(label, k) == pytest.approx(true_step(k))
    whole_step_factor = true_step(4) / p.step_s(batch, 4)
    assert p.step_s(batch, 1) * whole_step_factor > 1.1 * true_step(1)


def test_steps_where_part_of_the_batch_drafted_price_a_whole_drafting_batch_in_full() -> None:
    """A bucket's speculative steps ran with a quarter of the batch drafting (a draft model's steps at
    the edge of a bucket switched off), each adding a quarter of the excess the prior predicts for the
    whole batch. Priced for a whole batch drafting, the excess is the prior's in full, not a quarter:
    measured as if all had drafted, those steps had made speculation at batch 16 look cheap."""
    p = prior()
    label, batch, steps = "16", 15.0, 400
    excess = p.step_s(batch, 4) - p.step_s(batch, 0)
    accepted = steps * batch / 4 * 2.0
    partly_drafted = BucketStats(
        steps_plain=steps,
        seconds_plain=steps * p.step_s(batch, 0),
        tokens_plain=steps * batch,
        steps_spec=steps,
        seconds_spec=steps * (p.step_s(batch, 0) + excess / 4),
        tokens_spec=steps * batch + accepted,
        drafts=steps * batch / 4,
        draft_tokens=steps * batch,
        accepted=accepted,
        steps_by_k={4: steps},
        seconds_by_k={4: steps * (p.step_s(batch, 0) + excess / 4)},
    )
    assert tuner_policy.proposal_rate(partly_drafted) == pytest.approx(0.25)
    cost = tuner_policy.CalibratedCost(p, {label: partly_drafted}, BOUNDS)
    assert cost.ratio(label, 4) == pytest.approx(1.0)
    assert cost.step_s(label, 4) == pytest.approx(p.step_s(batch, 4))
    assert cost.step_s(label, 4, rate=0.25) == pytest.approx(p.step_s(batch, 0) + excess / 4)
    whole = tuner_policy.best_k(flat_acceptance(0.6), cost, label, 4)
    quarter = tuner_policy.best_k(replace(flat_acceptance(0.6), proposal_rate=0.25), cost, label, 4)
    assert whole.gain == pytest.approx(
        tuner_policy.expected_tokens((0.6,) * 4, whole.k) * p.step_s(batch, 0) / p.step_s(batch, whole.k)
    )
    assert quarter.gain != pytest.approx(whole.gain)


def test_a_measured_excess_below_the_floor_is_raised_to_it() -> None:
    p = prior()
    noisy = measured_at(p, 6.0, 1.0)
    noisy.seconds_spec = noisy.seconds_plain / noisy.steps_plain * noisy.steps_spec * 0.9  # faster than plain
    cost = tuner_policy.CalibratedCost(p, {"8": noisy}, BOUNDS)
    assert cost.ratio("8", 3) == tuner_policy.EXCESS_RATIO_FLOOR


def test_sibling_spec_overhead_is_borrowed_when_a_group_has_no_spec_steps() -> None:
    p = prior("ngram")
    plain_only = {"8": BucketStats(steps_plain=100, seconds_plain=100 * p.step_s(6, 0), tokens_plain=600)}
    cost = tuner_policy.CalibratedCost(p, plain_only, BOUNDS, sibling_excess=1.25)
    assert cost.ratio("8", 2) == pytest.approx(1.25)


def test_best_k_maximises_goodput_and_falls_with_batch() -> None:
    cost = tuner_policy.CalibratedCost(prior(), {}, BOUNDS)
    acc = flat_acceptance(0.8)
    small, large = tuner_policy.best_k(acc, cost, "1", 8), tuner_policy.best_k(acc, cost, "+Inf", 8)
    assert small.gain > 2.0 and small.k >= 4
    assert large.gain < small.gain and large.k < small.k
    assert small.gain == pytest.approx(max(small.gains))


@given(
    st.lists(st.floats(0.5, 4.0), min_size=1, max_size=8),
    st.lists(st.sampled_from((0.0, 1e-13, 4e-13, 6e-13, 2e-12, -3e-13)), min_size=8, max_size=8),
)
def test_best_of_picks_the_smallest_k_among_gains_equal_to_twelve_places(
    gains: list[float], nudges: list[float]
) -> None:
    """Near-ties (gains a few 1e-13 apart) go to the smaller K exactly as rounding to 12 places says."""
    near_ties = tuple(gains[0] + d for d in nudges) + tuple(gains)
    for candidate in (tuple(gains), near_ties):
        rounded = [round(g, 12) for g in candidate]
        choice = tuner_policy._best_of(candidate)
        assert choice.k == rounded.index(max(rounded)) + 1
        assert choice.gain == candidate[choice.k - 1]


@pytest.mark.parametrize("batch", [None, 3.0, 100.0])
def test_best_k_prices_every_k_at_its_step_time(batch: float | None) -> None:
    """best_k reads a bucket's step parts in one lookup: the same gains as each K's step_s gives."""
    p = prior("ngram")
    cost = tuner_policy.CalibratedCost(
        p, {"4": measured_at(p, 3, 2.5), "128": measured_at(p, 100, 1.5)}, BOUNDS
    )
    acc = replace(flat_acceptance(0.7), proposal_rate=0.6)
    for label in ("4", "128", "+Inf"):
        tokens = acc.step_tokens_by_k(5)
        t0 = cost.step_s(label, 0, batch)
        expected = tuple(tokens[k - 1] * t0 / cost.step_s(label, k, batch, 0.6) for k in range(1, 6))
        assert tuner_policy.best_k(acc, cost, label, 5, batch).gains == expected


def test_step_tokens_are_memoised_per_max_k() -> None:
    acc = replace(flat_acceptance(0.5), proposal_rate=0.5)
    assert acc.step_tokens_by_k(2) == (1.25, 1.375)
    assert acc.step_tokens_by_k(4) == (1.25, 1.375, 1.4375, 1.46875)
    assert acc.step_tokens_by_k(2) == (1.25, 1.375)


def test_high_acceptance_pays_far_poor_acceptance_does_not() -> None:
    cost = tuner_policy.CalibratedCost(prior("draftModel"), {}, BOUNDS)
    assert tuner_policy.best_k(flat_acceptance(0.05), cost, "1", 4).gain < 1.0
    assert tuner_policy.best_k(flat_acceptance(0.9), cost, "1", 4).gain > 1.5


def test_cliff_is_the_first_batch_where_no_k_reaches_min_gain() -> None:
    # Short contexts: little KV traffic, so verification turns compute-bound within the buckets.
    cost = tuner_policy.CalibratedCost(prior("draftModel", context=128), {}, BOUNDS)
    acc = flat_acceptance(0.7)
    cliff = tuner_policy.cliff_batch_size(acc, cost, BOUNDS, 4, 1.1)
    assert cliff is not None and 1 < cliff <= 256

    def gain(b: int) -> float:
        return tuner_policy.best_k(acc, cost, tuner_policy._label_for(b, BOUNDS), 4, b).gain

    # The bisection agrees with a linear scan.
    assert cliff == next(b for b in range(1, 257) if gain(b) < 1.1)
    assert (
        tuner_policy.cliff_batch_size(
            flat_acceptance(0.99), tuner_policy.CalibratedCost(prior("ngram"), {}, BOUNDS), BOUNDS, 4, 1.0
        )
        is None
    )


def test_an_unmeasured_bucket_pays_no_more_than_a_smaller_measured_one() -> None:
    """Bucket 1 measured as predicted, bucket 2 cheaper, bucket 4 eight times dearer when speculating:
    bucket 8, never measured, borrows the median ratio (1.0) and would be predicted to pay well, past a
    smaller bucket measured to lose. Gain falls with batch size, so it is capped there: off, like 4."""
    p = prior("draftModel")

    measured = {"1": measured_at(p, 1, 1.0), "2": measured_at(p, 2, 0.7), "4": measured_at(p, 4, 8.0)}
    cost = tuner_policy.CalibratedCost(p, measured, BOUNDS)
    acc = flat_acceptance(0.8)
    uncapped = tuner_policy.best_k(acc, cost, "8", 4)
    table = tuner_policy.choose_table(acc, cost, BOUNDS, 4)
    assert table["4"].gain < 1.0 < uncapped.gain
    assert table["8"].gain == pytest.approx(table["4"].gain) and table["+Inf"].gain <= table["4"].gain
    # Measured buckets keep their own gain, even bucket 2's, measured faster than bucket 1.
    assert table["2"].gain > table["1"].gain
    for label in ("1", "2", "4"):
        assert table[label] == tuner_policy.best_k(acc, cost, label, 4)
    assert tuner_policy.cliff_batch_size(acc, cost, BOUNDS, 4, 1.1) <= 4
    assert tuner_policy.drafter_score(acc, cost, BOUNDS, 4, {"8": 1.0}) == 1.0


def choice(k: int, gain: float) -> tuner_policy.BucketChoice:
    return tuner_policy.BucketChoice(k, gain, tuple(gain if i + 1 == k else gain * 0.9 for i in range(4)))


H = tuner_policy.Hysteresis(min_gain=1.1, cooldown_s=300)


def test_bucket_turns_on_only_at_min_gain() -> None:
    update = tuner_policy.update_table({"1": 0}, {"1": choice(3, 1.09)}, H, {}, now=0)
    assert update.k_by_bucket == {"1": 0}
    update = tuner_policy.update_table({"1": 0}, {"1": choice(3, 1.12)}, H, {}, now=0)
    assert update.k_by_bucket == {"1": 3} and update.flipped == {"1": 0}


def test_an_on_bucket_stays_on_inside_the_band_and_goes_off_below_it() -> None:
    assert H.off_gain == pytest.approx(1.05)
    stay = tuner_policy.update_table({"1": 3}, {"1": choice(3, 1.07)}, H, {"1": -1000}, now=0)
    assert stay.k_by_bucket == {"1": 3}
    off = tuner_policy.update_table({"1": 3}, {"1": choice(3, 1.03)}, H, {"1": -1000}, now=0)
    assert off.k_by_bucket == {"1": 0}


def test_cooldown_blocks_flapping_but_not_a_harmful_bucket() -> None:
    # Flipped on 60 s ago: a drop into the band's lower part waits for the cooldown...
    wait = tuner_policy.update_table({"1": 3}, {"1": choice(3, 1.03)}, H, {"1": -60}, now=0)
    assert wait.k_by_bucket == {"1": 3}
    # ... but speculation predicted slower than plain decoding goes off at once.
    now_off = tuner_policy.update_table({"1": 3}, {"1": choice(3, 0.95)}, H, {"1": -60}, now=0)
    assert now_off.k_by_bucket == {"1": 0}
    # And a bucket switched off 60 s ago does not come back before the cooldown.
    back = tuner_policy.update_table({"1": 0}, {"1": choice(3, 1.5)}, H, {"1": -60}, now=0)
    assert back.k_by_bucket == {"1": 0}


def test_load_hovering_at_the_cliff_does_not_flap() -> None:
    """Gains that wander around minGain every tick: at most one flip per cooldown."""
    table, flipped_at, flips = {"1": 0}, {}, []
    gains = [1.12, 1.02, 1.13, 1.04, 1.11, 1.06, 1.12, 1.03] * 10
    for tick, gain in enumerate(gains):
        now = tick * 30.0
        update = tuner_policy.update_table(table, {"1": choice(2, gain)}, H, flipped_at, now)
        table = update.k_by_bucket
        flipped_at.update(update.flipped)
        flips += list(update.flipped.values())
    gaps = [b - a for a, b in itertools.pairwise(flips)]
    assert flips and all(g >= H.cooldown_s for g in gaps)


def test_k_moves_only_for_a_clear_gain() -> None:
    c = tuner_policy.BucketChoice(4, 1.50, (1.2, 1.40, 1.49, 1.50))
    assert tuner_policy.update_table({"1": 3}, {"1": c}, H, {"1": -1e9}, now=0).k_by_bucket == {"1": 3}
    c = tuner_policy.BucketChoice(4, 1.50, (1.2, 1.30, 1.40, 1.50))
    assert tuner_policy.update_table({"1": 3}, {"1": c}, H, {"1": -1e9}, now=0).k_by_bucket == {"1": 4}


def test_drafter_score_weights_buckets_by_traffic() -> None:
    cost = tuner_policy.CalibratedCost(prior("draftModel"), {}, BOUNDS)
    acc = flat_acceptance(0.8)
    low = tuner_policy.drafter_score(acc, cost, BOUNDS, 4, {"1": 100.0})
    high = tuner_policy.drafter_score(acc, cost, BOUNDS, 4, {"+Inf": 100.0})
    assert low > high >= 1.0
    assert math.isclose(
        tuner_policy.drafter_score(acc, cost, BOUNDS, 4, {}),
        tuner_policy.drafter_score(acc, cost, BOUNDS, 4, {}),
    )


def test_remembered_ratio_fills_an_unmeasured_bucket_and_a_fresh_measurement_wins() -> None:
    p = prior()

    memory = tuner_policy.RatioMemory(ttl_s=600.0)
    memory.record("g", {"64": 1.1}, {"64": 2.5}, now=0.0)
    cost = tuner_policy.CalibratedCost(
        p, {"8": measured_at(p, 6.0, 1.0)}, BOUNDS, remembered=memory.recall("g", 100.0)
    )
    assert cost.ratio("64", 3) == pytest.approx(2.5) and cost.ratio("64", 0) == pytest.approx(1.1)
    assert cost.ratio("32", 3) == pytest.approx(1.0)  # neither measured nor remembered: the median
    # A fresh measurement in the window wins over the remembered ratio, and replaces it.
    fresh = tuner_policy.CalibratedCost(
        p, {"64": measured_at(p, 48.0, 1.4)}, BOUNDS, remembered=memory.recall("g", 200.0)
    )
    assert fresh.ratio("64", 3) == pytest.approx(1.4, rel=0.02)
    memory.record("g", fresh.plain_ratio, fresh.excess_ratio, now=200.0)
    assert memory.recall("g", 700.0)[1]["64"] == pytest.approx(1.4, rel=0.02)  # 500 s old: kept
    assert memory.recall("g", 800.0) == ({}, {})  # expired
    memory.record("g", {}, {}, now=800.0)
    assert memory.plain["g"] == {} and memory.excess["g"] == {}  # expired entries are dropped


# ---- the excess's shape across K, and drafters that do not always propose ----------------------------


def _steps_at_ks(p: costmodel.StepCostPrior, batch: float, true_step, ks: tuple[int, ...]) -> BucketStats:
    """500 plain steps and 500 speculative steps at each K of `ks`, timed by `true_step(k)`."""
    return BucketStats(
        steps_plain=500,
        seconds_plain=500 * true_step(0),
        tokens_plain=500 * batch,
        steps_spec=500 * len(ks),
        seconds_spec=sum(500 * true_step(k) for k in ks),
        drafts=500 * len(ks) * batch,
        draft_tokens=sum(500 * k * batch for k in ks),
        steps_by_k={k: 500 for k in ks},
        seconds_by_k={k: 500 * true_step(k) for k in ks},
    )


def test_a_fixed_cost_per_speculative_step_measured_at_two_ks_is_fitted_not_scaled_away() -> None:
    """An n-gram drafter behind an RPC on a CPU: a speculative step costs a fixed 0.7 ms more at any K,
    far from the prior's few microseconds per K. Measured at K = 1 and K = 4, the fit prices K = 2, 3
    and 5 as they are; one ratio (measured at K = 4 only) prices what K = 1 adds at about a quarter of
    it, and picks a K too small for the acceptance."""
    p = prior("ngram")
    label, batch = "1", 1.0

    def true_step(k: int) -> float:
        return p.step_s(batch, 0) + (7e-4 if k else 0.0) + 0.5 * (p.step_s(batch, k) - p.step_s(batch, 0))

    fitted = tuner_policy.CalibratedCost(p, {label: _steps_at_ks(p, batch, true_step, (1, 4))}, BOUNDS)
    assert label in fitted.affine
    for k in range(1, 6):
        assert fitted.step_s(label, k) == pytest.approx(true_step(k), rel=1e-6)
    scaled = tuner_policy.CalibratedCost(p, {label: _steps_at_ks(p, batch, true_step, (4,))}, BOUNDS)
    assert label not in scaled.affine
    assert scaled.step_s(label, 1) - true_step(0) < 0.5 * (true_step(1) - true_step(0))
    acc = flat_acceptance(0.5)
    assert tuner_policy.best_k(acc, fitted, label, 5).k > tuner_policy.best_k(acc, scaled, label, 5).k


def test_a_k_measured_now_is_priced_at_its_own_measurement_beside_a_fitted_fixed_cost() -> None:
    """n-gram on a CPU at batch 2 costs the same at K = 1, 2 and 3 and more at K = 4: a line fitted through
    the Ks prices K = 3 above what it measured. Each K measured in the window is priced at its own
    measurement; the fit prices only the Ks not measured (K = 5 here)."""
    p = prior("ngram")
    label, batch = "1", 1.0

    def true_step(k: int) -> float:
        if k == 3:
            return p.step_s(batch, 0) + 5e-4  # cheaper than any line through the other Ks says
        return p.step_s(batch, 0) + (7e-4 if k else 0.0) + 0.5 * (p.step_s(batch, k) - p.step_s(batch, 0))

    cost = tuner_policy.CalibratedCost(p, {label: _steps_at_ks(p, batch, true_step, (1, 2, 3, 4))}, BOUNDS)
    assert label in cost.affine and cost.measured_ks_now(label) == (1, 2, 3, 4)
    for k in range(1, 5):
        assert cost.step_s(label, k) == pytest.approx(true_step(k), rel=1e-6)
    fixed, slope = cost.affine[label]
    fitted_k5 = p.step_s(batch, 0) + fixed + slope * (p.step_s(batch, 5) - p.step_s(batch, 0))
    assert cost.step_s(label, 5) == pytest.approx(fitted_k5, rel=1e-6)
    fitted_k3 = p.step_s(batch, 0) + fixed + slope * (p.step_s(batch, 3) - p.step_s(batch, 0))
    assert fitted_k3 > true_step(3) + 1e-4  # what pricing K = 3 by the fit would have said


def test_ks_remembered_from_earlier_windows_join_the_fit_and_a_k_measured_now_wins() -> None:
    p = prior("ngram")
    label, batch = "1", 1.0

    def true_step(k: int) -> float:
        return p.step_s(batch, 0) + (7e-4 if k else 0.0)

    memory = tuner_policy.RatioMemory(ttl_s=600.0)
    first = tuner_policy.CalibratedCost(p, {label: _steps_at_ks(p, batch, true_step, (4,))}, BOUNDS)
    memory.record("g", first.plain_ratio, first.excess_ratio, 0.0, first.excess_by_k)
    later = tuner_policy.CalibratedCost(
        p,
        {label: _steps_at_ks(p, batch, true_step, (1,))},
        BOUNDS,
        remembered=memory.recall("g", 100.0),
        remembered_by_k=memory.recall_by_k("g", 100.0),
    )
    assert set(memory.recall_by_k("g", 100.0)[label]) == {4} and label in later.affine
    assert later.step_s(label, 1) == pytest.approx(true_step(1), rel=0.01)
    assert memory.recall_by_k("g", 700.0) == {}  # expired with the other ratios


def test_a_shape_within_noise_of_the_priors_is_priced_per_k_measured_in_the_window() -> None:
    """Measured in the window at two Ks whose ratios differ by less than AFFINE_SHAPE_GAP: no fixed
    cost is fitted, but each K measured now is priced at its own ratio, a K between them at the ratio
    interpolated, and one beyond them at the nearest one's (a probe of the next K, `core._k_probe`,
    measures it before the table moves further)."""
    p = prior()
    label, batch = "32", 24.0

    def true_step(k: int) -> float:
        bump = 1.3 if k == 2 else 1.0  # K = 2 measured 30 % dearer than the prior's shape
        return p.step_s(batch, 0) + 1.5 * bump * (p.step_s(batch, k) - p.step_s(batch, 0))

    cost = tuner_policy.CalibratedCost(p, {label: _steps_at_ks(p, batch, true_step, (2, 4))}, BOUNDS)
    assert label not in cost.affine and cost.measured_ks_now(label) == (2, 4)
    for k in (2, 4):
        assert cost.step_s(label, k) == pytest.approx(true_step(k), rel=1e-6)
    plain, excess = p.step_s(batch, 0), {k: p.step_s(batch, k) - p.step_s(batch, 0) for k in range(1, 6)}
    assert cost.step_s(label, 3) == pytest.approx(plain + excess[3] * 1.5 * 1.15, rel=1e-6)
    assert cost.step_s(label, 1) == pytest.approx(plain + excess[1] * 1.5 * 1.3, rel=1e-6)
    assert cost.step_s(label, 5) == pytest.approx(plain + excess[5] * 1.5, rel=1e-6)
    # Measured at one K only, that K's ratio prices every K.
    one = tuner_policy.CalibratedCost(p, {label: _steps_at_ks(p, batch, true_step, (2,))}, BOUNDS)
    assert one.step_s(label, 4) == pytest.approx(plain + excess[4] * 1.5 * 1.3, rel=1e-6)


def test_a_drafter_that_proposes_to_half_the_sequences_gains_half_the_extra_tokens() -> None:
    """n-gram finds a match for half the sequences of its speculative steps: each of the others verifies
    for one token. Sequences = generated tokens − accepted tokens; the rate is drafts over those."""
    alpha, k, steps, batch = 0.8, 3, 1000, 8
    drafts = steps * batch / 2
    accepted = drafts * (alpha + alpha**2 + alpha**3)
    stats = BucketStats(
        steps_spec=steps,
        tokens_spec=steps * batch + accepted,
        drafts=drafts,
        draft_tokens=k * drafts,
        accepted=accepted,
        accepted_pos={i: drafts * alpha ** (i + 1) for i in range(k)},
        proposed_pos={i: drafts for i in range(k)},
    )
    acc = tuner_policy.acceptance(stats, k)
    assert acc.proposal_rate == pytest.approx(0.5)
    assert acc.tokens(k) == pytest.approx(1 + alpha + alpha**2 + alpha**3)  # MAL: per draft
    assert acc.step_tokens_by_k(k)[-1] == pytest.approx(1 + 0.5 * (alpha + alpha**2 + alpha**3))
    assert tuner_policy.spec_sequences(stats) == pytest.approx(steps * batch)
    # Without generated-token counters: one draft per sequence, and every sequence drafted.
    bare = BucketStats(drafts=drafts, draft_tokens=k * drafts, accepted=accepted)
    assert tuner_policy.acceptance(bare, k).proposal_rate == 1.0
    assert tuner_policy.spec_sequences(bare) == drafts
