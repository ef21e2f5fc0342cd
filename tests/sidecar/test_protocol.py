"""The draft socket's frames: round trips, and every malformed frame refused with ProtocolError."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from specserve_engine.draft_protocol import (
    DraftRequest,
    DraftResponse,
    ProtocolError,
    RowAnswer,
    RowOp,
    RowStatus,
    RowUpdate,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    recv_frame,
)


def _body(frame: bytes) -> bytes:
    (n,) = struct.unpack_from("<I", frame)
    assert n == len(frame) - 4
    return frame[4:]


def test_request_round_trip() -> None:
    req = DraftRequest(
        7,
        3,
        [
            RowUpdate(0, RowOp.RESET, 4, 0, np.array([1, 2, 3], np.int32)),
            RowUpdate(2, RowOp.APPEND, 2, 3, np.array([9], np.int32)),
            RowUpdate(5, RowOp.APPEND, 1, 10, np.array([], np.int32)),
        ],
    )
    got = decode_request(_body(encode_request(req)))
    assert (got.call_id, got.batch_size) == (7, 3)
    assert [(r.row, r.op, r.max_k, r.start, r.tokens.tolist()) for r in got.rows] == [
        (0, RowOp.RESET, 4, 0, [1, 2, 3]),
        (2, RowOp.APPEND, 2, 3, [9]),
        (5, RowOp.APPEND, 1, 10, []),
    ]


def test_response_round_trip() -> None:
    resp = DraftResponse(9, [RowAnswer(RowStatus.OK, [5, 6, 7]), RowAnswer(RowStatus.RESYNC, [])])
    assert decode_response(_body(encode_response(resp))) == resp


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00" * 16,  # wrong magic
        _body(encode_request(DraftRequest(1, 1, [RowUpdate(0, RowOp.RESET, 4, 0, np.arange(3))])))[:-2],
        _body(encode_request(DraftRequest(1, 1, []))) + b"x",
        _body(encode_request(DraftRequest(1, 1, [RowUpdate(0, RowOp.RESET, 4, 0, np.arange(3))])))[:16]
        + struct.pack("<IBBII", 0, 9, 4, 0, 0),  # unknown op
    ],
)
def test_bad_requests_are_refused(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_request(body)


def test_bad_responses_are_refused() -> None:
    good = _body(encode_response(DraftResponse(1, [RowAnswer(RowStatus.OK, [1, 2])])))
    for body in (good[:-1], b"\x01" * 12, good[:12] + b"\x07\x00"):
        with pytest.raises(ProtocolError):
            decode_response(body)


def test_recv_frame_over_a_socket_pair() -> None:
    a, b = socket.socketpair()
    with a, b:
        frame = encode_response(DraftResponse(3, [RowAnswer(RowStatus.OK, [1])]))
        a.sendall(frame[:5])
        a.sendall(frame[5:])
        assert recv_frame(b) == frame[4:]
        a.sendall(frame[:6])
        a.close()
        with pytest.raises(ConnectionError):
            recv_frame(b)


def test_recv_frame_eof_between_frames() -> None:
    a, b = socket.socketpair()
    with b:
        a.close()
        assert recv_frame(b) is None
