"""The fault-injection suite's fleet (tests/faults/): real processes, one fault at a time.

- `OperatorProcess`: the operator in a process of its own (fault_operator.py) against the kmock API server.
- `SidecarPod`: what a kubelet would run for one engine pod: a real `specserve-sidecar` started from the
  ConfigMap and Secret the operator wrote (paths made local), on a loopback address of its own at the
  sidecar port, and the Pod object (ready, with that address) in the API server.
- `FaultyPrometheus`: a real HTTP server in front of the real Prometheus that passes queries through,
  or, one fault at a time, refuses connections, hangs, or answers garbage, +Inf, negative or empty results.
- `DraftTraffic`: an engine's draft calls through the real proposer client (DraftClient) to a sidecar's
  draft socket, counting the calls that got no answer.
- `fleet_history`: engine and drafter counters for the pods, backfilled into the real Prometheus, from
  which the controller in auto mode decides to speculate.
- `LeakCheck`: child processes, threads and ports before and after a scenario.
- `Fleet`: one scenario's fleet built from the above, with the checks the scenarios share (the policy
  every pod runs against the one the resource's status says is in force, conditions, Events);
  `Scenario`: what a scenario measured, for benchmarks/results/faults.json (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import numpy as np
import psutil
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from specserve_engine import processes
from specserve_engine.api import SidecarConfig
from specserve_engine.draft_protocol import SOCKET_NAME
from specserve_engine.launch import SidecarProcess, free_port, start_sidecar
from specserve_engine.processes import GroupProcess
from specserve_engine.vllm_plugins.proposer import DraftClient
from specserve_operator.api.models import SpeculativeServingSpec
from specserve_operator.local.prometheus import PrometheusProcess
from specserve_operator.render import children as render
from specserve_operator.tuner import observations
from specserve_operator.tuner.core import ResourceView
from specserve_testing import fault_operator
from specserve_testing.engines import DRAFT, TARGET
from specserve_testing.kmock_emulator import NAMESPACE, SERVINGS, RVEmulator, pod_object
from specserve_testing.prometheus import SERIES, openmetrics

TESTS = Path(__file__).resolve().parents[1]
NAME = "llm"
MAX_K = 4
SERVINGS_PATH = f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings"
MERGE = {"Content-Type": "application/merge-patch+json"}
# Where the pod would mount each drafter's model, here: drafter name -> local copy.
LOCAL_SOURCES = {"tiny-draft": str(DRAFT)}
NGRAM = {"name": "ngram", "method": "ngram", "maxSpeculativeTokens": MAX_K, "placement": "sidecar"}
TINY_DRAFT = {
    "name": "tiny-draft",
    "method": "draftModel",
    "source": "pvc://models/tiny-draft",
    "maxSpeculativeTokens": MAX_K,
    "placement": "sidecar",
}


def resource(
    prometheus_url: str,
    *,
    name: str = NAME,
    mode: str = "auto",
    replicas: int = 2,
    drafters: list[dict] | None = None,
    gpu: str = "NVIDIA-H100",
) -> dict[str, Any]:
    """A SpeculativeServing of the tiny model, re-evaluated every second, without exploration (so every
    decision follows from the data alone) and with its own Prometheus."""
    return {
        "apiVersion": "specserve.io/v1alpha1",
        "kind": "SpeculativeServing",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas,
            "model": {"name": "tiny", "source": "pvc://models/tiny-target"},
            "engine": {"image": "engine:test", "gpu": {"count": 1, "product": gpu}},
            "drafters": drafters or [dict(NGRAM)],
            "speculation": {
                "mode": mode,
                "evaluationInterval": "1s",
                "cooldown": "5m",
                "explorationShare": 0.0,
                "warmupRequests": 1,
            },
            "monitoring": {"serviceMonitor": False, "prometheusUrl": prometheus_url},
        },
    }


# ---- the history the real Prometheus holds ---------------------------------------------------------


def _pod_rows(pod: str, drafter: str | None, prior: Any) -> list[tuple[str, dict[str, str], float]]:
    """One pod's counters over the window: plain at batch 50 and, with a drafter, speculating at batch 3
    with K 3 (conditional acceptance 0.8)."""
    base = {"namespace": NAMESPACE, "pod": pod}
    rows: list[tuple[str, dict[str, str], float]] = []
    plain = {**base, "bucket": "64", "speculating": "false"}
    steps = 3000.0
    rows += [
        (observations.STEPS, plain, steps),
        (observations.STEP_SECONDS, plain, steps * prior.step_s(50, 0)),
        (observations.TOKENS, plain, steps * 50),
    ]
    if drafter is None:
        return rows
    spec = {**base, "bucket": "4", "speculating": "true"}
    steps, batch, k = 6000.0, 3, 3
    survival = [0.8**i for i in range(1, k + 1)]
    drafts = steps * batch
    rows += [
        (observations.STEPS, spec, steps),
        (observations.STEP_SECONDS, spec, steps * prior.step_s(batch, k)),
        (observations.TOKENS, spec, drafts * (1 + sum(survival))),
    ]
    by_drafter = {**base, "bucket": "4", "drafter": drafter}
    rows += [
        (observations.DRAFTS, by_drafter, drafts),
        (observations.DRAFT_TOKENS, by_drafter, drafts * k),
        (observations.ACCEPTED, by_drafter, drafts * sum(survival)),
    ]
    for i, s in enumerate(survival):
        at = {**base, "drafter": drafter, "position": str(i)}
        rows += [(observations.ACCEPTED_POS, at, drafts * s), (observations.PROPOSED_POS, at, drafts)]
    return rows


def fleet_history(pods: dict[str, str | None], end_s: float, span_s: float) -> str:
    """OpenMetrics text of the pods' counters (pod -> the drafter they speculated with, if any) rising
    linearly over `span_s` up to `end_s` (promtool backfills it): what the controller's window finds."""
    spec = SpeculativeServingSpec.model_validate(resource("http://unused")["spec"])
    prior = ResourceView(NAMESPACE, NAME, spec, tuple(pods)).prior(spec.drafters[0])
    rows = [row for pod, drafter in pods.items() for row in _pod_rows(pod, drafter, prior)]
    return openmetrics(rows, end_s - span_s, end_s, step_s=span_s / 60)


def sidecar_scrape_config(targets_file: Path) -> dict:
    """The real Prometheus scrapes every sidecar the targets file lists (with its namespace and pod
    labels, as a ServiceMonitor's relabelling gives them), re-reading the file as pods come and go."""
    return {
        "job_name": "sidecars",
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
    }


def write_targets(targets_file: Path, pods: list[SidecarPod]) -> None:
    entries = [
        {"targets": [f"{p.host}:{render.SIDECAR_PORT}"], "labels": {"namespace": NAMESPACE, "pod": p.name}}
        for p in pods
    ]
    tmp = targets_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries))
    tmp.replace(targets_file)


# ---- the Kubernetes side -----------------------------------------------------------------------------


def get(emulator: RVEmulator, resource_: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource_), NAMESPACE, name)
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    return dict(emulator.objects[key].raw)


def serving(emulator: RVEmulator, name: str = NAME) -> dict[str, Any]:
    return get(emulator, SERVINGS, name) or {}


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


def events(emulator: RVEmulator, reason: str | None = None, name: str = NAME) -> list[dict[str, Any]]:
    """Events about the resource `name` (all of them, or those with this reason)."""
    return [
        obj.raw
        for (res, _, _), obj in list(emulator.objects.items())
        if res.plural == "events"
        and not obj.deleted
        and (obj.raw.get("involvedObject") or {}).get("name") == name
        and (reason is None or obj.raw.get("reason") == reason)
    ]


def token_of(emulator: RVEmulator, name: str = NAME) -> str | None:
    secret = get(emulator, "v1/secrets", render.names(name)["secret"])
    if secret is None:
        return None
    plain = (secret.get("stringData") or {}).get(render.TOKEN_KEY)
    if plain is not None:
        return plain
    raw = (secret.get("data") or {}).get(render.TOKEN_KEY)
    return None if raw is None else base64.b64decode(raw).decode()


def sidecar_config_of(emulator: RVEmulator, name: str = NAME) -> SidecarConfig | None:
    config_map = get(emulator, "v1/configmaps", render.names(name)["config_map"])
    if config_map is None:
        return None
    (text,) = config_map["data"].values()
    return SidecarConfig.model_validate_json(text)


def loopback_hosts(n: int, taken: set[str]) -> list[str]:
    """`n` loopback addresses (all of 127/8 reaches this host) where nothing listens on the sidecar port."""
    hosts: list[str] = []
    base = 30 + os.getpid() % 150
    for i in range(1, 250):
        for j in range(1, 250):
            host = f"127.{base}.{i}.{j}"
            if host in taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, render.SIDECAR_PORT))
                except OSError:
                    continue
            hosts.append(host)
            taken.add(host)
            if len(hosts) == n:
                return hosts
    raise RuntimeError("no free loopback address for the sidecar port")


# ---- processes ---------------------------------------------------------------------------------------


@dataclass
class SidecarPod:
    """One engine pod's sidecar, as the kubelet runs it: the operator's sidecar config with the pod's
    paths made local, its control token in a file (a Secret volume), on `host` at the sidecar port."""

    name: str
    host: str
    workdir: Path
    config: SidecarConfig
    process: SidecarProcess | None = None

    @classmethod
    def from_operator(
        cls, name: str, host: str, workdir: Path, config: SidecarConfig, token: str
    ) -> SidecarPod:
        workdir.mkdir(parents=True, exist_ok=True)
        pod = cls(name, host, workdir, config)
        pod.write_token(token)
        drafters = [
            d.model_copy(update={"source": LOCAL_SOURCES[d.name]}) if d.source else d for d in config.drafters
        ]
        pod.config = config.model_copy(
            update={
                "host": host,
                "model_path": str(TARGET),
                "runtime_dir": str(workdir / "run"),
                "token_file": str(workdir / "token"),
                "engine_url": "http://127.0.0.1:9",  # no engine in this pod: engineReachable stays false
                "drafters": drafters,
            }
        )
        return pod

    @property
    def url(self) -> str:
        return f"http://{self.host}:{render.SIDECAR_PORT}"

    @property
    def socket_path(self) -> Path:
        return Path(self.config.runtime_dir) / SOCKET_NAME

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.process.pid

    def write_token(self, token: str) -> None:
        """As the kubelet updates a Secret volume: the new file replaces the old one in one step."""
        tmp = self.workdir / ".token.tmp"
        tmp.write_text(token)
        tmp.replace(self.workdir / "token")

    def token(self) -> str:
        return (self.workdir / "token").read_text().strip()

    def start(self, timeout_s: float = 60.0) -> SidecarPod:
        self.process = start_sidecar(self.config, self.workdir)
        self.process.wait_ready(timeout_s)
        return self

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a node fault would."""
        assert self.process is not None
        self.process.kill()

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets and answers nothing (a hung sidecar)."""
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)
            self.process.stop(timeout_s=5)

    async def state(self, session: aiohttp.ClientSession) -> dict[str, Any] | None:
        """GET /v1/state with the pod's current token; None when the sidecar does not answer."""
        try:
            async with session.get(
                f"{self.url}/v1/state",
                headers={"Authorization": f"Bearer {self.token()}"},
                timeout=aiohttp.ClientTimeout(total=2),
            ) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def metrics(self, session: aiohttp.ClientSession) -> dict[tuple[str, tuple], float]:
        async with session.get(f"{self.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return parse_metrics(await resp.text())


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_sum(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(
        v for (n, lab), v in samples.items() if n == name and all((k, v2) in lab for k, v2 in labels.items())
    )


class OperatorProcess:
    """The operator (fault_operator.py) in its own process group; `kill()` is a SIGKILL."""

    def __init__(self, workdir: Path, kubeconfig: str, prometheus_url: str, window_s: float) -> None:
        self.metrics_port = free_port()
        self.workdir = workdir
        self.env = {
            "KUBECONFIG": kubeconfig,
            "SPECSERVE_PROMETHEUS_URL": prometheus_url,
            "SPECSERVE_METRICS_WINDOW_S": str(window_s),
            fault_operator.TICK_ENV: "1",
            fault_operator.METRICS_PORT_ENV: str(self.metrics_port),
            fault_operator.CONFLICT_RETRY_ENV: "2",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
        self.group: GroupProcess | None = None
        self.starts = 0

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> OperatorProcess:
        self.starts += 1
        self.group = GroupProcess(
            "operator",
            [sys.executable, "-m", "specserve_testing.fault_operator"],
            self.workdir / f"operator-{self.starts}.log",
            env=self.env,
        )
        self.group.start()
        return self

    def running(self) -> bool:
        return self.group is not None and self.group.running()

    def log(self) -> str:
        return "" if self.group is None else self.group.log_tail(60)

    def kill(self) -> None:
        assert self.group is not None
        self.group.kill()

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop(grace_s=10)

    async def metrics(self, session: aiohttp.ClientSession) -> dict[tuple[str, tuple], float]:
        async with session.get(self.metrics_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return parse_metrics(await resp.text())


# ---- a Prometheus that misbehaves -------------------------------------------------------------------

FAULTS = ("down", "hung", "garbage", "inf", "negative", "empty")
_COUNTER_KINDS = set(SERIES)
_GARBAGE = (
    (200, "text/html", "<html><body>502 Bad Gateway</body></html>"),
    (200, "application/json", '{"status": "success", "data": {"resultType": "vector", "result": '),
    (200, "application/json", '{"status": "success", "data": {"resultType": "matrix", "result": 7}}'),
)


class FaultyPrometheus:
    """A real HTTP server speaking the Prometheus query API in front of `upstream` (the real Prometheus):
    queries pass through until `fault` is set to one of FAULTS, then it misbehaves until set to None."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.fault: str | None = None
        self.queries = 0
        self.hung_queries = 0
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._listening = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultyPrometheus:
        self._session = aiohttp.ClientSession()
        await self._listen()
        return self

    async def _listen(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/api/v1/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        self._listening = True

    async def set_fault(self, fault: str | None) -> None:
        """Inject `fault` (None: healthy again). `down` closes the port (connections are refused)."""
        assert fault is None or fault in FAULTS, fault
        if self.fault == "hung":
            self._release.set()
        self.fault = fault
        if fault == "hung":
            self._release = asyncio.Event()
        if fault == "down" and self._listening:
            await self._close()
        elif fault != "down" and not self._listening:
            await self._listen()

    async def _close(self) -> None:
        if self._runner is not None:
            self._release.set()
            await self._runner.cleanup()
            self._runner = None
        self._listening = False

    async def stop(self) -> None:
        await self._close()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.queries += 1
        fault = self.fault
        if fault == "hung":  # accepted, never answered (until the fault is lifted)
            self.hung_queries += 1
            await self._release.wait()
            return web.Response(status=503, text="released")
        if fault == "garbage":
            status, content_type, body = _GARBAGE[self.queries % len(_GARBAGE)]
            return web.Response(status=status, text=body, content_type=content_type)
        if fault == "empty":
            return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})
        assert self._session is not None
        async with self._session.request(
            request.method,
            f"{self.upstream}{request.path}",
            params=request.query,
            data=await request.read(),
            headers={k: v for k, v in request.headers.items() if k.lower() == "content-type"},
        ) as upstream:
            body = await upstream.json(content_type=None)
            status = upstream.status
        if fault in ("inf", "negative"):
            for sample in (body.get("data") or {}).get("result") or []:
                kind = sample["metric"].get("m")
                if fault == "inf" and kind in (observations.ACCEPTED, observations.ACCEPTED_POS):
                    sample["value"][1] = "+Inf"
                elif fault == "negative" and kind in _COUNTER_KINDS:
                    sample["value"][1] = str(-abs(float(sample["value"][1])))
        return web.json_response(body, status=status)


# ---- an engine's draft calls ---------------------------------------------------------------------------

# Each row's prompt repeats this phrase, so the n-gram drafter has something to continue.
PHRASE = [11, 12, 13, 14, 15, 16, 17, 18]


class DraftTraffic:
    """An engine's draft calls, made by the real proposer's socket client (DraftClient) in a thread:
    `rows` short requests decoding one token per step, and optionally one long request among them. A
    call counts as missed when no answer came within `deadline_s`; `drafted` counts the calls in which
    every short row got drafts."""

    def __init__(
        self,
        socket_path: Path,
        rows: int = 4,
        deadline_s: float = 1.0,
        step_s: float = 0.02,
        width: int = 4096,
    ) -> None:
        self.client = DraftClient(
            socket_path, max_k=MAX_K, max_model_len=width, vocab_size=512, deadline_s=deadline_s, retry_s=0.2
        )
        self.rows = rows
        self.step_s = step_s
        self.tokens = np.zeros((rows + 1, width), np.int32)
        self.lengths = np.zeros(rows + 1, np.int64)
        for r in range(rows):
            self.lengths[r] = 64
            self.tokens[r, :64] = np.resize(PHRASE, 64)
        self.calls = 0
        self.drafted = 0
        self.long_drafted = 0
        self.calls_with_long = 0
        self.errors: list[BaseException] = []
        self._pending_long: np.ndarray | None = None
        self._has_long = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults-draft-traffic", daemon=True)

    @property
    def missed(self) -> int:
        return self.client.missed

    def start(self) -> DraftTraffic:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()

    def add_long_row(self, tokens: np.ndarray) -> None:
        """From the next step on, one more row holds a request of these tokens."""
        self._pending_long = tokens

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by the scenario
            self.errors.append(exc)

    def _loop(self) -> None:
        req_ids = [f"short-{r}" for r in range(self.rows)] + ["long"]
        width = self.tokens.shape[1]
        while not self._stop.is_set():
            pending, self._pending_long = self._pending_long, None
            if pending is not None:
                self.tokens[self.rows, : len(pending)] = pending
                self.lengths[self.rows] = len(pending)
                self._has_long = True
            n = self.rows + self._has_long
            sampled = [[int(self.tokens[r, self.lengths[r] - 1])] for r in range(n)]
            drafts = self.client.propose(MAX_K, sampled, req_ids[:n], self.lengths[:n], self.tokens[:n])
            self.calls += 1
            if all(drafts[r] for r in range(self.rows)):
                self.drafted += 1
            if self._has_long:
                self.calls_with_long += 1
                self.long_drafted += bool(drafts[self.rows])
            for r in range(n):  # each request decodes one more token (its phrase goes on)
                length = int(self.lengths[r])
                if length < width - 1:
                    self.tokens[r, length] = PHRASE[length % len(PHRASE)]
                    self.lengths[r] = length + 1
            time.sleep(self.step_s)


# ---- leaks ---------------------------------------------------------------------------------------------


def _threads() -> dict[int, str]:
    # The spawner is one thread for the life of the process by design (processes.py).
    spawner = {t.ident for t in getattr(processes._spawner, "_threads", ())}
    return {t.ident: t.name for t in threading.enumerate() if t.ident not in spawner and t.ident is not None}


def _children() -> dict[int, str]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                out[child.pid] = " ".join(child.cmdline()[:4])
    return out


def port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port (a connection in TIME_WAIT does not count: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class LeakCheck:
    """What a scenario leaves behind: child processes, threads and listening ports it did not have at
    the start. `ports` are the (host, port) pairs the scenario served on."""

    children: dict[int, str] = field(default_factory=_children)
    threads: dict[int, str] = field(default_factory=_threads)
    ports: list[tuple[str, int]] = field(default_factory=list)
    kept_groups: set[int] = field(default_factory=set)  # process groups the scenario hands on by design

    def keep(self, pgid: int) -> None:
        """A process group the scenario started to stay (a pod's restarted container): not a leak."""
        self.kept_groups.add(pgid)

    def _new(self, pid: int) -> bool:
        if pid in self.children:
            return False
        try:
            return os.getpgid(pid) not in self.kept_groups
        except ProcessLookupError:
            return False

    def leaks(self, wait_s: float = 10.0) -> list[str]:
        deadline = time.monotonic() + wait_s
        while True:
            found = [f"process {pid}: {cmd}" for pid, cmd in _children().items() if self._new(pid)]
            found += [f"thread {name}" for ident, name in _threads().items() if ident not in self.threads]
            found += [
                f"port {host}:{port} still listening"
                for host, port in self.ports
                if not port_free(host, port)
            ]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


async def wait_for(check: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Await until `check()` (sync or async) returns something truthy; return it, or fail with what
    the last call returned."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s (last: {last!r})")
        await asyncio.sleep(interval)


# ---- one scenario's fleet -----------------------------------------------------------------------------


@dataclass
class Scenario:
    """One scenario's record: what it measured, and what it must not leave behind."""

    name: str
    leaks: LeakCheck = field(default_factory=LeakCheck)
    requests: int = 0
    failed_requests: int = 0
    recovery_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def count(self, requests: int, failed: int) -> None:
        self.requests += requests
        self.failed_requests += failed


@dataclass
class FleetPrometheus:
    """The real Prometheus of a test session: backfilled history, and the sidecars it scrapes (the
    targets file) with the window the controller reads it over."""

    process: PrometheusProcess
    targets_file: Path
    window_s: float

    @property
    def url(self) -> str:
        return self.process.url


class Fleet:
    """One scenario's fleet: the operator process, the sidecar pods of its resources, the Prometheus
    (misbehaving or not) they use, and the API server (kmock) they all talk to."""

    def __init__(
        self,
        emulator: RVEmulator,
        prometheus: FleetPrometheus,
        proxy: FaultyPrometheus,
        workdir: Path,
        record: Scenario,
        session: aiohttp.ClientSession,
    ) -> None:
        self.emulator = emulator
        self.prometheus = prometheus
        self.proxy = proxy
        self.workdir = workdir
        self.record = record
        self.session = session
        self.operator = OperatorProcess(workdir, os.environ["KUBECONFIG"], proxy.url, prometheus.window_s)
        self.pods: dict[str, list[SidecarPod]] = {}
        self.traffic: list[DraftTraffic] = []
        self._hosts: set[str] = set()
        record.leaks.ports += [("127.0.0.1", proxy.port), ("127.0.0.1", self.operator.metrics_port)]

    # -- the operator ---------------------------------------------------------------------------------
    async def start_operator(self) -> None:
        """Start the operator; return once it watches the resources and the pods. (kmock's watch from a
        resourceVersion streams only what happens after it starts, where a real API server would replay
        what happened since the list: an object created in between would never reach the operator.)"""
        watches = self._watches()
        self.operator.start()
        await wait_for(self._operator_serves, timeout=60, interval=0.2)
        await wait_for(lambda: all(n > w for n, w in zip(self._watches(), watches, strict=True)), timeout=60)

    def _watches(self) -> tuple[int, int]:
        """Watch requests so far: on the SpeculativeServings, on the pods."""
        return tuple(len(self.emulator["watch", kmock.resource(r)]) for r in (SERVINGS, "v1/pods"))  # type: ignore[return-value]

    async def _operator_serves(self) -> bool:
        if not self.operator.running():
            raise AssertionError(f"the operator exited:\n{self.operator.log()}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await self.operator.metrics(self.session)
            return True
        return False

    # -- resources ------------------------------------------------------------------------------------
    async def create(self, body: dict[str, Any]) -> None:
        await self.emulator.post(SERVINGS_PATH, json=body)

    async def patch_spec(self, spec: dict[str, Any], name: str = NAME) -> None:
        await self.emulator.patch(f"{SERVINGS_PATH}/{name}", json={"spec": spec}, headers=MERGE)

    async def delete(self, name: str = NAME) -> None:
        await self.emulator.delete(f"{SERVINGS_PATH}/{name}")

    def status(self, name: str = NAME) -> dict[str, Any]:
        return serving(self.emulator, name).get("status") or {}

    # -- pods -----------------------------------------------------------------------------------------
    async def start_pods(self, n: int, name: str = NAME, first: int = 0) -> list[SidecarPod]:
        """What the Deployment's pods would be: `n` sidecars started from the operator's ConfigMap and
        Secret, each on its own address, then their Pod objects (ready) in the API server."""
        config = await wait_for(lambda: sidecar_config_of(self.emulator, name), timeout=30)
        token = await wait_for(lambda: token_of(self.emulator, name), timeout=30)
        hosts = loopback_hosts(n, self._hosts)
        self.record.leaks.ports += [(h, render.SIDECAR_PORT) for h in hosts]
        pods = [
            SidecarPod.from_operator(
                f"{name}-{first + i}", h, self.workdir / f"{name}-{first + i}", config, token
            )
            for i, h in enumerate(hosts)
        ]
        self.pods.setdefault(name, []).extend(pods)
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in pods))
        for pod in pods:
            await self.emulator.post(
                f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod_object(pod.name, name, pod.host)
            )
        write_targets(self.prometheus.targets_file, [p for ps in self.pods.values() for p in ps])
        return pods

    async def remove_pods(self, name: str = NAME) -> None:
        """The pods are gone (garbage-collected with their Deployment)."""
        for pod in self.pods.pop(name, []):
            await asyncio.to_thread(pod.stop)
            await self.emulator.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod.name}")
        write_targets(self.prometheus.targets_file, [p for ps in self.pods.values() for p in ps])

    async def states(self, name: str = NAME) -> list[dict[str, Any] | None]:
        return list(await asyncio.gather(*(p.state(self.session) for p in self.pods.get(name, []))))

    def traffic_to(self, pod: SidecarPod, **kwargs: Any) -> DraftTraffic:
        traffic = DraftTraffic(pod.socket_path, **kwargs).start()
        self.traffic.append(traffic)
        return traffic

    def stop_traffic(self) -> None:
        """Stop the engines' draft calls and count them into the scenario's requests."""
        for traffic in self.traffic:
            traffic.stop()
            assert traffic.errors == [], traffic.errors
            self.record.count(traffic.calls, traffic.missed)
        self.traffic = []

    # -- what the operator intends, and whether the pods run it ----------------------------------------
    async def in_force(self, name: str = NAME, mode: str | None = None) -> list[dict[str, Any]] | None:
        """Every pod's state, when every pod runs the policy the resource's status says is in force
        (its version, drafter and K table; `mode` when given); else None."""
        status = self.status(name)
        version = status.get("policyVersion", 0)  # 0: the start-up policy is still the one in force
        states = await self.states(name)
        for state in states:
            if state is None or state["policyVersion"] != version:
                return None
            if state["drafter"] != status.get("activeDrafter", state["drafter"]):
                return None
            if mode is not None and state["mode"] != mode:
                return None
            if state["mode"] == "on" and state["kByBucket"] != status.get("kByBucket", state["kByBucket"]):
                return None
        return states  # type: ignore[return-value]

    async def healthy(self, name: str = NAME, timeout: float = 60) -> list[dict[str, Any]]:
        """Wait for the decided policy on every pod and PoliciesApplied True; the pods' states."""
        try:
            states = await wait_for(lambda: self.in_force(name), timeout=timeout, interval=0.2)
            await wait_for(lambda: self.condition("PoliciesApplied", name, status="True"), timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await self.describe(name)}") from None
        return states

    async def until(
        self, check: Callable[[], Any], timeout: float, name: str = NAME, interval: float = 0.1
    ) -> Any:
        """wait_for, failing with what an operator would look at (describe) as well."""
        try:
            return await wait_for(check, timeout, interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await self.describe(name)}") from None

    async def describe(self, name: str = NAME) -> str:
        """What an operator would look at: the status, the Events, the pods' states, the operator's log."""
        events = [f"{e.get('type')} {e.get('reason')}: {e.get('message')}" for e in self.events(name=name)]
        return (
            f"status: {json.dumps(self.status(name), indent=1)}\nevents: {events}\n"
            f"pods: {await self.states(name)}\noperator log:\n{self.operator.log()}"
        )

    def condition(self, type_: str, name: str = NAME, status: str | None = None) -> dict[str, Any] | None:
        found = condition(serving(self.emulator, name), type_)
        if found is None or (status is not None and found["status"] != status):
            return None
        return found

    def events(self, reason: str | None = None, name: str = NAME) -> list[dict[str, Any]]:
        return events(self.emulator, reason, name)

    async def close(self) -> None:
        self.stop_traffic()
        for pods in self.pods.values():
            for pod in pods:
                await asyncio.to_thread(pod.stop)
        write_targets(self.prometheus.targets_file, [])
        await asyncio.to_thread(self.operator.stop)
        await self.proxy.stop()
