"""The speculative engine sidecar: `specserve-sidecar --config FILE` (a SidecarConfig JSON file).

Two servers in one process:

- the draft socket (`drafts.sock` in the runtime dir, draft_protocol.py): one thread per engine
  connection answers each engine step with up to K drafts per sequence from the drafter in force;
- the control API (DESIGN §6, aiohttp): the operator's only way into the pod.

The policy in force is one immutable `InForce` object; the draft threads read it once per call and the
control API replaces it whole, so a switch (drafter, K table, on/off) lands between two draft calls. A
drafter not yet loaded is loaded and warmed in a background thread (202), then switched to if its policy
is still the newest. Every applied policy is also written to `policy.json`, which the engine's
live-policy plugin reads to apply K per bucket to a colocated drafter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import ValidationError

from specserve_engine import metric_names as mn
from specserve_engine.api import (
    ApiError,
    DrafterState,
    DrafterStatus,
    PolicyRequest,
    SidecarConfig,
    SidecarDrafter,
    SidecarState,
    validate_k_table,
)
from specserve_engine.buckets import bucket_labels
from specserve_engine.draft_protocol import (
    SOCKET_NAME,
    DraftResponse,
    ProtocolError,
    RowAnswer,
    RowOp,
    RowStatus,
    RowUpdate,
    decode_request,
    encode_response,
    recv_frame,
    socket_address,
)
from specserve_engine.drafters import Drafter, DrafterError, Seq, build_drafter
from specserve_engine.policy_file import PodPolicy, write_policy
from specserve_engine.processes import GroupProcess

log = logging.getLogger("specserve.sidecar")

MAX_BODY_BYTES = 64 * 1024
WARMUP_PROMPT_TOKENS = 48
WARMUP_STEPS = 4
ENGINE_POLL_S = 5.0
WARMUP_CONNECTION = -1  # the key space of synthetic warm-up sequences
DEVICE_ENV = "SPECSERVE_DRAFTER_DEVICE"
LIGHT_METHODS = ("ngram", "suffix")  # no weights: loaded at start-up


class PolicyRefused(Exception):
    """A control call that cannot be applied: the HTTP status and the ApiError body."""

    def __init__(self, status: int, error: str, field: str | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.body = ApiError(error=error, field=field)


@dataclass(frozen=True)
class InForce:
    """The policy in force and the sidecar drafter that serves it (None: a colocated drafter, or none)."""

    request: PolicyRequest
    drafter: Drafter | None
    bounds: tuple[int, ...]

    def k_for_batch(self, batch_size: int) -> int:
        return self.pod_policy().k_for_batch(batch_size)

    def pod_policy(self) -> PodPolicy:
        r = self.request
        return PodPolicy(r.policy_version, r.drafter, r.mode, dict(r.k_by_bucket), self.bounds)


def same_policy(a: PolicyRequest, b: PolicyRequest) -> bool:
    return (a.drafter, a.mode, a.k_by_bucket) == (b.drafter, b.mode, b.k_by_bucket)


def change_kinds(old: PolicyRequest, new: PolicyRequest) -> list[str]:
    kinds = []
    if old.drafter != new.drafter:
        kinds.append("drafter")
    if old.k_by_bucket != new.k_by_bucket:
        kinds.append("k")
    if old.mode != new.mode:
        kinds.append("mode")
    return kinds


class SidecarMetrics:
    def __init__(self, bucket_bounds: list[int]) -> None:
        self.registry = CollectorRegistry()
        m = mn.SIDECAR_POLICY_INFO
        self.policy_info = Gauge(m.name, m.help, m.labels, registry=self.registry)
        m = mn.SIDECAR_K
        self.k = Gauge(m.name, m.help, m.labels, registry=self.registry)
        m = mn.SIDECAR_SWITCHES
        self.switches = Counter(m.name, m.help, m.labels, registry=self.registry)
        m = mn.SIDECAR_DRAFT_SECONDS
        self.draft_seconds = Histogram(
            m.name,
            m.help,
            m.labels,
            registry=self.registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.labels = bucket_labels(bucket_bounds)

    def show(self, policy: PolicyRequest) -> None:
        self.policy_info.clear()
        self.policy_info.labels(policy.drafter, policy.mode, str(policy.policy_version)).set(1)
        for label in self.labels:
            self.k.labels(label).set(policy.k_for_bucket(label))


class SidecarService:
    """The sidecar's state and every decision about it, without HTTP (tested directly)."""

    def __init__(self, config: SidecarConfig, device: str | None = None) -> None:
        self.config = config
        self.bounds = tuple(config.bucket_bounds)
        self.metrics = SidecarMetrics(config.bucket_bounds)
        self.specs: dict[str, SidecarDrafter] = {}
        self.drafters: dict[str, Drafter] = {}
        self.status: dict[str, tuple[DrafterStatus, str | None]] = {}  # name -> (status, error)
        for spec in config.drafters:
            if spec.placement == "colocated":
                if spec.name == config.engine_drafter:  # only the engine's own drafter switches live
                    self.specs[spec.name] = spec
                    self.status[spec.name] = ("loaded", None)
                continue
            if config.engine_drafter is not None:
                continue  # the engine runs a colocated drafter: it never calls the sidecar for drafts
            self.specs[spec.name] = spec
            try:
                self.drafters[spec.name] = build_drafter(spec, config.model_path, device or drafter_device())
                self.status[spec.name] = ("available", None)
            except DrafterError as exc:
                self.status[spec.name] = ("failed", str(exc))
        self.vocab_size = _vocab_size(config.model_path)
        self.draft_lock = threading.Lock()  # drafters keep per-sequence state: one draft call at a time
        self.warm = False
        self.engine_reachable = False
        self.pending: PolicyRequest | None = None
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._apply_lock = asyncio.Lock()
        self.check(config.initial_policy)
        self.in_force = InForce(config.initial_policy, None, self.bounds)  # no drafts until start()

    # --- the control API's decisions ---------------------------------------------------------------
    def check(self, req: PolicyRequest) -> None:
        """Refuse (422) a policy that names no switchable drafter or a K table the drafter cannot take."""
        spec = self.specs.get(req.drafter)
        if spec is None:
            known = ", ".join(sorted(self.specs)) or "none"
            raise PolicyRefused(
                422,
                f"drafter {req.drafter!r} cannot be switched to live in this pod (live drafters: {known}); "
                "another colocated drafter needs a rolling restart",
                "drafter",
            )
        why = validate_k_table(req.k_by_bucket, list(self.bounds), spec.max_speculative_tokens)
        if why is not None:
            raise PolicyRefused(422, why, "kByBucket")
        if spec.placement != "colocated" and req.drafter not in self.drafters:
            raise PolicyRefused(
                422, f"drafter {req.drafter!r} cannot be built: {self.status[req.drafter][1]}", "drafter"
            )

    async def put_policy(self, req: PolicyRequest) -> int:
        """Apply (200) or schedule (202) a policy; raises PolicyRefused with nothing changed."""
        async with self._apply_lock:
            kinds = change_kinds(self.in_force.request, req)
            try:
                status = await self._put(req)
            except PolicyRefused:
                for kind in kinds or ["drafter"]:
                    self.metrics.switches.labels(kind, "refused").inc()
                raise
            return status

    async def _put(self, req: PolicyRequest) -> int:
        cur = self.in_force.request
        if req.policy_version < cur.policy_version:
            raise PolicyRefused(
                409,
                f"policyVersion {req.policy_version} is older than the one in force ({cur.policy_version})",
                "policyVersion",
            )
        if req.policy_version == cur.policy_version:
            if same_policy(req, cur):
                return 200  # idempotent repeat
            raise PolicyRefused(
                409,
                f"policyVersion {req.policy_version} is already in force with other content",
                "policyVersion",
            )
        pending = self.pending
        if pending is not None and req.policy_version <= pending.policy_version:
            if req.policy_version == pending.policy_version and same_policy(req, pending):
                return 202
            raise PolicyRefused(
                409,
                f"policyVersion {req.policy_version} is not newer than the pending version "
                f"{pending.policy_version}",
                "policyVersion",
            )
        self.check(req)
        state, _ = self.status[req.drafter]
        if state == "loaded":
            self.pending = None
            self._apply(req)
            return 200
        self.pending = req
        if req.drafter not in self._loads:
            self.status[req.drafter] = ("loading", None)
            self._loads[req.drafter] = asyncio.create_task(self._load_then_apply(req.drafter))
        return 202

    def _apply(self, req: PolicyRequest) -> None:
        old = self.in_force.request
        new = InForce(req, self.drafters.get(req.drafter), self.bounds)
        try:
            write_policy(new.pod_policy(), self.config.runtime_dir)
        except OSError as exc:
            raise PolicyRefused(500, f"cannot write the policy file: {exc}") from exc
        self.in_force = new  # the switch: draft threads read this reference once per call
        self.metrics.show(req)
        for kind in change_kinds(old, req):
            self.metrics.switches.labels(kind, "applied").inc()
        log.info(
            "policy %d in force: drafter=%s mode=%s K=%s",
            req.policy_version,
            req.drafter,
            req.mode,
            req.k_by_bucket,
        )

    async def _load_then_apply(self, name: str) -> None:
        try:
            await self.load(name)
        finally:
            self._loads.pop(name, None)
        async with self._apply_lock:
            pending = self.pending
            if pending is None or pending.drafter != name:
                return
            self.pending = None
            if self.status[name][0] != "loaded":
                self.metrics.switches.labels("drafter", "failed").inc()
                return
            try:
                self._apply(pending)
            except PolicyRefused as exc:
                log.error("pending policy %d not applied: %s", pending.policy_version, exc)
                self.metrics.switches.labels("drafter", "failed").inc()

    async def load(self, name: str) -> None:
        """Load and warm a drafter in a worker thread; the drafters in force keep serving meanwhile."""
        drafter = self.drafters.get(name)
        if drafter is None:
            return
        self.status[name] = ("loading", None)
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._load_and_warm, drafter)
        except Exception as exc:  # a bad checkpoint must not take the sidecar down
            log.exception("drafter %s failed to load", name)
            self.status[name] = ("failed", f"{type(exc).__name__}: {exc}")
            return
        self.status[name] = ("loaded", None)
        log.info("drafter %s loaded and warmed in %.2f s", name, time.perf_counter() - t0)

    def _load_and_warm(self, drafter: Drafter) -> None:
        drafter.load()
        rng = np.random.default_rng(0)
        n = max(1, self.config.warmup_requests)
        for i in range(n):
            tokens = rng.integers(0, self.vocab_size, WARMUP_PROMPT_TOKENS, dtype=np.int32)
            tokens = np.concatenate([tokens, tokens[: WARMUP_PROMPT_TOKENS // 2]])  # something to look up
            for step in range(WARMUP_STEPS):
                seq = Seq((WARMUP_CONNECTION, i), 0, tokens[: len(tokens) - WARMUP_STEPS + step + 1])
                with self.draft_lock:
                    drafter.draft([seq], [drafter.max_k])
        with self.draft_lock:
            drafter.forget(WARMUP_CONNECTION)

    async def start(self) -> None:
        """Load and warm the initial drafter, put the initial policy in force, then report ready.
        The weightless drafters are loaded too; model drafters load when a policy first names them."""
        initial = self.config.initial_policy
        if self.status[initial.drafter][0] != "loaded":
            await self.load(initial.drafter)
            if self.status[initial.drafter][0] != "loaded":
                raise DrafterError(f"initial drafter {initial.drafter}: {self.status[initial.drafter][1]}")
        self._apply(initial)
        for name, drafter in self.drafters.items():
            if self.status[name][0] == "available" and drafter.method in LIGHT_METHODS:
                await self.load(name)
        self.warm = True

    def state(self) -> SidecarState:
        r = self.in_force.request
        drafters = []
        for name, spec in self.specs.items():
            status, error = self.status[name]
            drafters.append(
                DrafterState(
                    name=name,
                    method=spec.method,
                    placement=spec.placement,
                    max_speculative_tokens=spec.max_speculative_tokens,
                    status=status,
                    error=error,
                )
            )
        return SidecarState(
            policy_version=r.policy_version,
            drafter=r.drafter,
            mode=r.mode,
            k_by_bucket=dict(r.k_by_bucket),
            drafters=drafters,
            pending_drafter=self.pending.drafter if self.pending else None,
            warm=self.warm,
            engine_reachable=self.engine_reachable,
        )

    # --- the draft socket's work --------------------------------------------------------------------
    def answer(self, table: SequenceTable, rows: list[RowUpdate], batch_size: int) -> list[RowAnswer]:
        force = self.in_force  # read once: the whole call sees one policy
        drafter = force.drafter
        k = force.k_for_batch(batch_size) if drafter is not None else 0
        answers = [RowAnswer(RowStatus.OK, []) for _ in rows]
        seqs: list[Seq] = []
        ks: list[int] = []
        where: list[int] = []
        for i, row in enumerate(rows):
            seq = table.update(row)
            if seq is None:
                answers[i] = RowAnswer(RowStatus.RESYNC, [])
                continue
            row_k = min(k, row.max_k)
            if drafter is not None and row_k > 0:
                seqs.append(seq)
                ks.append(min(row_k, drafter.max_k))
                where.append(i)
        if not seqs:
            return answers
        assert drafter is not None
        t0 = time.perf_counter()
        try:
            with self.draft_lock:
                drafts = drafter.draft(seqs, ks)
        except Exception:  # a drafter bug costs this step's drafts, never the engine's requests
            log.exception("drafter %s failed on a draft call", drafter.name)
            return answers
        finally:
            self.metrics.draft_seconds.labels(drafter.name).observe(time.perf_counter() - t0)
        for i, d, kk in zip(where, drafts, ks, strict=True):
            answers[i] = RowAnswer(RowStatus.OK, [int(t) for t in d[:kk]])
        return answers

    def forget(self, connection: int) -> None:
        with self.draft_lock:
            for drafter in self.drafters.values():
                if self.status[drafter.name][0] == "loaded":
                    drafter.forget(connection)


def drafter_device() -> str:
    """Where model drafters run: SPECSERVE_DRAFTER_DEVICE, else the container's GPU, else the CPU. With
    placement separateGpu the pod gives the sidecar container a GPU of its own, seen here as cuda:0."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


def _vocab_size(model_path: str) -> int:
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 1000  # only sizes the synthetic warm-up prompts


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


# --- the control API -------------------------------------------------------------------------------
def _error(status: int, error: str, field: str | None = None) -> web.Response:
    return web.json_response(ApiError(error=error, field=field).model_dump(exclude_none=True), status=status)


def _state_response(service: SidecarService, status: int = 200) -> web.Response:
    return web.json_response(service.state().model_dump(by_alias=True), status=status)


def read_token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"tokenFile {token_file} is empty")
    return token


def build_app(service: SidecarService, token: str | None) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/") and token is not None:
            given = request.headers.get("Authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
                return _error(401, "missing or wrong bearer token", "Authorization")
        return await handler(request)

    async def get_state(request: web.Request) -> web.Response:
        return _state_response(service)

    async def put_policy(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _error(413, f"body of {request.content_length} bytes exceeds {MAX_BODY_BYTES}")
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            return _error(413, f"body exceeds {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"malformed JSON: {exc}")
        try:
            req = PolicyRequest.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            return _error(422, f"{where or 'body'}: {first['msg']}", where)
        try:
            status = await service.put_policy(req)
        except PolicyRefused as exc:
            return web.json_response(exc.body.model_dump(exclude_none=True), status=exc.status)
        return _state_response(service, status)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if not service.warm:
            return _error(503, "warming up")
        return web.json_response({"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/v1/state", get_state)
    app.router.add_put("/v1/policy", put_policy)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def watch_engine(service: SidecarService, url: str) -> None:
    """Keep `engineReachable` current from the engine's /health."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            try:
                async with session.get(url.rstrip("/") + "/health") as resp:
                    service.engine_reachable = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                service.engine_reachable = False
            await asyncio.sleep(ENGINE_POLL_S)


async def serve(config: SidecarConfig, stop: asyncio.Event | None = None) -> None:
    token = read_token(config.token_file)
    if token is None:
        log.warning("no tokenFile: the control API accepts unauthenticated calls")
    service = SidecarService(config)
    sockets = DraftSocketServer(service, Path(config.runtime_dir) / SOCKET_NAME)
    sockets.start()
    runner = web.AppRunner(build_app(service, token), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("control API on http://%s:%d", config.host, config.port)
    watcher = asyncio.create_task(watch_engine(service, config.engine_url))
    try:
        await service.start()
        gc.freeze()  # long-lived objects (weights, modules) leave the collector's scans: steadier draft calls
        log.info("sidecar ready")
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        watcher.cancel()
        sockets.stop()
        await runner.cleanup()


# --- a sidecar as a child process (the tests, the benchmark, the local fleet) ---------------------
@dataclass
class SidecarProcess:
    config: SidecarConfig
    group: GroupProcess  # the sidecar leads its own process group and dies with its parent

    @property
    def log_path(self) -> Path:
        return self.group.log_path

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self.group.popen is not None, "start_sidecar starts the group before handing it out"
        return self.group.popen

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return f"http://{host}:{self.config.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until /readyz answers 200 (the initial drafter is loaded and warm)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"sidecar exited with {self.process.returncode}; log tail:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sidecar not ready at {self.url} after {timeout_s:.0f} s; log {self.log_path}")

    def kill(self) -> None:
        """SIGKILL: the sidecar dies without closing anything (the socket file stays behind)."""
        self.group.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, SIGKILL after `timeout_s`; nothing of the sidecar's group is left when this returns."""
        self.group.stop(grace_s=timeout_s)


def start_sidecar(config: SidecarConfig, workdir: str | os.PathLike[str]) -> SidecarProcess:
    """Write the config to `workdir` and start `specserve-sidecar` on it (does not wait for ready)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "sidecar.json"
    config_path.write_text(config.model_dump_json(by_alias=True))
    group = GroupProcess(
        "sidecar",
        [sys.executable, "-m", "specserve_engine.server", "--config", str(config_path)],
        workdir / "sidecar.log",
    )
    group.start()
    return SidecarProcess(config, group)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve-sidecar", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="SidecarConfig JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Small drafters are latency-bound: one intra-op thread avoids thread hand-offs on every tiny op.
    torch.set_num_threads(int(os.environ.get("SPECSERVE_SIDECAR_THREADS", "1")))
    try:
        config = SidecarConfig.model_validate_json(Path(args.config).read_text())
        asyncio.run(serve(config))
    except (OSError, ValidationError, ValueError, DrafterError) as exc:
        raise SystemExit(f"specserve-sidecar: {exc}") from exc
    except PolicyRefused as exc:
        raise SystemExit(f"specserve-sidecar: initialPolicy: {exc}") from exc


if __name__ == "__main__":
    main()
