"""P-EAGLE in the cost model: a head that drafts in parallel costs one pass for any K, and its step times
are calibrated apart from the same head drafting in sequence."""

from __future__ import annotations

from specserve_operator.tuner import core


def test_parallel_drafting_costs_one_pass_and_is_its_own_cost_group(spec_factory) -> None:
    head = {"name": "eagle", "method": "eagle3", "source": "hf://org/eagle3", "maxSpeculativeTokens": 4}
    spec = spec_factory(drafters=[head, {**head, "name": "p-eagle", "parallelDrafting": True}])
    view = core.ResourceView("ml", "llm", spec, ("pod-a",))
    sequential, parallel = (view.prior(d) for d in spec.drafters)
    gpu, one_pass = parallel.gpu, parallel.drafter.draft_s(parallel.gpu, 8, 1, parallel.context_len)
    assert parallel.drafter.draft_s(gpu, 8, 4, parallel.context_len) == one_pass
    assert sequential.drafter.draft_s(gpu, 8, 4, sequential.context_len) == 4 * one_pass
    assert parallel.step_s(8, 4) < sequential.step_s(8, 4)
    assert view.cost_group(spec.drafters[0]) != view.cost_group(spec.drafters[1])
