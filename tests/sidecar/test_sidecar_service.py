"""The sidecar's drafting service (sidecar_service.py), called directly: which policies it applies,
schedules or refuses, the background load of a model drafter, and the drafts it answers per row."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import numpy as np
import pytest

from specserve_engine.api import PolicyRequest, SidecarConfig, SidecarState
from specserve_engine.draft_protocol import RowOp, RowStatus, RowUpdate
from specserve_engine.draft_socket import SequenceTable
from specserve_engine.policy_file import policy_path
from specserve_engine.sidecar_service import PolicyRefused, SidecarService
from specserve_testing.proposer_inputs import REPEAT


async def wait_for(service: SidecarService, pred: Callable[[SidecarState], bool]) -> SidecarState:
    loop = asyncio.get_running_loop()
    end = loop.time() + 60.0
    while loop.time() < end:
        state = service.state()
        if pred(state):
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out; last state {state}")


def statuses(state: SidecarState) -> dict[str, str]:
    return {d.name: d.status for d in state.drafters}


async def test_a_policy_is_applied_once_per_version(
    service: SidecarService, config: SidecarConfig, make_policy: Callable[..., PolicyRequest]
) -> None:
    assert await service.put_policy(make_policy(2, "suffix", 3)) == 200
    assert json.loads(policy_path(config.runtime_dir).read_text())["policyVersion"] == 2
    assert await service.put_policy(make_policy(2, "suffix", 3)) == 200  # the same call again: a no-op
    with pytest.raises(PolicyRefused) as older:
        await service.put_policy(make_policy(1, "suffix", 3))
    with pytest.raises(PolicyRefused) as other:
        await service.put_policy(make_policy(2, "ngram", 3))
    assert [(e.value.status, e.value.body.field) for e in (older, other)] == [(409, "policyVersion")] * 2
    state = service.state()
    assert (state.policy_version, state.drafter, state.k_by_bucket["1"]) == (2, "suffix", 3)
    refused = service.metrics.registry.get_sample_value(
        "specserve_sidecar_switches_total", {"kind": "drafter", "result": "refused"}
    )
    assert refused == 2  # a refusal counts as a refused switch of what it would have changed


async def test_a_policy_the_pod_cannot_serve_is_refused(
    service: SidecarService, make_policy: Callable[..., PolicyRequest]
) -> None:
    with pytest.raises(PolicyRefused) as unknown:
        await service.put_policy(make_policy(2, "eagle9"))
    with pytest.raises(PolicyRefused) as too_deep:
        await service.put_policy(make_policy(2, "self", 4))  # self's maxSpeculativeTokens is 3
    assert (unknown.value.status, unknown.value.body.field) == (422, "drafter")
    assert (too_deep.value.status, too_deep.value.body.field) == (422, "kByBucket")
    assert service.state().policy_version == 1


async def test_a_model_drafter_loads_in_the_background_then_switches(
    service: SidecarService, make_policy: Callable[..., PolicyRequest]
) -> None:
    assert statuses(service.state()) == {"ngram": "loaded", "suffix": "loaded", "self": "available"}
    assert await service.put_policy(make_policy(2, "self", 3)) == 202
    state = service.state()
    assert (state.drafter, state.pending_drafter, statuses(state)["self"]) == ("ngram", "self", "loading")
    assert await service.put_policy(make_policy(2, "self", 3)) == 202  # repeated while loading: still pending
    state = await wait_for(service, lambda s: s.drafter == "self")
    assert (state.policy_version, state.pending_drafter, statuses(state)["self"]) == (2, None, "loaded")


async def test_a_newer_policy_supersedes_a_pending_switch(
    service: SidecarService, make_policy: Callable[..., PolicyRequest]
) -> None:
    assert await service.put_policy(make_policy(2, "self", 3)) == 202
    assert await service.put_policy(make_policy(3, "suffix", 1)) == 200
    assert service.state().pending_drafter is None
    await wait_for(service, lambda s: statuses(s)["self"] == "loaded")
    state = service.state()
    assert (state.drafter, state.policy_version) == ("suffix", 3)  # the finished load did not switch back


def reset(row: int, tokens: list[int], max_k: int = 4) -> RowUpdate:
    return RowUpdate(row, RowOp.RESET, max_k, 0, np.array(tokens, np.int32))


async def test_answers_take_k_from_the_batch_size_capped_per_row(service: SidecarService) -> None:
    table = SequenceTable(1)
    prompt = [1, *REPEAT, 2, *REPEAT[:3]]
    k_table = {"1": 4, "2": 2, "4": 0, "8": 0, "+Inf": 0}
    await service.put_policy(PolicyRequest(policyVersion=2, drafter="ngram", kByBucket=k_table))
    answers = service.answer(table, [reset(0, prompt), reset(1, prompt, max_k=1)], batch_size=2)
    assert [(a.status, a.drafts) for a in answers] == [(RowStatus.OK, [6, 7]), (RowStatus.OK, [6])]
    assert [a.drafts for a in service.answer(table, [reset(0, prompt)], batch_size=3)] == [[]]  # K 0
    lost = RowUpdate(5, RowOp.APPEND, 4, 10, np.array([1], np.int32))
    assert [a.status for a in service.answer(table, [lost], batch_size=1)] == [RowStatus.RESYNC]
