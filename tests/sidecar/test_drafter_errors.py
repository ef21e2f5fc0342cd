"""A drafter that raises (sidecar_service.py): each failed call costs that step's drafts and counts in
`specserve_sidecar_drafter_errors_total`; one traceback, not one per step; after enough failures in a
row the drafter is marked failed (state, policy-info metric) and drafts nothing until a new policy
names it and it warms up again. And warming one drafter never delays the draft calls of another."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from specserve_engine.api import PolicyRequest, SidecarConfig
from specserve_engine.draft_protocol import RowOp, RowUpdate
from specserve_engine.draft_socket import SequenceTable
from specserve_engine.drafters import Seq
from specserve_engine.sidecar_service import (
    MAX_CONSECUTIVE_DRAFTER_ERRORS,
    WARMUP_CONNECTION,
    SidecarService,
)
from specserve_testing.proposer_inputs import REPEAT, Batch, client_for

PROMPT = np.array([1, *REPEAT, 2, *REPEAT[:3]], np.int32)


def ask(service: SidecarService, table: SequenceTable) -> list[list[int]]:
    """One engine step for row 0 (the whole prompt each time: a reset, so the table never drifts)."""
    answers = service.answer(table, [RowUpdate(0, RowOp.RESET, 4, 0, PROMPT)], batch_size=1)
    return [a.drafts for a in answers]


def sample(service: SidecarService, name: str, labels: dict[str, str]) -> float | None:
    return service.metrics.registry.get_sample_value(name, labels)


def drafter_status(service: SidecarService, name: str) -> tuple[str, str | None]:
    entry = next(d for d in service.state().drafters if d.name == name)
    return entry.status, entry.error


def test_every_hosted_drafters_error_series_starts_at_zero(service: SidecarService) -> None:
    """Ten failures between two scrapes must read as an increase of ten, not as a new series at ten."""
    for name in service.drafters:
        assert sample(service, "specserve_sidecar_drafter_errors_total", {"drafter": name}) == 0.0


async def test_a_raising_drafter_is_counted_logged_once_then_marked_failed(
    service: SidecarService,
    make_policy: Callable[..., PolicyRequest],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ngram = service.drafters["ngram"]
    real_draft = ngram.draft
    calls = 0

    def broken(seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        nonlocal calls
        calls += 1
        raise RuntimeError("index out of range in the n-gram table")

    table = SequenceTable(1)
    assert ask(service, table) == [[6, 7, 8, 9]]
    monkeypatch.setattr(ngram, "draft", broken)
    caplog.set_level(logging.INFO, "specserve.sidecar")
    steps = MAX_CONSECUTIVE_DRAFTER_ERRORS + 20
    assert all(ask(service, table) == [[]] for _ in range(steps))  # every step answered, without drafts

    errors = sample(service, "specserve_sidecar_drafter_errors_total", {"drafter": "ngram"})
    assert errors == MAX_CONSECUTIVE_DRAFTER_ERRORS == calls  # marked failed: no longer even called
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1
    assert sum("marked failed" in r.getMessage() for r in caplog.records) == 1
    status, error = drafter_status(service, "ngram")
    assert status == "failed" and error is not None and "RuntimeError" in error
    info = {"drafter": "ngram", "mode": "on", "policy_version": "1"}
    assert sample(service, "specserve_sidecar_policy_info", info | {"drafter_status": "failed"}) == 1

    # The same policy again changes nothing; a new one naming the drafter warms it up and re-enables it.
    monkeypatch.setattr(ngram, "draft", real_draft)
    assert await service.put_policy(make_policy(1)) == 200
    assert drafter_status(service, "ngram")[0] == "failed"
    assert await service.put_policy(make_policy(2)) == 202
    for _ in range(200):
        if service.state().policy_version == 2:
            break
        await asyncio.sleep(0.02)
    assert drafter_status(service, "ngram") == ("loaded", None)
    assert ask(service, table) == [[6, 7, 8, 9]]
    info = {"drafter": "ngram", "mode": "on", "policy_version": "2", "drafter_status": "loaded"}
    assert sample(service, "specserve_sidecar_policy_info", info) == 1


async def test_a_drafter_that_fails_now_and_then_stays_in_force(
    service: SidecarService, monkeypatch: pytest.MonkeyPatch
) -> None:
    ngram = service.drafters["ngram"]
    real_draft = ngram.draft
    step = 0

    def flaky(seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        nonlocal step
        step += 1
        if step % 2:
            raise ValueError("every other call")
        return real_draft(seqs, ks)

    monkeypatch.setattr(ngram, "draft", flaky)
    table = SequenceTable(1)
    answers = [ask(service, table) for _ in range(4 * MAX_CONSECUTIVE_DRAFTER_ERRORS)]
    assert answers.count([[6, 7, 8, 9]]) == 2 * MAX_CONSECUTIVE_DRAFTER_ERRORS
    assert drafter_status(service, "ngram") == ("loaded", None)
    errors = sample(service, "specserve_sidecar_drafter_errors_total", {"drafter": "ngram"})
    assert errors == 2 * MAX_CONSECUTIVE_DRAFTER_ERRORS


async def test_warming_a_drafter_does_not_delay_live_drafts(
    service: SidecarService,
    config: SidecarConfig,
    draft_socket: Path,
    make_policy: Callable[..., PolicyRequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model drafter `self` warms up (each warm-up call made slow, as a big model's would be) while
    the engine keeps drafting with `ngram`: every live call is answered within its deadline, well
    below one warm-up call."""
    model = service.drafters["self"]
    real_draft = model.draft
    warm_calls = 0

    def slow_warm_up(seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        nonlocal warm_calls
        if seqs[0].key[0] == WARMUP_CONNECTION:
            warm_calls += 1
            time.sleep(0.4)
        return real_draft(seqs, ks)

    monkeypatch.setattr(model, "draft", slow_warm_up)
    assert await service.put_policy(make_policy(2, "self", 3)) == 202
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket, deadline_s=0.15, retry_s=0.05)
    live = 0
    while service.state().policy_version == 1:
        if warm_calls:  # the warm-up is under way
            assert batch.propose(client, 1) == [[6, 7, 8, 9]]
            live += 1
        await asyncio.sleep(0.01)
    assert warm_calls == 4 * config.warmup_requests and live >= 10
    assert (client.answered, client.missed) == (live, 0)
    client.close()
