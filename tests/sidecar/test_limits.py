"""The sidecar's limits against hostile or broken peers (docs/sidecar.md, "Limits"): half-sent HTTP
requests and too many connections on the control API, bodies that break the parser or the schema,
headers that are not text; frame lengths, idle connections, too many connections and drafters that
answer the wrong shape on the draft socket. Each holds the sidecar to a bounded cost and a 4xx or a
closed connection, never a 500 or a dead thread."""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from specserve_engine import control_api
from specserve_engine.api import PolicyRequest, SidecarConfig
from specserve_engine.client import SidecarClient
from specserve_engine.control_api import build_app
from specserve_engine.draft_protocol import MAX_FRAME_BYTES, RowOp, RowUpdate
from specserve_engine.draft_socket import DraftSocketServer
from specserve_engine.policy_file import policy_path
from specserve_engine.sidecar_service import SidecarService
from specserve_engine.vllm_plugins import proposer
from specserve_testing.inprocess_sidecar import RunningSidecar
from specserve_testing.proposer_inputs import REPEAT, Batch, client_for

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# --- control API: connections -------------------------------------------------------------------------


def _open_half_sent(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"PUT /v1/policy HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n")
        socks.append(s)
    return socks


def _seconds_until_closed(socks: list[socket.socket], limit_s: float) -> list[float]:
    """For each socket, the seconds until the server closed it (inf if it did not within limit_s)."""
    t0 = time.monotonic()
    closed_at = {s: float("inf") for s in socks}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        while sel.get_map() and time.monotonic() - t0 < limit_s:
            for key, _ in sel.select(timeout=0.05):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(4096)
                except ConnectionError:
                    data = b""
                if not data:
                    closed_at[s] = time.monotonic() - t0
                    sel.unregister(s)
    for s in socks:
        s.close()
    return [closed_at[s] for s in socks]


async def test_half_sent_requests_are_closed_within_the_header_timeout(
    start_sidecar: Callable[..., Awaitable[RunningSidecar]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_api, "HEADER_TIMEOUT_S", 1.0, raising=False)
    sidecar = await start_sidecar()
    socks = await asyncio.to_thread(_open_half_sent, sidecar.port, 300)
    closed = await asyncio.to_thread(_seconds_until_closed, socks, 5.0)
    assert max(closed) < 1.0 + 1.0, sorted(closed)[-5:]  # every one closed within the timeout (+ slack)
    # Over the connection cap the rest are closed on accept, not after the timeout.
    assert sum(t < 0.5 for t in closed) >= 300 - control_api.MAX_CONNECTIONS
    async with aiohttp.ClientSession() as session, session.get(sidecar.url + "/healthz") as resp:
        assert resp.status == 200  # and the API still serves


async def test_a_half_sent_body_gets_408(
    start_sidecar: Callable[..., Awaitable[RunningSidecar]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_api, "BODY_TIMEOUT_S", 0.5, raising=False)
    sidecar = await start_sidecar()
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    writer.write(b'PUT /v1/policy HTTP/1.1\r\nHost: s\r\nContent-Length: 100\r\n\r\n{"policyVersion"')
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 3.0)
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    writer.close()


# --- control API: bodies and headers ------------------------------------------------------------------


@pytest.fixture
async def api(service: SidecarService) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(build_app(service, TOKEN))) as client:
        yield client


async def _raw_request(api: TestClient, head: bytes) -> int:
    port = api.server.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 5.0)
    writer.close()
    return int(status_line.split()[1])


@pytest.mark.parametrize(
    "authorization",
    [
        b"Bearer \xff\xfe\xfd",
        b"Bearer s3cret-t\xc3\xb6ken",
        b"\xc3\xa9",
        b"Bearer s3cret-token\x80",
    ],
    ids=["not UTF-8", "non-ASCII", "no scheme", "token plus a stray byte"],
)
async def test_an_authorization_header_that_is_not_ascii_gets_401(
    api: TestClient, service: SidecarService, authorization: bytes
) -> None:
    before = service.state()
    head = b"GET /v1/state HTTP/1.1\r\nHost: s\r\nAuthorization: " + authorization + b"\r\n\r\n"
    assert await _raw_request(api, head) == 401
    body = json.dumps(_body(5)).encode()
    put = (
        b"PUT /v1/policy HTTP/1.1\r\nHost: s\r\nAuthorization: "
        + authorization
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    assert await _raw_request(api, put) == 401
    assert service.state() == before


def _body(version: int, **over: Any) -> dict[str, Any]:
    return {"policyVersion": version, "drafter": "ngram", "mode": "on", "kByBucket": {"1": 2}} | over


NOT_STRICT: list[tuple[str, Any, str]] = [
    ("version as a string", _body(5, policyVersion="5"), "policyVersion"),
    ("version as a float", _body(5, policyVersion=5.0), "policyVersion"),
    ("version as a bool", _body(5, policyVersion=True), "policyVersion"),
    ("K as a bool", _body(5, kByBucket={"1": True}), "kByBucket.1"),
    ("K as a float", _body(5, kByBucket={"1": 2.0}), "kByBucket.1"),
    ("K as a string", _body(5, kByBucket={"1": "2"}), "kByBucket.1"),
    ("drafter as a number", _body(5, drafter=7), "drafter"),
]


@pytest.mark.parametrize(("why", "data", "field"), NOT_STRICT, ids=[c[0] for c in NOT_STRICT])
async def test_the_policy_request_is_strict(
    api: TestClient, config: SidecarConfig, why: str, data: Any, field: str
) -> None:
    before = policy_path(config.runtime_dir).read_text()
    resp = await api.put("/v1/policy", data=json.dumps(data), headers=AUTH)
    err = await resp.json()
    assert (resp.status, err.get("field")) == (422, field), (why, err)
    assert policy_path(config.runtime_dir).read_text() == before


@pytest.mark.parametrize(
    "raw",
    [b"[" * 30_000 + b"]" * 30_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000],
    ids=["deep array", "deep object"],
)
async def test_deeply_nested_json_gets_400(api: TestClient, service: SidecarService, raw: bytes) -> None:
    before = service.state()
    resp = await api.put("/v1/policy", data=raw, headers=AUTH)
    assert resp.status == 400, await resp.text()
    assert service.state() == before


async def test_the_operators_client_still_gets_its_policies_through(
    api: TestClient, make_policy: Callable[..., PolicyRequest]
) -> None:
    async with aiohttp.ClientSession() as session:
        client = SidecarClient(str(api.make_url("")), TOKEN, session)
        status, state = await client.put_policy(make_policy(2, "suffix", 3))
    assert (status, state.policy_version, state.drafter) == (200, 2, "suffix")


# --- draft socket -------------------------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def test_a_frame_over_the_limit_is_refused_unread(draft_socket: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(draft_socket))
        s.sendall(struct.pack("<I", 64 * 1024 * 1024))
        assert _closed_within(s, 2.0)
    assert MAX_FRAME_BYTES < 17 * 1024 * 1024  # derived from MAX_ROWS and MAX_FRAME_TOKENS


async def test_a_length_prefix_alone_allocates_nothing(draft_socket: Path) -> None:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(draft_socket))
            s.sendall(struct.pack("<I", MAX_FRAME_BYTES) + b"\0" * 1000)  # allowed length, no body yet
            await asyncio.sleep(0.3)
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < 2 * 1024 * 1024, f"{(peak - base) / 2**20:.1f} MiB for a bare length prefix"


async def test_idle_connections_are_closed_and_the_proposer_reconnects_at_once(
    service: SidecarService, config: SidecarConfig
) -> None:
    server = DraftSocketServer(service, Path(config.runtime_dir) / "idle.sock", idle_timeout_s=0.3)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.connect(str(server.path))
            t0 = time.monotonic()
            assert _closed_within(idle, 3.0)
            assert time.monotonic() - t0 < 1.5
        batch = Batch()
        batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
        client = client_for(server.path, retry_s=5.0)
        assert batch.propose(client, 1) == [[6, 7, 8, 9]]
        await asyncio.sleep(1.3)  # the sidecar closes the idle connection meanwhile
        batch.extend(0, [6])
        assert batch.propose(client, 1) == [[7, 8, 9, 10]]  # no step lost to the closed connection
        assert (client.answered, client.missed) == (2, 0)
        client.close()
    finally:
        server.stop()


async def test_a_connection_idle_for_a_while_but_open_is_kept(
    draft_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[list[RowUpdate]] = []
    encode = proposer.encode_request
    monkeypatch.setattr(proposer, "encode_request", lambda req: (sent.append(req.rows), encode(req))[1])
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket, deadline_s=0.5)
    assert batch.propose(client, 1) == [[6, 7, 8, 9]]
    await asyncio.sleep(proposer.IDLE_CHECK_S + 0.2)  # long enough to be checked, far below the sidecar's
    batch.extend(0, [6])
    t0 = time.perf_counter()
    assert batch.propose(client, 1) == [[7, 8, 9, 10]]
    assert time.perf_counter() - t0 < 0.1  # the check does not wait
    assert [rows[0].op for rows in sent] == [RowOp.RESET, RowOp.APPEND]  # the same connection
    client.close()


async def test_connections_over_the_limit_are_refused(service: SidecarService, config: SidecarConfig) -> None:
    server = DraftSocketServer(service, Path(config.runtime_dir) / "cap.sock", max_connections=4)
    server.start()
    threads_before = threading.active_count()
    socks = []
    try:
        for _ in range(10):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(server.path))
            socks.append(s)
        await asyncio.sleep(0.2)
        closed = [_closed_within(s, 0.2) for s in socks]
        assert closed.count(True) == 6
        assert threading.active_count() - threads_before <= 4
        for s in socks:
            s.close()
        await asyncio.sleep(0.2)
        batch = Batch()
        batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
        client = client_for(server.path)
        assert batch.propose(client, 1) == [[6, 7, 8, 9]]  # slots are freed as connections close
        client.close()
    finally:
        for s in socks:
            s.close()
        server.stop()


async def test_a_drafter_answering_the_wrong_shape_costs_drafts_not_the_connection(
    service: SidecarService, draft_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ngram = service.drafters["ngram"]
    real_draft = ngram.draft
    monkeypatch.setattr(ngram, "draft", lambda seqs, ks: real_draft(seqs, ks)[:-1])  # one list short
    batch = Batch()
    batch.set(0, [1, *REPEAT, 2, *REPEAT[:3]])
    batch.set(1, [1, *REPEAT, 2, *REPEAT[:3]])
    client = client_for(draft_socket)
    assert batch.propose(client, 2) == [[], []]
    monkeypatch.setattr(ngram, "draft", real_draft)
    batch.extend(0, [6])
    batch.extend(1, [6])
    assert batch.propose(client, 2) == [[7, 8, 9, 10], [7, 8, 9, 10]]
    assert (client.answered, client.missed, client.connected) == (2, 0, True)  # the same connection
    errors = service.metrics.registry.get_sample_value(
        "specserve_sidecar_drafter_errors_total", {"drafter": "ngram"}
    )
    assert errors == 1
    client.close()
