"""Property-based tests of the observation builder: whatever rows Prometheus (or a broken exporter)
returns, building a snapshot never raises and yields only finite, non-negative counters, and the decision
made from it never raises and writes a status the API server accepts (valid JSON, in the CRD's bounds)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from specserve_operator.api.models import SpeculativeServingStatus
from specserve_operator.tuner import core, observations
from specserve_operator.tuner.loop import ResourceTick
from specserve_operator.tuner.report import status_patch

NS = "ml"
PODS = ("p0", "p1")
KINDS = (
    observations.STEPS,
    observations.STEP_SECONDS,
    observations.TOKENS,
    observations.DRAFTS,
    observations.DRAFT_TOKENS,
    observations.ACCEPTED,
    observations.ACCEPTED_POS,
    observations.PROPOSED_POS,
    observations.POLICY_INFO,
    observations.RUNNING,
    observations.GPU_UTIL,
    observations.VLLM_DRAFTS,
    observations.VLLM_DRAFT_TOKENS,
    observations.VLLM_ACCEPTED,
    observations.DRAFTER_ERRORS,
    "junk",
)

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=1e6),  # the plausible range, so that rows also pass and fold
    st.sampled_from([0.0, -0.0, 1.0, 20.0, 50.0, 1e12, 1e13, 5e-324, -1.0]),
)
label_values = {
    "namespace": st.sampled_from([NS, NS, NS, "", "other"]),
    "pod": st.sampled_from([*PODS, *PODS, ""]),
    "bucket": st.sampled_from(["1", "4", "16", "64", "+Inf", "", "x"]),
    "speculating": st.sampled_from(["true", "false", ""]),
    "drafter": st.sampled_from(["draft", "ngram", "", "unknown"]),
    "position": st.sampled_from(["0", "1", "2", "3", "15", "16", "²", "-1", "", "00"]),
    "mode": st.sampled_from(["on", "off", ""]),
    "policy_version": st.one_of(st.sampled_from(["0", "3", "9" * 30, "²", "-2", ""]), st.text(max_size=4)),
}
labels = st.fixed_dictionaries({}, optional=label_values)
rows = st.lists(st.tuples(st.sampled_from(KINDS), labels, values), max_size=80)


@st.composite
def fleet_rows(draw) -> list[observations.Row]:
    """Every row kind the reader returns, for both pods, with arbitrary values: the decision gets past
    the data gate and into calibration, scores, demotions and the K table."""
    out: list[observations.Row] = []
    for pod in PODS:
        base = {"namespace": NS, "pod": pod}
        for bucket in draw(
            st.lists(st.sampled_from(["1", "4", "16", "64", "+Inf"]), min_size=1, unique=True)
        ):
            for speculating in ("true", "false"):
                lab = {**base, "bucket": bucket, "speculating": speculating}
                for kind in (observations.STEPS, observations.STEP_SECONDS, observations.TOKENS):
                    out.append((kind, lab, draw(values)))
            drafter = draw(label_values["drafter"])
            for kind in (observations.DRAFTS, observations.DRAFT_TOKENS, observations.ACCEPTED):
                out.append((kind, {**base, "bucket": bucket, "drafter": drafter}, draw(values)))
        for position in range(draw(st.integers(0, 5))):
            lab = {**base, "drafter": draw(label_values["drafter"]), "position": str(position)}
            out.append((observations.ACCEPTED_POS, lab, draw(values)))
            out.append((observations.PROPOSED_POS, lab, draw(values)))
        info = {**base, "drafter": draw(label_values["drafter"]), "mode": "on", "policy_version": "1"}
        out.append((observations.POLICY_INFO, info, 1.0))
        out.append((observations.RUNNING, base, draw(values)))
        out.append(
            (observations.DRAFTER_ERRORS, {**base, "drafter": draw(label_values["drafter"])}, draw(values))
        )
    return out + draw(rows)


def _stats_are_sane(b: observations.BucketStats) -> None:
    numbers = [
        b.steps_plain,
        b.seconds_plain,
        b.tokens_plain,
        b.steps_spec,
        b.seconds_spec,
        b.tokens_spec,
        b.drafts,
        b.draft_tokens,
        b.accepted,
        *b.accepted_pos.values(),
        *b.proposed_pos.values(),
    ]
    assert all(math.isfinite(x) and x >= 0 for x in numbers), b
    assert b.accepted <= b.draft_tokens
    assert all(v <= b.proposed_pos.get(pos, 0.0) for pos, v in b.accepted_pos.items())
    for side in ("plain", "spec"):
        steps, seconds = getattr(b, f"steps_{side}"), getattr(b, f"seconds_{side}")
        assert steps == seconds == 0 or (
            observations.MIN_STEP_S <= seconds / steps <= observations.MAX_STEP_S
        )


# Found by this test once: a subnormal step count times MIN_STEP_S underflowed to 0, so zero seconds
# passed as a sane duration.
SUBNORMAL_STEPS = [
    (
        observations.STEPS,
        {"namespace": NS, "pod": "p0", "bucket": "1", "speculating": "true", "drafter": "draft"},
        5e-324,
    )
]


@settings(max_examples=300, deadline=None)
@given(rows)
@example(rs=SUBNORMAL_STEPS)
def test_building_a_snapshot_never_raises_and_keeps_only_sane_numbers(rs) -> None:
    snap = observations.build_snapshot(rs, 300.0)
    assert set(snap.dropped) <= set(observations.DROP_REASONS)
    assert all(n > 0 for n in snap.dropped.values())
    for obs in snap.pods.values():
        for b in obs.buckets.values():
            _stats_are_sane(b)
        for buckets in obs.by_drafter.values():
            for b in buckets.values():
                _stats_are_sane(b)
        if obs.fallback is not None:
            _stats_are_sane(obs.fallback)
        assert obs.running is None or (math.isfinite(obs.running) and obs.running >= 0)
        assert obs.gpu_util is None or 0.0 <= obs.gpu_util <= 1.0
        assert all(math.isfinite(n) and n >= 0 for n in obs.drafter_errors.values())
        assert obs.policy_version is None or 0 <= obs.policy_version < 2**63


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rs=st.one_of(rows, fleet_rows()), second=st.one_of(rows, fleet_rows()))
def test_decisions_from_any_rows_never_raise_and_write_a_valid_status(spec_factory, rs, second) -> None:
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    state = core.ResourceState.initial(spec)
    status: dict = {}
    # Two ticks, a cooldown apart: the second decides from what the first remembered.
    for now, batch in ((0.0, rs), (spec.speculation.cooldown_seconds + 1, rs + second)):
        snap = observations.build_snapshot(batch, 300.0)
        d = core.decide(view, snap, state, core.FleetCosts([view], snap), now)
        event(f"action {d.action}")
        reported = {
            pod: obs.policy_version
            for pod in PODS
            if (obs := snap.pods.get((NS, pod))) is not None and obs.policy_version is not None
        }
        patch = status_patch(ResourceTick(d, reported_versions=reported), view, status, datetime.now(UTC))
        wire = json.loads(json.dumps(patch, allow_nan=False))
        SpeculativeServingStatus.model_validate(wire)
        status = status | wire
