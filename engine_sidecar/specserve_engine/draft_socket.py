"""The sidecar's draft socket server: `drafts.sock` in the runtime dir (wire format in draft_protocol.py,
described in docs/sidecar.md, "The draft socket"). One thread per engine connection keeps that
connection's token table and answers each engine step with the drafts the service gives for it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specserve_engine.draft_protocol import (
    DraftResponse,
    ProtocolError,
    RowOp,
    RowUpdate,
    decode_request,
    encode_response,
    recv_frame,
    socket_address,
)
from specserve_engine.drafters import Seq
from specserve_engine.sidecar_service import SidecarService

log = logging.getLogger("specserve.sidecar")

_epochs = itertools.count(1)
_connections = itertools.count(1)  # process-wide: drafter state is keyed by connection


@dataclass
class _Row:
    epoch: int
    buf: np.ndarray
    length: int


@dataclass
class SequenceTable:
    """One engine connection's rows: the tokens of each, as the proposer sent them."""

    connection: int
    rows: dict[int, _Row] = field(default_factory=dict)

    def update(self, u: RowUpdate) -> Seq | None:
        row = self.rows.get(u.row)
        if u.op == RowOp.RESET:
            row = self.rows[u.row] = _Row(next(_epochs), np.empty(max(64, 2 * len(u.tokens)), np.int32), 0)
        elif row is None or row.length != u.start:
            self.rows.pop(u.row, None)
            return None
        n = row.length + len(u.tokens)
        if n > len(row.buf):
            buf = np.empty(2 * n, np.int32)
            buf[: row.length] = row.buf[: row.length]
            row.buf = buf
        row.buf[row.length : n] = u.tokens
        row.length = n
        return Seq((self.connection, u.row), row.epoch, row.buf[:n])


class DraftSocketServer:
    """Accepts engine connections on the Unix socket; one thread per connection."""

    def __init__(self, service: SidecarService, path: Path) -> None:
        self.service = service
        self.path = path
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._stopping = False

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        address = socket_address(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if isinstance(address, str):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            listener.bind(address)
            os.chmod(self.path, 0o666)  # the engine container may run as another user
        else:
            listener.bind(address)
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, name="draft-accept", daemon=True).start()
        log.info("draft socket listening at %s", self.path)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="draft-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        table = SequenceTable(next(_connections))
        try:
            while True:
                body = recv_frame(conn)
                if body is None:
                    return
                req = decode_request(body)
                answers = self.service.answer(table, req.rows, req.batch_size)
                conn.sendall(encode_response(DraftResponse(req.call_id, answers)))
        except (OSError, ConnectionError, ProtocolError) as exc:
            if not self._stopping:
                log.info("engine connection %d closed: %r", table.connection, exc)
        finally:
            self._open.discard(conn)
            conn.close()
            self.service.forget(table.connection)

    def stop(self) -> None:
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
