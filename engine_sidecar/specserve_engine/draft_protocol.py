"""The draft socket protocol between the vLLM proposer (client) and the sidecar (server).

One Unix stream socket in the runtime directory (`drafts.sock`), shared by the engine and sidecar
containers. Each engine step the proposer sends one request frame and waits, bounded by a deadline, for
the matching response frame. Only tokens the sidecar has not seen cross the socket: a row is either
*appended* (the tokens after what was sent before) or *reset* (the whole sequence, when the row now holds
another sequence or the sidecar lost its state). Rows are the engine's input-batch rows; the sidecar keeps
one token table per connection, so a reconnect starts from empty tables.

Frames are little-endian and length-prefixed:

    frame    := u32 body_length, body
    request  := u32 magic, u32 call_id, u32 batch_size, u32 n_rows, row*
    row      := u32 row, u8 op, u8 max_k, u32 start, u32 n_tokens, i32 tokens[n_tokens]
    response := u32 magic, u32 call_id, u32 n_rows, answer*        (answers in request order)
    answer   := u8 status, u8 n_drafts, i32 drafts[n_drafts]

`batch_size` is the number of requests the step scheduled: the sidecar takes K from its policy for that
batch size and never returns more than a row's `max_k` (the engine's num_speculative_tokens, less the
room left before max_model_len). `call_id` lets the client drop a late answer to an abandoned call.

Limits: a request carries at most `MAX_ROWS` rows and `MAX_FRAME_TOKENS` tokens in all, so no frame is
longer than `MAX_FRAME_BYTES` (about 16 MiB); a longer length prefix is refused before anything is
read, and a frame's bytes are buffered only as they arrive. The proposer keeps within the token budget
by leaving the rows that would overflow it to the next step.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

SOCKET_NAME = "drafts.sock"
# A Unix socket's path holds at most 107 bytes on Linux (sun_path is 108 with its NUL).
MAX_SOCKET_PATH_BYTES = 107
DEADLINE_ENV = "SPECSERVE_DRAFT_DEADLINE_MS"
DEFAULT_DEADLINE_MS = 50.0

REQUEST_MAGIC = 0x53505251  # "SPRQ"
RESPONSE_MAGIC = 0x53505253  # "SPRS"


def socket_address(path: str | os.PathLike[str]) -> str | bytes:
    """The address both ends use for the draft socket at `path`: the path itself, or, where it is too
    long for a Unix socket (deep temporary folders), an abstract socket named after it. Both work because
    the engine and the sidecar share a network namespace (the pod's, or the machine's locally)."""
    raw = os.fsencode(path)
    if len(raw) <= MAX_SOCKET_PATH_BYTES:
        return os.fsdecode(raw)
    return b"\0specserve-drafts-" + hashlib.sha256(raw).hexdigest()[:32].encode()


_FRAME = struct.Struct("<I")
_REQ_HEAD = struct.Struct("<IIII")
_ROW_HEAD = struct.Struct("<IBBII")
_RESP_HEAD = struct.Struct("<III")
_ANSWER_HEAD = struct.Struct("<BB")

MAX_ROWS = 4096  # rows of one engine step (vLLM's max_num_seqs stays far below)
MAX_FRAME_TOKENS = 1 << 22  # tokens of one request, all rows together (16 MiB of i32)
MAX_FRAME_BYTES = _REQ_HEAD.size + MAX_ROWS * _ROW_HEAD.size + 4 * MAX_FRAME_TOKENS
_RECV_CHUNK = 1 << 20


class RowOp(IntEnum):
    APPEND = 1  # tokens continue what this row sent before, from `start`
    RESET = 2  # the row holds a new sequence: tokens are all of it (start = 0)


class RowStatus(IntEnum):
    OK = 0
    RESYNC = 1  # the sidecar's table did not match `start`: send the whole row next time


class ProtocolError(ValueError):
    """A frame that does not parse: the connection is dropped."""


@dataclass(frozen=True)
class RowUpdate:
    row: int
    op: RowOp
    max_k: int
    start: int
    tokens: np.ndarray  # int32


@dataclass(frozen=True)
class DraftRequest:
    call_id: int
    batch_size: int
    rows: list[RowUpdate]


@dataclass(frozen=True)
class RowAnswer:
    status: RowStatus
    drafts: list[int]


@dataclass(frozen=True)
class DraftResponse:
    call_id: int
    answers: list[RowAnswer]


def encode_request(req: DraftRequest) -> bytes:
    parts = [_REQ_HEAD.pack(REQUEST_MAGIC, req.call_id, req.batch_size, len(req.rows))]
    for r in req.rows:
        tokens = np.ascontiguousarray(r.tokens, dtype="<i4")
        parts.append(_ROW_HEAD.pack(r.row, int(r.op), r.max_k, r.start, len(tokens)))
        parts.append(tokens.tobytes())
    return _frame(b"".join(parts))


def decode_request(body: bytes) -> DraftRequest:
    try:
        magic, call_id, batch_size, n_rows = _REQ_HEAD.unpack_from(body, 0)
        if magic != REQUEST_MAGIC:
            raise ProtocolError(f"bad request magic {magic:#x}")
        if n_rows > MAX_ROWS:
            raise ProtocolError(f"{n_rows} rows exceed {MAX_ROWS}")
        off = _REQ_HEAD.size
        rows = []
        for _ in range(n_rows):
            row, op, max_k, start, n = _ROW_HEAD.unpack_from(body, off)
            off += _ROW_HEAD.size
            end = off + 4 * n
            if end > len(body):
                raise ProtocolError("row tokens run past the frame")
            tokens = np.frombuffer(body, dtype="<i4", count=n, offset=off)
            rows.append(RowUpdate(row, RowOp(op), max_k, start, tokens))
            off = end
    except struct.error as exc:
        raise ProtocolError(f"truncated request: {exc}") from exc
    except ValueError as exc:  # RowOp(op) on an unknown op
        raise ProtocolError(str(exc)) from exc
    if off != len(body):
        raise ProtocolError(f"{len(body) - off} trailing bytes in request")
    return DraftRequest(call_id, batch_size, rows)


def encode_response(resp: DraftResponse) -> bytes:
    parts = [_RESP_HEAD.pack(RESPONSE_MAGIC, resp.call_id, len(resp.answers))]
    for a in resp.answers:
        parts.append(_ANSWER_HEAD.pack(int(a.status), len(a.drafts)))
        if a.drafts:
            parts.append(struct.pack(f"<{len(a.drafts)}i", *a.drafts))
    return _frame(b"".join(parts))


def decode_response(body: bytes) -> DraftResponse:
    try:
        magic, call_id, n = _RESP_HEAD.unpack_from(body, 0)
        if magic != RESPONSE_MAGIC:
            raise ProtocolError(f"bad response magic {magic:#x}")
        off = _RESP_HEAD.size
        answers = []
        for _ in range(n):
            status, k = _ANSWER_HEAD.unpack_from(body, off)
            off += _ANSWER_HEAD.size
            drafts = list(struct.unpack_from(f"<{k}i", body, off))
            off += 4 * k
            answers.append(RowAnswer(RowStatus(status), drafts))
    except struct.error as exc:
        raise ProtocolError(f"truncated response: {exc}") from exc
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc
    return DraftResponse(call_id, answers)


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body)) + body


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame's body from a blocking socket; None when the peer closed between frames."""
    head = _recv_exact(sock, _FRAME.size, allow_eof=True)
    if head is None:
        return None
    (length,) = _FRAME.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    body = _recv_exact(sock, length, allow_eof=False)
    assert body is not None
    return body


def _recv_exact(sock: socket.socket, n: int, allow_eof: bool) -> bytes | None:
    """n bytes, buffered as they arrive (a length prefix alone allocates nothing)."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = sock.recv(min(n - got, _RECV_CHUNK))
        if not chunk:
            if got == 0 and allow_eof:
                return None
            raise ConnectionError("peer closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
