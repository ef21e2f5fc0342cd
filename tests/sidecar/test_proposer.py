"""The engine's sidecar proposer (vllm_plugins/proposer.py: SidecarProposer and its DraftClient) against
a real draft socket in-process: the engine's caps, only new tokens on the wire, the deadline, and
reconnection."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve_engine.draft_protocol import RowOp, RowUpdate
from specserve_engine.draft_socket import DraftSocketServer
from specserve_engine.sidecar_service import SidecarService
from specserve_engine.vllm_plugins import proposer
from specserve_testing.proposer_inputs import MAX_LEN, REPEAT, Batch, client_for


async def test_drafts_are_capped_by_the_engine(draft_socket: Path) -> None:
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    assert batch.propose(client_for(draft_socket, max_k=2), 1) == [[6, 7]]
    # Two tokens of room before max_model_len: at most one draft.
    assert batch.propose(client_for(draft_socket, max_model_len=int(batch.lengths[0]) + 2), 1) == [[6]]
    # A token outside the engine's vocabulary ends the draft there.
    assert batch.propose(client_for(draft_socket, vocab_size=8), 1) == [[6, 7]]


async def test_only_new_tokens_cross_the_socket(draft_socket: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[list[RowUpdate]] = []
    encode = proposer.encode_request
    monkeypatch.setattr(proposer, "encode_request", lambda req: (sent.append(req.rows), encode(req))[1])
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    batch.set(1, [7, 7, 7])
    client = client_for(draft_socket)
    assert batch.propose(client, 2) == [[6, 7, 8, 9], [7]]
    batch.extend(0, [6, 7])
    batch.extend(1, [7])
    assert batch.propose(client, 2) == [[8, 9, 10, 2], [7]]
    first, second = sent
    assert [(r.op, len(r.tokens)) for r in first] == [(RowOp.RESET, 13), (RowOp.RESET, 3)]
    assert [(r.op, r.start, r.tokens.tolist()) for r in second] == [
        (RowOp.APPEND, 13, [6, 7]),
        (RowOp.APPEND, 3, [7]),
    ]
    # Another request takes row 0 (same length, other tokens): the row is sent whole again.
    batch.set(0, [9, 9, 1, 2, 9, 9, 1, 2, 5, 5, 5, 9, 9, 1, 2])
    assert batch.propose(client, 1) == [[5, 5, 5, 9]]
    assert sent[2][0].op == RowOp.RESET
    # A partial prefill (no sampled token) is skipped, a finished row is skipped.
    assert client.propose(4, [[], [7]], batch.req_ids[:2], batch.lengths, batch.tokens)[0] == []
    client.close()


def test_missing_sidecar_means_no_drafts(tmp_path: Path) -> None:
    batch = Batch()
    batch.set(0, [1, 2, 1, 2])
    client = client_for(tmp_path / "absent.sock")
    t0 = time.perf_counter()
    assert batch.propose(client, 1) == [[]]
    assert time.perf_counter() - t0 < 0.05
    assert not client.connected


def test_a_hung_sidecar_costs_one_deadline_then_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "hung.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    batch = Batch()
    batch.set(0, [1, 2, 1, 2])
    client = client_for(path, deadline_s=0.05, retry_s=5.0, max_late=3)
    for _ in range(3):  # three late answers in a row: the sidecar counts as hung
        t0 = time.perf_counter()
        assert batch.propose(client, 1) == [[]]
        assert 0.04 < time.perf_counter() - t0 < 0.5
    assert not client.connected
    t0 = time.perf_counter()
    assert batch.propose(client, 1) == [[]]
    assert time.perf_counter() - t0 < 0.01  # within retry_s the socket is not even tried
    assert client.missed == 3
    listener.close()
    for s in accepted:
        s.close()


async def test_drafts_resume_when_the_sidecar_is_back(
    service: SidecarService, draft_server: DraftSocketServer, draft_socket: Path
) -> None:
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket, retry_s=0.2)
    assert batch.propose(client, 1) == [[6, 7, 8, 9]]
    # The sidecar goes away: its socket closes and the path is gone.
    draft_server.stop()
    assert batch.propose(client, 1) == [[]]
    assert batch.propose(client, 1) == [[]]
    assert not client.connected
    # It comes back on the same path: after retry_s the client reconnects and resends the row whole.
    again = DraftSocketServer(service, draft_socket)
    again.start()
    try:
        time.sleep(0.25)
        batch.extend(0, [6])
        assert batch.propose(client, 1) == [[7, 8, 9, 10]]
        assert client.connected
    finally:
        again.stop()
        client.close()


async def test_the_vllm_proposer_reads_its_settings(
    draft_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_RUNTIME_DIR", str(draft_socket.parent))
    monkeypatch.setenv("SPECSERVE_DRAFT_DEADLINE_MS", "75")
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, get_vocab_size=lambda: 320),
    )
    prop = proposer.SidecarProposer(vllm_config)
    prop.load_model(object())
    assert (prop.client.max_k, prop.client.deadline_s, prop.client.socket_path) == (
        3,
        0.075,
        str(draft_socket),
    )
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    assert prop.propose_rows(4, batch.sampled(1), batch.req_ids[:1], batch.lengths, batch.tokens) == [
        [6, 7, 8]
    ]
    prop.client.close()


async def test_a_late_answer_keeps_the_connection(
    service: SidecarService, draft_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = service.answer
    calls: list[int] = []

    def slow_first(*args: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)
        return answer(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(service, "answer", slow_first)
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket, deadline_s=0.1)
    assert batch.propose(client, 1) == [[]]  # late: no drafts this step
    assert client.connected
    batch.extend(0, [6])
    time.sleep(0.3)
    # The late answer is dropped, the row is appended (not resent), and drafts flow again.
    assert batch.propose(client, 1) == [[7, 8, 9, 10]]
    assert (client.missed, client.answered) == (1, 1)
    client.close()
