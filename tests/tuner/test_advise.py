"""Advise mode in the controller's loop: a recommendation is decided but neither pushed nor rolled out;
back in auto the next tick applies it, rolling the pods out first where the engines cannot switch live.
Real sidecars (the control API of tests/tuner/conftest.py); the snapshot is built from rows by the
reader's own builder."""

from __future__ import annotations

import aiohttp
from prometheus_client import REGISTRY

from specserve_engine import metric_names
from specserve_operator.render import children as render
from specserve_operator.tuner import core
from specserve_operator.tuner import observations as ob
from specserve_operator.tuner.loop import FleetController

NS = "ml"
PODS = ("pod-a", "pod-b")
TOKEN = "secret-token"


class RowsReader:
    """What the reader would return for these rows (observations.build_snapshot, as PrometheusReader)."""

    def __init__(self, rows: list[ob.Row]) -> None:
        self.rows = rows

    def read(self) -> ob.FleetSnapshot:
        return ob.build_snapshot(self.rows, 300.0)


def _recommended_k(name: str, mode: str, drafter: str, bucket: str) -> float | None:
    labels = {"namespace": NS, "name": name, "mode": mode, "drafter": drafter, "bucket": bucket}
    return REGISTRY.get_sample_value(metric_names.OPERATOR_RECOMMENDED_K.name, labels)


async def test_advice_waits_for_auto_which_rolls_out_the_recommended_drafter(
    spec_factory, rows_for, bucket_load, sidecars
) -> None:
    drafters = [
        {"name": "eagle", "method": "eagle3", "source": "hf://org/eagle3", "maxSpeculativeTokens": 4},
        {"name": "lookup", "method": "ngram", "maxSpeculativeTokens": 4},
    ]
    advise = spec_factory(drafters=drafters, speculation__mode="advise")
    auto = spec_factory(drafters=drafters, speculation__mode="auto")
    view = core.ResourceView(NS, "advised", advise, PODS)
    prior = view.prior(advise.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=2000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0)),
    }
    # The engines run eagle, whose acceptance is far under the floor; lookup scored better before.
    rows = [r for pod in PODS for r in rows_for(NS, pod, "eagle", loads, alphas=(0.1,) * 8)]
    stands = {pod: await sidecars(spec=advise, token=TOKEN) for pod in PODS}
    endpoints = {pod: s.url for pod, s in stands.items()}
    clock = [0.0]
    async with aiohttp.ClientSession() as session:
        controller = FleetController(
            "http://prometheus", session, clock=lambda: clock[0], reader_factory=lambda url: RowsReader(rows)
        )
        state = controller.state_for(view, None)
        state.last_score["lookup"] = 1.5
        assert state.engine_drafter == "eagle"
        first = await controller.tick(view, endpoints, TOKEN)
        clock[0] = advise.speculation.cooldown_seconds + 1
        advice = await controller.tick(view, endpoints, TOKEN)
        assert first.advice and advice.advice and advice.decision is not None
        assert advice.decision.drafter == "lookup" and advice.decision.action == "rollout"
        assert advice.decision.rollout_drafter is None  # recommended, not rolled out
        assert state.engine_drafter == "eagle"  # the engines still run what they were started with
        assert not advice.pushed and all(not s.puts for s in stands.values())
        assert state.canary is None  # advise starts no canary and no trial
        assert _recommended_k("advised", "advise", "lookup", "+Inf") is not None

        clock[0] += advise.speculation.evaluation_interval_seconds
        applied = await controller.tick(core.ResourceView(NS, "advised", auto, PODS), endpoints, TOKEN)
        d = applied.decision
        assert not applied.advice and d is not None and d.changed
        assert (d.action, d.rollout_drafter) == ("rollout", "lookup")
        assert d.reason.startswith("applying the recommendation made in advise mode")
        assert state.engine_drafter == "lookup"
        # The running engines run eagle inside vLLM: their sidecars refuse lookup, so nothing is pushed
        # to them; the pods of the rollout start with lookup and are given the policy at the next tick.
        assert applied.awaiting_rollout == list(PODS) and not applied.pushed and not applied.unreachable
        assert all(not s.puts for s in stands.values())
        rolled = render.with_active_drafter(auto, "lookup")
        new_pods = {f"{pod}-new": await sidecars(spec=rolled, token=TOKEN) for pod in PODS}
        clock[0] += advise.speculation.evaluation_interval_seconds
        after = await controller.tick(
            core.ResourceView(NS, "advised", auto, tuple(new_pods)),
            {p: s.url for p, s in new_pods.items()},
            TOKEN,
        )
    assert after.pushed == sorted(new_pods)
    assert all(s.policy["drafter"] == "lookup" for s in new_pods.values())
    assert all(s.policy["kByBucket"] == after.decision.pods[p].k_by_bucket for p, s in new_pods.items())
    # The advise-mode series is gone; the same table is now exported as what auto put in force.
    assert _recommended_k("advised", "advise", "lookup", "+Inf") is None
    assert _recommended_k("advised", "auto", "lookup", "+Inf") is not None


async def test_from_auto_to_advise_the_pods_keep_their_policy(
    spec_factory, rows_for, bucket_load, sidecars
) -> None:
    auto = spec_factory()
    advise = spec_factory(speculation__mode="advise")
    view = core.ResourceView(NS, "kept", auto, PODS)
    prior = view.prior(auto.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=2000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0)),
    }
    rows = [r for pod in PODS for r in rows_for(NS, pod, "draft", loads)]
    stands = {pod: await sidecars(token=TOKEN) for pod in PODS}
    endpoints = {pod: s.url for pod, s in stands.items()}
    clock = [0.0]
    async with aiohttp.ClientSession() as session:
        controller = FleetController(
            "http://prometheus", session, clock=lambda: clock[0], reader_factory=lambda url: RowsReader(rows)
        )
        first = await controller.tick(view, endpoints, TOKEN)
        assert first.pushed and first.decision is not None
        in_force = {pod: s.policy for pod, s in stands.items()}
        # Acceptance collapses, a cooldown later: advise would turn speculation off; the pods keep theirs.
        rows[:] = [r for pod in PODS for r in rows_for(NS, pod, "draft", loads, alphas=(0.05,) * 8)]
        clock[0] = auto.speculation.cooldown_seconds + 1
        advice = await controller.tick(core.ResourceView(NS, "kept", advise, PODS), endpoints, TOKEN)
    assert advice.advice and not advice.pushed and advice.decision is not None
    assert advice.decision.changed and advice.decision.k_by_bucket != first.decision.k_by_bucket
    assert {pod: s.policy for pod, s in stands.items()} == in_force
    assert all(len(s.puts) == 1 for s in stands.values())
