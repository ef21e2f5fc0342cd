"""Off costs nothing, on costs little (docs/engine-pod.md#off-costs-nothing), on the sidecar path: a K = 0
step sends nothing, a row is identified by its request (no hashing) and sends only its new tokens, the
tokens of skipped steps go with the next call (the resume path), and a long row is taken in a bounded
share per call so it does not take drafts away from a short row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specserve_engine.draft_protocol import RowOp, RowUpdate
from specserve_engine.drafters import Seq
from specserve_engine.drafters.model import ModelDrafter
from specserve_engine.drafters.ngram import NgramDrafter
from specserve_engine.drafters.suffix import SuffixDrafter
from specserve_engine.vllm_plugins import proposer
from specserve_testing.proposer_inputs import REPEAT, Batch, client_for

LONG = 32 * 1024


def _record_rows(monkeypatch: pytest.MonkeyPatch) -> list[list[RowUpdate]]:
    sent: list[list[RowUpdate]] = []
    encode = proposer.encode_request
    monkeypatch.setattr(proposer, "encode_request", lambda req: (sent.append(req.rows), encode(req))[1])
    return sent


async def test_a_k0_step_makes_no_call(draft_socket: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _record_rows(monkeypatch)
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket)
    assert batch.propose(client, 1, k=0) == [[]]
    assert (sent, client.connected, client.answered + client.missed) == ([], False, 0)
    client.close()


async def test_resuming_sends_the_skipped_tokens_once(
    draft_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = _record_rows(monkeypatch)
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2])
    client = client_for(draft_socket)
    batch.propose(client, 1)
    for token in REPEAT[:3]:  # three K = 0 steps: the row grows, nothing is sent
        batch.extend(0, [token])
        assert batch.propose(client, 1, k=0) == [[]]
    # Speculation resumes: the row appends the three tokens it gained and drafts from its current state.
    assert batch.propose(client, 1, k=2) == [[6, 7]]
    assert [(r.op, r.start, r.tokens.tolist()) for r in sent[1]] == [(RowOp.APPEND, 10, REPEAT[:3])]
    # The same tokens under another request id are another request: the row is sent whole.
    batch.set(0, batch.tokens[0, : batch.lengths[0]].tolist())
    batch.propose(client, 1)
    assert sent[2][0].op == RowOp.RESET
    client.close()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_long_row_does_not_take_drafts_from_a_short_row(method: str) -> None:
    budget = 4096
    drafter = (NgramDrafter if method == "ngram" else SuffixDrafter)(method, max_k=4, catch_up_tokens=budget)
    # A 32K-token row that repeats a random 1000-token stretch: once taken in, it has a continuation.
    pattern = np.random.default_rng(0).integers(100, 300, 1000, dtype=np.int32)
    long_row = Seq((1, 0), 1, np.tile(pattern, LONG // 1000 + 1)[:LONG])
    short_row = Seq((1, 1), 1, np.array([1, *REPEAT, 2, *REPEAT[:3]], np.int32))
    slices = -(-LONG // budget)
    for call in range(slices):
        long_drafts, short_drafts = drafter.draft([long_row, short_row], [4, 4])
        assert short_drafts == [6, 7, 8, 9]  # every call, while the long row is taken in
        assert (long_drafts != []) == (call == slices - 1)  # drafts once all of it is in, not before


def test_the_suffix_table_is_capped_where_it_grows() -> None:
    drafter = SuffixDrafter("suffix", max_k=4, max_contexts=1000, catch_up_tokens=LONG)
    rng = np.random.default_rng(1)
    drafter.draft([Seq((1, 0), 1, rng.integers(0, 1000, 5000, dtype=np.int32))], [4])
    assert len(drafter._next) <= 1000


def test_the_model_drafter_catches_up_in_slices(random_llama: Path) -> None:
    drafter = ModelDrafter("self", "selfSpeculative", 3, str(random_llama), num_layers=1, catch_up_tokens=64)
    drafter.load()
    tokens = np.random.default_rng(2).integers(0, 320, 200, dtype=np.int32)
    row = Seq((1, 0), 1, tokens)
    results = [drafter.draft([row], [3])[0] for _ in range(4)]
    # 200 tokens at 64 per call: nothing for three calls, then drafts equal to a drafter that had all of
    # the row in one go.
    assert results[:3] == [[], [], []]
    whole = ModelDrafter("self", "selfSpeculative", 3, str(random_llama), num_layers=1, catch_up_tokens=1024)
    whole.load()
    assert results[3] == whole.draft([row], [3])[0]
