"""Shadow drafting (shadow.py): drafts by the loaded drafters not in force, scored against the tokens the
engine produced next, within a bounded number of rows and share of the connection's time; and the
service's shadow pass, whose counts reach the sidecar's metrics while the live answers stay as they were."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specserve_engine.api import PolicyRequest, SidecarConfig
from specserve_engine.draft_protocol import RowOp, RowUpdate
from specserve_engine.draft_socket import SequenceTable
from specserve_engine.drafters import Drafter, Seq
from specserve_engine.drafters.ngram import NgramDrafter
from specserve_engine.shadow import ShadowDrafts, matched_prefix
from specserve_engine.sidecar_service import SidecarService
from specserve_testing.proposer_inputs import REPEAT

PROMPT = [1, *REPEAT, 2, *REPEAT[:3]]  # n-gram continues it with 6, 7, 8, 9


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowRaising(Drafter):
    """Takes 10 ms of the fake clock, then raises: a shadow drafter bug."""

    def __init__(self, clock: Clock) -> None:
        super().__init__("broken", "ngram", 4, 4096)
        self.clock = clock

    def draft(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        self.clock.now += 0.01
        raise RuntimeError("boom")

    def forget(self, connection: int) -> None:
        pass


def _seq(row: int, tokens: list[int], epoch: int = 1) -> Seq:
    return Seq((1, row), epoch, np.array(tokens, np.int32))


def _shadow(**kwargs: object) -> tuple[ShadowDrafts, list[tuple], list[tuple]]:
    """Shadow drafts on a clock that stands still unless a test moves it: drafts take no time, so the
    budget never holds a drafter back."""
    scores: list[tuple] = []
    errors: list[tuple] = []
    kwargs.setdefault("clock", Clock())
    shadow = ShadowDrafts(
        lambda d, n, m: scores.append((d, n, m)), lambda d, e: errors.append((d, str(e))), **kwargs
    )
    return shadow, scores, errors


def test_matched_prefix_waits_for_enough_tokens_unless_a_mismatch_decides() -> None:
    assert matched_prefix([6, 7, 8], np.array([6, 7, 8, 9])) == 3
    assert matched_prefix([6, 7, 8], np.array([6, 0])) == 1
    assert matched_prefix([6, 7, 8], np.array([5])) == 0
    assert matched_prefix([6, 7, 8], np.array([6, 7])) is None
    assert matched_prefix([6], np.array([], np.int32)) is None


def test_a_shadow_draft_is_scored_once_the_engine_produced_its_tokens() -> None:
    shadow, scores, _ = _shadow()
    ngram, locks = NgramDrafter("ngram", 4), {"ngram": threading.Lock()}
    shadow.draft([ngram], [(_seq(0, PROMPT), 4)], locks)
    shadow.score([_seq(0, [*PROMPT, 6, 7])])
    assert scores == []  # two of four tokens known, both matched: not decided yet
    shadow.score([_seq(0, [*PROMPT, 6, 7, 0, 9])])
    assert scores == [("ngram", 4, 2)]
    shadow.score([_seq(0, [*PROMPT, 6, 7, 0, 9, 1])])
    assert scores == [("ngram", 4, 2)]  # scored once


def test_a_row_with_nothing_to_propose_is_scored_at_once_without_a_draft() -> None:
    """n-gram finds no match: live, that row verifies without a draft; in the shadow it counts as a row
    scored with a draft of 0 tokens, so that drafts over rows give the drafter's proposal rate."""
    shadow, scores, _ = _shadow()
    ngram, locks = NgramDrafter("ngram", 4), {"ngram": threading.Lock()}
    shadow.draft([ngram], [(_seq(0, [11, 12, 13, 14]), 4), (_seq(1, PROMPT), 4)], locks)
    assert scores == [("ngram", 0, 0)]
    assert set(shadow.pending["ngram"]) == {(1, 1)}


def test_drafts_of_rows_that_started_over_or_finished_are_dropped_unscored() -> None:
    shadow, scores, _ = _shadow()
    ngram, locks = NgramDrafter("ngram", 4), {"ngram": threading.Lock()}
    shadow.draft([ngram], [(_seq(0, PROMPT), 4), (_seq(1, PROMPT), 4)], locks)
    shadow.score([_seq(0, [*PROMPT, 6, 7, 8, 9], epoch=2)])  # row 0 is a new sequence now
    assert scores == [] and (1, 0) not in shadow.pending["ngram"]
    shadow.draft([ngram], [(_seq(2, PROMPT), 4)], locks)  # row 1 is gone from the batch
    assert set(shadow.pending["ngram"]) == {(1, 2)}


def test_a_drafter_follows_a_bounded_set_of_rows_and_keeps_them_while_they_last() -> None:
    shadow, _, _ = _shadow(rows=2)
    ngram, locks = NgramDrafter("ngram", 4), {"ngram": threading.Lock()}
    shadow.draft([ngram], [(_seq(r, PROMPT), 4) for r in (0, 1, 2)], locks)
    assert shadow.followed["ngram"] == [(1, 0), (1, 1)]
    shadow.draft([ngram], [(_seq(r, [*PROMPT, 6]), 4) for r in (1, 2, 3)], locks)
    assert shadow.followed["ngram"] == [(1, 1), (1, 2)]
    # The engine's room for drafts caps a shadow draft as it caps a live one.
    shadow2, _, _ = _shadow()
    shadow2.draft([NgramDrafter("ngram", 4)], [(_seq(0, PROMPT), 2)], locks)
    assert shadow2.pending["ngram"][(1, 0)].tokens == [6, 7]


def test_each_shadow_drafter_stays_within_its_share_and_a_raising_one_costs_only_its_pass() -> None:
    clock = Clock()
    shadow, _, errors = _shadow(share=0.5, clock=clock)
    broken = SlowRaising(clock)
    ngram = NgramDrafter("ngram", 4)
    locks = {"broken": threading.Lock(), "ngram": threading.Lock()}
    shadow.draft([broken, ngram], [(_seq(0, PROMPT), 4)], locks)
    assert errors == [("broken", "boom")]
    assert (1, 0) in shadow.pending["ngram"]  # the other drafter still drafted
    # Each of the two has half the share, 0.25: the 10 ms draft makes the costly one wait 40 ms after it
    # ended, while the cheap one (no time on this clock) drafts at every pass.
    assert shadow.next_at["broken"] == pytest.approx(0.05) and shadow.next_at["ngram"] == pytest.approx(0.01)
    for now, broken_drafts in ((0.049, 1), (0.05, 2)):
        clock.now = now
        shadow.draft([broken, ngram], [(_seq(r, PROMPT), 4) for r in (0, 1)], locks)
        assert len(errors) == broken_drafts
        assert (1, 1) in shadow.pending["ngram"]
        shadow.pending["ngram"].clear()


def _reset(row: int, tokens: list[int]) -> RowUpdate:
    return RowUpdate(row, RowOp.RESET, 4, 0, np.array(tokens, np.int32))


def _append(row: int, start: int, tokens: list[int]) -> RowUpdate:
    return RowUpdate(row, RowOp.APPEND, 4, start, np.array(tokens, np.int32))


def _shadow_counts(service: SidecarService, drafter: str) -> tuple[list[float], list[float]]:
    def counts(series: str) -> list[float]:
        get = service.metrics.registry.get_sample_value
        return [get(series, {"drafter": drafter, "position": str(p)}) or 0.0 for p in range(4)]

    return counts("specserve_sidecar_shadow_proposed_total"), counts(
        "specserve_sidecar_shadow_accepted_total"
    )


def _shadow_rows(service: SidecarService, drafter: str) -> float:
    return (
        service.metrics.registry.get_sample_value("specserve_sidecar_shadow_rows_total", {"drafter": drafter})
        or 0.0
    )


async def _run_two_steps(service: SidecarService) -> list[list[list[int]]]:
    """Suffix live; two engine steps on one row whose next tokens match n-gram's first three."""
    table_k = dict.fromkeys(("1", "2", "4", "8", "+Inf"), 4)
    await service.put_policy(PolicyRequest(policyVersion=2, drafter="suffix", kByBucket=table_k))
    table = SequenceTable(7)
    answers = [service.answer(table, [_reset(0, PROMPT)], batch_size=1)]
    service.shadow_pass(table)
    answers.append(service.answer(table, [_append(0, len(PROMPT), [6, 7, 8, 0])], batch_size=1))
    service.shadow_pass(table)
    return [[a.drafts for a in step] for step in answers]


async def test_the_service_counts_shadow_drafts_of_loaded_drafters_not_in_force(
    service: SidecarService, config: SidecarConfig
) -> None:
    live = await _run_two_steps(service)
    proposed, accepted = _shadow_counts(service, "ngram")
    assert proposed == [1, 1, 1, 1] and accepted == [1, 1, 1, 0]
    assert _shadow_rows(service, "ngram") == 1.0  # one row, one draft: a proposal rate of 1
    assert _shadow_counts(service, "suffix") == ([0] * 4, [0] * 4)  # in force: measured live
    assert _shadow_counts(service, "self") == ([0] * 4, [0] * 4)  # a model drafter not loaded: no shadow
    # The live answers are what a sidecar without shadow drafting gives.
    quiet = SidecarService(config.model_copy(update={"shadow_share": 0.0}))
    await quiet.start()
    assert await _run_two_steps(quiet) == live
    assert _shadow_counts(quiet, "ngram") == ([0] * 4, [0] * 4)


def test_the_shadow_share_is_bounded(config: SidecarConfig) -> None:
    raw = config.model_dump(by_alias=True)
    for bad in (-0.1, 0.6, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="shadowShare"):
            SidecarConfig.model_validate({**raw, "shadowShare": bad})
