"""The sidecar's draft socket server (draft_socket.py), in-process, with the engine's proposer client
on the other end: drafts per the policy for the batch size, the per-connection token table, and socket
paths too long to bind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from specserve_engine.api import PolicyRequest
from specserve_engine.draft_protocol import (
    MAX_SOCKET_PATH_BYTES,
    SOCKET_NAME,
    RowOp,
    RowUpdate,
    socket_address,
)
from specserve_engine.draft_socket import DraftSocketServer, SequenceTable
from specserve_engine.sidecar_service import SidecarService
from specserve_testing.proposer_inputs import REPEAT, Batch, client_for


async def test_drafts_follow_the_policy_for_the_batch_size(
    service: SidecarService, draft_socket: Path, make_policy: Callable[..., PolicyRequest]
) -> None:
    batch = Batch()
    for row in range(4):
        batch.set(row, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket)
    assert batch.propose(client, 1) == [[6, 7, 8, 9]]
    k_table = {"1": 4, "2": 2, "4": 0, "8": 0, "+Inf": 0}
    await service.put_policy(PolicyRequest(policyVersion=2, drafter="ngram", kByBucket=k_table))
    assert batch.propose(client, 2) == [[6, 7], [6, 7]]
    assert batch.propose(client, 3) == [[], [], []]  # batch 3 falls in bucket 4: off
    await service.put_policy(make_policy(3, mode="off"))
    assert batch.propose(client, 1) == [[]]
    client.close()


def test_sequence_table_asks_for_a_resync_when_it_lost_track() -> None:
    table = SequenceTable(1)
    assert table.update(RowUpdate(0, RowOp.APPEND, 4, 5, np.array([1], np.int32))) is None
    seq = table.update(RowUpdate(0, RowOp.RESET, 4, 0, np.arange(3, dtype=np.int32)))
    assert seq is not None and seq.tokens.tolist() == [0, 1, 2]
    grown = table.update(RowUpdate(0, RowOp.APPEND, 4, 3, np.arange(200, dtype=np.int32)))
    assert grown is not None and len(grown.tokens) == 203 and grown.epoch == seq.epoch
    assert table.update(RowUpdate(0, RowOp.APPEND, 4, 7, np.array([1], np.int32))) is None


def test_a_runtime_dir_too_deep_for_a_unix_socket_path_still_works(
    service: SidecarService, tmp_path: Path
) -> None:
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 5) / SOCKET_NAME
    assert len(str(deep)) > MAX_SOCKET_PATH_BYTES  # bind() on the path itself would fail
    server = DraftSocketServer(service, deep)
    server.start()
    try:
        batch = Batch()
        batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
        client = client_for(deep)
        assert batch.propose(client, 1) == [[6, 7, 8, 9]]
        client.close()
    finally:
        server.stop()
    assert socket_address(tmp_path / SOCKET_NAME) == str(tmp_path / SOCKET_NAME)  # short: the file
