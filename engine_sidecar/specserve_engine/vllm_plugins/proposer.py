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

A request frame stays within the protocol's limits (draft_protocol.py): rows whose tokens would overflow
`MAX_FRAME_TOKENS` wait for the next step. A connection unused for a while (the sidecar closes idle ones)
is checked before use and reopened at once if the sidecar closed it.

Every step with rows to draft counts as answered, missed (late, or an error) or skipped (no connection)
in `CallCounts`: a few bytes of shared memory in the runtime dir that the engine's metrics endpoint, in
another process, exports as `specserve_proposer_calls_total{outcome}` (`ProposerCallsCollector`,
registered by stat_logger.py). Counting a step is one memory write.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from specserve_engine import metric_names
from specserve_engine.draft_protocol import (
    DEADLINE_ENV,
    DEFAULT_DEADLINE_MS,
    MAX_FRAME_BYTES,
    MAX_FRAME_TOKENS,
    MAX_ROWS,
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

OUTCOMES = ("answered", "missed", "skipped")
ANSWERED, MISSED, SKIPPED = range(len(OUTCOMES))
CALL_COUNTS_GLOB = "proposer-calls-*.bin"  # one file per engine process that proposes
IDLE_CHECK_S = 1.0  # a connection unused this long is checked before use


class CallCounts:
    """The proposer's step outcomes (OUTCOMES), as native u64s in a file mapped into memory, or in
    process memory when there is no file."""

    def __init__(self, path: Path | None = None) -> None:
        size = 8 * len(OUTCOMES)
        buf: mmap.mmap | bytearray = bytearray(size)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "w+b") as f:  # a new process counts from zero (a counter reset)
                    f.truncate(size)
                    buf = mmap.mmap(f.fileno(), size)
            except OSError as exc:
                log.warning("specserve proposer: counts not exported, cannot map %s: %s", path, exc)
        self.values = memoryview(buf).cast("Q")

    def add(self, outcome: int) -> None:
        self.values[outcome] += 1


def read_call_counts(runtime_dir: Path) -> dict[str, int] | None:
    """The step outcomes of every proposer process that shared this runtime dir, summed; None if none."""
    totals = dict.fromkeys(OUTCOMES, 0)
    found = False
    for name in glob.glob(str(runtime_dir / CALL_COUNTS_GLOB)):
        try:
            raw = Path(name).read_bytes()
        except OSError:
            continue
        if len(raw) != 8 * len(OUTCOMES):
            continue
        found = True
        for outcome, value in zip(OUTCOMES, memoryview(raw).cast("Q"), strict=True):
            totals[outcome] += value
    return totals if found else None


class ProposerCallsCollector(Collector):
    """Exports the proposers' step outcomes, read from the runtime dir at each scrape."""

    def __init__(self, runtime_dir: Path, model: str) -> None:
        self.runtime_dir = runtime_dir
        self.model = model

    def collect(self) -> Any:
        counts = read_call_counts(self.runtime_dir)
        if counts is None:
            return
        m = metric_names.PROPOSER_CALLS
        family = CounterMetricFamily(m.name, m.help, labels=m.labels)
        for outcome, value in counts.items():
            family.add_metric([self.model, outcome], value)
        yield family

    def describe(self) -> Any:
        return []  # nothing to check at registration: the files come and go with the engine's workers


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
        counts: CallCounts | None = None,
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
        self._last_used = 0.0
        self.counts = counts if counts is not None else CallCounts()

    @property
    def answered(self) -> int:
        return int(self.counts.values[ANSWERED])

    @property
    def missed(self) -> int:
        return int(self.counts.values[MISSED])

    @property
    def skipped(self) -> int:
        return int(self.counts.values[SKIPPED])

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
        self._check_idle()  # before the rows: a reconnect resends them whole
        rows: list[RowUpdate] = []
        sent_now: dict[int, _Sent] = {}
        budget = MAX_FRAME_TOKENS
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill: nothing to draft for
                continue
            length = int(num_tokens_no_spec[i])
            room = min(k, self.max_k, self.max_model_len - length - 1)
            if room <= 0:
                continue
            req_id = req_ids[i]
            prev = self._sent.get(i)
            append = prev is not None and prev.req_id == req_id and prev.length <= length
            start = prev.length if append and prev is not None else 0
            if length - start > budget or len(rows) == MAX_ROWS:
                continue  # over the frame's limits: this row goes with a later step
            budget -= length - start
            op = RowOp.APPEND if append else RowOp.RESET
            rows.append(RowUpdate(i, op, room, start, token_ids_cpu[i, start:length]))
            sent_now[i] = _Sent(req_id, length)
        if not rows:
            return drafts
        if not self._connect():
            self.counts.add(SKIPPED)
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
            self.counts.add(MISSED)
            self._late += 1
            if self._late >= self.max_late:
                self._drop(
                    f"{self._late} draft calls in a row missed the {self.deadline_s * 1000:.0f} ms deadline"
                )
            return drafts  # a late answer is read and dropped by the next call (call_id)
        except (OSError, ConnectionError, ProtocolError) as exc:
            self._drop(f"no drafts this step: {exc!r}")
            self.counts.add(MISSED)
            return drafts
        self._late = 0
        self.counts.add(ANSWERED)
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

    def _check_idle(self) -> None:
        """Forget a connection the sidecar closed while it was idle (a clean close: reopened at once)."""
        now = time.monotonic()
        if self._sock is not None and now - self._last_used > IDLE_CHECK_S and self._peer_closed():
            self._sock.close()
            self._sock = None
            self._sent.clear()
            self._buf.clear()
            self._late = 0
            self._next_connect = now  # not a failure: no retry delay
        self._last_used = now

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

    def _peer_closed(self) -> bool:
        sock = self._sock
        assert sock is not None
        sock.setblocking(False)  # with a timeout set, recv would first wait up to it; each call sets its own
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False  # open, nothing to read
        except OSError:
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


def call_counts_path(runtime_dir: Path) -> Path:
    return runtime_dir / CALL_COUNTS_GLOB.replace("*", str(os.getpid()))


class SidecarProposer:
    """vLLM custom_class proposer (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        model = vllm_config.model_config
        deadline_ms = float(os.environ.get(DEADLINE_ENV, DEFAULT_DEADLINE_MS))
        socket_path = socket_path_from_env()
        self.client = DraftClient(
            socket_path,
            max_k=int(spec.num_speculative_tokens),
            max_model_len=int(model.max_model_len),
            vocab_size=int(model.get_vocab_size()),
            deadline_s=deadline_ms / 1000,
            counts=CallCounts(call_counts_path(socket_path.parent)),
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
