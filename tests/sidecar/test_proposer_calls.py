"""The proposer's step outcomes (vllm_plugins/proposer.py): answered, missed and skipped steps counted in
the shared-memory file each proposer process keeps in the runtime dir, and exported, summed over the
processes, as `specserve_proposer_calls_total` by the collector the engine's metrics endpoint registers;
and request frames kept within the protocol's token budget."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from specserve_engine.draft_protocol import RowOp, RowUpdate
from specserve_engine.vllm_plugins import proposer
from specserve_engine.vllm_plugins.proposer import (
    CallCounts,
    ProposerCallsCollector,
    call_counts_path,
    read_call_counts,
)
from specserve_testing.proposer_inputs import REPEAT, Batch, client_for


def exported(runtime_dir: Path) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(ProposerCallsCollector(runtime_dir, "tiny"))
    return {
        outcome: registry.get_sample_value(
            "specserve_proposer_calls_total", {"model_name": "tiny", "outcome": outcome}
        )
        for outcome in ("answered", "missed", "skipped")
    }


async def test_step_outcomes_are_counted_and_exported(draft_socket: Path, tmp_path: Path) -> None:
    runtime_dir = draft_socket.parent
    assert exported(runtime_dir) == dict.fromkeys(("answered", "missed", "skipped"))  # no proposer yet
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket, counts=CallCounts(call_counts_path(runtime_dir)))
    for _ in range(3):
        batch.propose(client, 1)
    client.close()
    # A second engine process on the same runtime dir (another worker) is added in.
    hung = tmp_path / "hung.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(hung))
    listener.listen(1)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    other = CallCounts(runtime_dir / "proposer-calls-other.bin")
    late = client_for(hung, deadline_s=0.05, retry_s=60.0, max_late=1, counts=other)
    batch.propose(late, 1)  # no answer in time: missed, and the connection is given up
    batch.propose(late, 1)  # within the retry interval: skipped
    assert (late.answered, late.missed, late.skipped) == (0, 1, 1)
    assert exported(runtime_dir) == {"answered": 3.0, "missed": 1.0, "skipped": 1.0}
    assert read_call_counts(tmp_path / "nowhere") is None
    listener.close()
    for s in accepted:
        s.close()


def test_a_new_process_counts_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "proposer-calls-1.bin"
    first = CallCounts(path)
    first.add(proposer.ANSWERED)
    first.add(proposer.ANSWERED)
    assert read_call_counts(tmp_path) == {"answered": 2, "missed": 0, "skipped": 0}
    CallCounts(path)  # the same pid again after a restart: a counter reset, as Prometheus expects
    assert read_call_counts(tmp_path) == {"answered": 0, "missed": 0, "skipped": 0}


async def test_rows_over_the_frame_budget_wait_for_the_next_step(
    draft_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[list[RowUpdate]] = []
    encode = proposer.encode_request
    monkeypatch.setattr(proposer, "encode_request", lambda req: (sent.append(req.rows), encode(req))[1])
    monkeypatch.setattr(proposer, "MAX_FRAME_TOKENS", 20)
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])  # 13 tokens
    batch.set(1, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket)
    assert batch.propose(client, 2) == [[6, 7, 8, 9], []]  # row 1 would overflow the frame
    assert batch.propose(client, 2) == [[6, 7, 8, 9], [6, 7, 8, 9]]
    assert [[(r.row, r.op, len(r.tokens)) for r in rows] for rows in sent] == [
        [(0, RowOp.RESET, 13)],
        [(0, RowOp.APPEND, 0), (1, RowOp.RESET, 13)],
    ]
    client.close()
