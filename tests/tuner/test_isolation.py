"""One resource's failure is its own: an unknown GPU gets a generic prior and a condition, and whatever
one resource's spec or data raises while step costs are pooled fails only that resource."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from specserve_operator.api.models import SpeculativeServingStatus
from specserve_operator.tuner import core, costmodel, observations
from specserve_operator.tuner.loop import ResourceTick
from specserve_operator.tuner.report import GPU_KNOWN, status_patch

NS = "ml"
A100 = "NVIDIA-A100-SXM4-80GB"


def fleet(spec_factory, rows_for, bucket_load, bad_spec) -> tuple[core.ResourceView, core.ResourceView, list]:
    """A healthy resource and one with `bad_spec`, both with measurements on their own pods."""
    good_spec = spec_factory()
    good = core.ResourceView(NS, "good", good_spec, ("good-0", "good-1"))
    bad = core.ResourceView(NS, "bad", bad_spec, ("bad-0",))
    prior = good.prior(good_spec.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=2000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0)),
    }
    rows = [r for pod in (*good.pods, *bad.pods) for r in rows_for(NS, pod, "draft", loads)]
    return good, bad, rows


def test_an_unknown_gpu_gets_a_generic_prior_and_a_condition(spec_factory, rows_for, bucket_load) -> None:
    good, bad, rows = fleet(spec_factory, rows_for, bucket_load, spec_factory(engine__gpu={"product": A100}))
    snap = observations.build_snapshot(rows, 300.0)
    costs = core.FleetCosts([bad, good], snap)  # today: ValueError, for every resource of the tick
    decisions = {
        view.name: core.decide(view, snap, core.ResourceState.initial(view.spec), costs, 0.0)
        for view in (bad, good)
    }
    assert bad.prior(bad.spec.drafters[0]).gpu == costmodel.GENERIC_GPU
    assert (
        core.UNKNOWN_GPU in decisions["bad"].warnings and A100 in decisions["bad"].warnings[core.UNKNOWN_GPU]
    )
    assert decisions["good"].warnings == {}
    assert decisions["bad"].action != "noData" and decisions["good"].action != "noData"
    patch = status_patch(ResourceTick(decisions["bad"]), bad, {}, datetime.now(UTC))
    conditions = {c["type"]: c for c in patch["conditions"]}
    assert (conditions[GPU_KNOWN]["status"], conditions[GPU_KNOWN]["reason"]) == ("False", core.UNKNOWN_GPU)
    SpeculativeServingStatus.model_validate(json.loads(json.dumps(patch, allow_nan=False)))
    # Once the spec names a known GPU, the condition turns True instead of lingering.
    fixed = status_patch(ResourceTick(decisions["good"]), good, patch, datetime.now(UTC))
    assert {c["type"]: c["status"] for c in fixed["conditions"]}[GPU_KNOWN] == "True"


def test_a_resource_whose_priors_raise_fails_alone(spec_factory, rows_for, bucket_load) -> None:
    broken = spec_factory()
    # A drafter method the cost model has no figures for (the CRD would refuse it; a newer one may not).
    drafter = broken.drafters[0].model_copy(update={"method": "quantumDrafter"})
    broken = broken.model_copy(update={"drafters": [drafter, *broken.drafters[1:]]})
    good, bad, rows = fleet(spec_factory, rows_for, bucket_load, broken)
    snap = observations.build_snapshot(rows, 300.0)
    costs = core.FleetCosts([bad, good], snap)
    d = core.decide(good, snap, core.ResourceState.initial(good.spec), costs, 0.0)
    assert d.action != "noData" and d.scores
    with pytest.raises(core.CostModelError, match="quantumDrafter"):
        core.decide(bad, snap, core.ResourceState.initial(bad.spec), costs, 0.0)


def test_one_resources_corrupt_observation_is_not_pooled(spec_factory, rows_for, bucket_load) -> None:
    good, bad, rows = fleet(spec_factory, rows_for, bucket_load, spec_factory())
    snap = observations.build_snapshot(rows, 300.0)
    alone = core.decide(good, snap, core.ResourceState.initial(good.spec), core.FleetCosts([good], snap), 0.0)
    # An observation no boundary check made (a bug elsewhere): pooling it would raise for every resource.
    snap.pods[(NS, "bad-0")].buckets["4"] = None  # type: ignore[assignment]
    costs = core.FleetCosts([bad, good], snap)
    d = core.decide(good, snap, core.ResourceState.initial(good.spec), costs, 0.0)
    assert (d.action, d.k_by_bucket, d.scores) == (alone.action, alone.k_by_bucket, alone.scores)
    with pytest.raises(core.CostModelError):
        costs.cost(bad, bad.spec.drafters[0])
