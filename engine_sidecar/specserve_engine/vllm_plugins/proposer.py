"""`SidecarProposer`: vLLM's `custom_class` drafter that asks the sidecar for drafts over a Unix socket.

Named in the engine's speculative config as
`{"method": "custom_class", "model": "specserve_engine.vllm_plugins.proposer.SidecarProposer",
"num_speculative_tokens": K_MAX}`. It runs inside the worker process, once per engine step, and must never
stall the engine or fail a request: every call is bounded by a deadline (env SPECSERVE_DRAFT_DEADLINE_MS),
and a late, broken or missing sidecar yields no drafts for that step. A late answer keeps the connection
(and the sidecar's per-sequence caches): the next call reads and drops it. After `max_late` late answers
in a row, or any error, the socket is closed and reopened at most once per `retry_s`, so a hung sidecar
costs a few deadlines per retry, not one per step.

vLLM's custom_class call gives a proposer only the input-batch rows; specserve's model runner
(plain_step.py) calls `propose_rows` instead, with the step's K and each row's request id, and never calls
it for a step with K = 0. A row is tracked by the request it held and the length sent for it: the same
request, longer now, appends only its new tokens (host work grows with the step's new tokens, not with
context); another request in the row (one finished, or rows were condensed) resets it. A request's tokens
only grow, so that identity needs no hashing. Tokens a row gained during K = 0 steps go with its next
append: that is how the sidecar's drafters catch up when speculation resumes.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specserve_engine.draft_protocol import (
    DEADLINE_ENV,
    DEFAULT_DEADLINE_MS,
    MAX_FRAME_BYTES,
    SOCKET_NAME,
    DraftRequest,
    ProtocolError,
    RowOp,
    RowStatus,
    RowUpdate,
    decode_response,
    encode_request,
    socket_address,
)
from specserve_engine.policy_file import RUNTIME_DIR_ENV

log = logging.getLogger(__name__)


@dataclass
class _Sent:
    req_id: str
    length: int


class DraftClient:
    """The socket side of the proposer, free of vLLM types so it is tested on plain arrays."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        max_k: int,
        max_model_len: int,
        vocab_size: int,
        deadline_s: float = DEFAULT_DEADLINE_MS / 1000,
        retry_s: float = 1.0,
        max_late: int = 3,
    ) -> None:
        self.socket_path = str(socket_path)
        self.max_k = max_k
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.deadline_s = deadline_s
        self.retry_s = retry_s
        self.max_late = max_late  # consecutive late answers before the sidecar counts as hung
        self._late = 0
        self._buf = bytearray()  # received bytes not yet a whole frame
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._call_id = 0
        self._sent: dict[int, _Sent] = {}
        # Counters a test or benchmark can read: steps answered, steps without an answer.
        self.answered = 0
        self.missed = 0

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def propose(
        self,
        k: int,
        sampled_token_ids: list[list[int]],
        req_ids: Sequence[str],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
    ) -> list[list[int]]:
        """Up to `k` drafts for each row of the step (rows with no sampled token are a partial prefill)."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows: list[RowUpdate] = []
        sent_now: dict[int, _Sent] = {}
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill: nothing to draft for
                continue
            length = int(num_tokens_no_spec[i])
            room = min(k, self.max_k, self.max_model_len - length - 1)
            if room <= 0:
                continue
            req_id = req_ids[i]
            prev = self._sent.get(i)
            if prev is not None and prev.req_id == req_id and prev.length <= length:
                rows.append(
                    RowUpdate(i, RowOp.APPEND, room, prev.length, token_ids_cpu[i, prev.length : length])
                )
            else:
                rows.append(RowUpdate(i, RowOp.RESET, room, 0, token_ids_cpu[i, :length]))
            sent_now[i] = _Sent(req_id, length)
        if not rows or not self._connect():
            return drafts
        self._call_id = (self._call_id + 1) & 0xFFFFFFFF
        request = DraftRequest(self._call_id, len(sampled_token_ids), rows)
        t0 = time.perf_counter()
        try:
            self._send(request, t0 + self.deadline_s)
            # Sent whole: the sidecar applies every request in order, answered in time or not.
            self._sent.update(sent_now)
            answers = self._receive(request, t0 + self.deadline_s)
        except TimeoutError:
            self.missed += 1
            self._late += 1
            if self._late >= self.max_late:
                self._drop(
                    f"{self._late} draft calls in a row missed the {self.deadline_s * 1000:.0f} ms deadline"
                )
            return drafts  # a late answer is read and dropped by the next call (call_id)
        except (OSError, ConnectionError, ProtocolError) as exc:
            self._drop(f"no drafts this step: {exc!r}")
            self.missed += 1
            return drafts
        self._late = 0
        self.answered += 1
        for update, answer in zip(rows, answers, strict=True):
            if answer.status != RowStatus.OK:
                self._sent.pop(update.row, None)
                continue
            drafts[update.row] = self._valid_prefix(answer.drafts, update.max_k)
        return drafts

    def _valid_prefix(self, tokens: list[int], limit: int) -> list[int]:
        out = []
        for t in tokens[:limit]:
            if not 0 <= t < self.vocab_size:
                break
            out.append(t)
        return out

    def _send(self, request: DraftRequest, deadline: float) -> None:
        sock = self._sock
        assert sock is not None
        frame = encode_request(request)
        sock.settimeout(max(deadline - time.perf_counter(), 1e-4))
        try:
            sock.sendall(frame)
        except TimeoutError as exc:  # part of a frame may be out: the stream cannot be resumed
            raise ConnectionError("send timed out") from exc

    def _receive(self, request: DraftRequest, deadline: float) -> list[Any]:
        while True:
            response = decode_response(self._read_frame(deadline))
            if response.call_id != request.call_id:
                continue  # the late answer to an earlier call: its step has passed
            if len(response.answers) != len(request.rows):
                raise ProtocolError(f"{len(response.answers)} answers for {len(request.rows)} rows")
            return response.answers

    def _read_frame(self, deadline: float) -> bytes:
        """One frame's body; on TimeoutError the bytes read so far stay buffered for the next call."""
        sock = self._sock
        assert sock is not None
        buf = self._buf
        while True:
            if len(buf) >= 4:
                (n,) = struct.unpack_from("<I", buf)
                if n > MAX_FRAME_BYTES:
                    raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
                if len(buf) >= 4 + n:
                    body = bytes(buf[4 : 4 + n])
                    del buf[: 4 + n]
                    return body
            sock.settimeout(max(deadline - time.perf_counter(), 1e-4))
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("sidecar closed the socket")
            buf += chunk

    def _connect(self) -> bool:
        if self._sock is not None:
            return True
        now = time.monotonic()
        if now < self._next_connect:
            return False
        self._next_connect = now + self.retry_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.deadline_s)
        try:
            sock.connect(socket_address(self.socket_path))
        except OSError:
            sock.close()
            return False
        self._sock = sock
        self._buf.clear()
        self._sent.clear()  # the sidecar's tables are per connection: resend every row in full
        log.info("specserve proposer connected to the sidecar at %s", self.socket_path)
        return True

    def _drop(self, why: str) -> None:
        if self._sock is not None:
            log.warning("specserve proposer: %s; reconnecting in %.1f s", why, self.retry_s)
            self._sock.close()
        self._sock = None
        self._sent.clear()
        self._late = 0
        self._buf.clear()
        self._next_connect = time.monotonic() + self.retry_s

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None


def socket_path_from_env() -> Path:
    return Path(os.environ.get(RUNTIME_DIR_ENV, "/run/specserve")) / SOCKET_NAME


class SidecarProposer:
    """vLLM custom_class proposer (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        model = vllm_config.model_config
        deadline_ms = float(os.environ.get(DEADLINE_ENV, DEFAULT_DEADLINE_MS))
        self.client = DraftClient(
            socket_path_from_env(),
            max_k=int(spec.num_speculative_tokens),
            max_model_len=int(model.max_model_len),
            vocab_size=int(model.get_vocab_size()),
            deadline_s=deadline_ms / 1000,
        )

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load in the engine: the sidecar hosts the drafters."""

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's custom_class entry, which carries neither K nor request ids: specserve's model runner
        calls `propose_rows` instead (engine_args.py always starts this proposer with it)."""
        raise RuntimeError(
            "SidecarProposer needs specserve's model runner: start the engine with "
            "--worker-cls specserve_engine.vllm_plugins.plain_step.PlainStepWorker"
        )

    def propose_rows(
        self,
        k: int,
        sampled_token_ids: list[list[int]],
        req_ids: Sequence[str],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
    ) -> list[list[int]]:
        return self.client.propose(k, sampled_token_ids, req_ids, num_tokens_no_spec, token_ids_cpu)
