"""The sidecar's draft socket server: `drafts.sock` in the runtime dir (wire format in draft_protocol.py,
described in docs/sidecar.md, "The draft socket"). One thread per engine connection keeps that
connection's token table and answers each engine step with the drafts the service gives for it, then
gives the service its shadow pass (shadow.py) while the engine verifies.

At most `MAX_CONNECTIONS` connections are served at once (further ones are closed on accept), and one
that sends nothing for `IDLE_TIMEOUT_S` is closed: the proposer reconnects on its next call. Anything
that goes wrong on a connection closes that connection, logged once, never the server.
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

MAX_CONNECTIONS = 32  # an engine opens one per worker; a few more cover reconnects
IDLE_TIMEOUT_S = 300.0


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
    # The rows of the last call, each with the most tokens the engine lets it draft (for shadow drafts).
    last_rows: list[tuple[Seq, int]] = field(default_factory=list)

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

    def __init__(
        self,
        service: SidecarService,
        path: Path,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.service = service
        self.path = path
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._stopping = False
        self._refused = 0

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
            if len(self._open) >= self.max_connections:
                self._refused += 1
                if self._refused == 1 or self._refused % 1000 == 0:
                    log.warning(
                        "draft socket: %d connections refused over the limit of %d",
                        self._refused,
                        self.max_connections,
                    )
                conn.close()
                continue
            conn.settimeout(self.idle_timeout_s)
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
                self.service.shadow_pass(table)  # after the answer: the engine's step does not wait
        except (OSError, ConnectionError, ProtocolError) as exc:  # TimeoutError: idle too long
            if not self._stopping:
                log.info("engine connection %d closed: %r", table.connection, exc)
        except Exception:  # a bug costs this connection (the proposer reconnects), never the thread silently
            log.exception("engine connection %d closed on an unexpected error", table.connection)
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
