"""`specserve local up`: a SpeculativeServing resource run on this machine, no cluster.

Each replica is a real `vllm serve` (B's launcher) and a real sidecar; a real Prometheus scrapes them;
the operator's controller decides every evaluationInterval and pushes policies over the sidecars' HTTP
API; the built-in load generator sends the traffic pattern. Then the same traffic runs briefly with
plain decoding on a stock vLLM per replica (no specserve flags, plugins or drafter: vLLM as users start it)
with static speculation, and with the best static table for this traffic (measured by a sweep on the same
pods), for comparison, and a report is written.

Everything started lives in its own process group and is stopped in `finally`, Ctrl-C included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from specserve_engine.api import PolicyRequest
from specserve_engine.client import SidecarClient, SidecarError
from specserve_engine.launch import EngineProcess, free_port, start_engine
from specserve_engine.processes import GroupProcess, group_rss_bytes
from specserve_operator.local import preflight
from specserve_operator.local.errors import LocalFleetError
from specserve_operator.local.loadgen import LoadGenerator, window_tokens_per_s
from specserve_operator.local.observe import FleetObserver, scrape_jobs
from specserve_operator.local.plan import FleetPlan, load_manifest, plan_fleet
from specserve_operator.local.prometheus import PrometheusError, PrometheusProcess
from specserve_operator.local.prompts import load_prompts
from specserve_operator.local.report import (
    RUN_BEST_STATIC,
    RUN_OFF,
    RUN_SPECSERVE,
    RUN_STATIC,
    RUN_SWEEP,
    ReportInput,
    SweepResult,
    write_report,
)
from specserve_operator.local.rules import usable_rule_files
from specserve_operator.local.samples import DecisionRecord, FleetSample
from specserve_operator.local.status_file import FLEET_FILE, PROMETHEUS_DATA_DIR, record_tick
from specserve_operator.local.sweep import (
    Candidate,
    Shape,
    SweepPoint,
    best_static_table,
    sweep_candidates,
    sweep_shapes,
)
from specserve_operator.local.traffic import Phase, TrafficPattern
from specserve_operator.local.view import ViewState
from specserve_operator.tuner.core import ResourceView, live_switchable
from specserve_operator.tuner.loop import FleetController

REPO = Path(__file__).resolve().parents[3]
DEFAULT_MODELS_DIR = REPO / "models"
# Resident memory of one tiny engine (API server, engine core, worker: 2.8 GiB with a 1 GiB KV cache)
# and its sidecar (0.3 GiB), measured on this machine (docs/local-fleet.md); the KV cache comes on top.
ENGINE_RSS_GIB = 2.1
# Prometheus, the controller, the load generator and the rest of the machine.
RESERVE_GIB = 1.5


@dataclass
class UpOptions:
    manifest: Path
    pattern: TrafficPattern
    out_dir: Path
    models_dir: Path = DEFAULT_MODELS_DIR
    replicas: int | None = None
    compare: tuple[str, ...] = (RUN_OFF, RUN_STATIC, RUN_BEST_STATIC)
    compare_scale: float = 0.5
    max_tokens: int = 64
    prometheus_port: int | None = None
    kv_cache_gib: int = 1
    engine_timeout_s: float = 600.0
    # The controller's rate window: a minute, not the cluster's five, since a traffic phase lasts one or
    # two; long enough that a bucket switched off keeps its measured step times until load changes.
    window_s: float = 60.0
    settle_s: float = 3.0  # quiet gap between two runs, so one run's requests do not leak into the next
    sweep_point_s: float = 8.0  # how long each candidate runs each traffic shape in the best-static sweep
    sweep_rounds: int = 2  # rounds of the sweep, interleaved; each candidate counts at its median
    seed: int = 0


@dataclass
class FleetRuntime:
    """What is running, so that `stop` can take everything down in reverse order."""

    engines: list[EngineProcess] = field(default_factory=list)
    stock_engines: list[EngineProcess] = field(default_factory=list)
    sidecars: list[GroupProcess] = field(default_factory=list)
    prometheus: PrometheusProcess | None = None

    def stop(self) -> None:
        if self.prometheus is not None:
            with contextlib.suppress(Exception):
                self.prometheus.stop()
        for sidecar in self.sidecars:
            sidecar.stop()
        for engine in self.engines + self.stock_engines:
            with contextlib.suppress(Exception):
                engine.stop()


@dataclass
class Session:
    """The state shared by the runs, the sampler, the controller and the view."""

    opts: UpOptions
    plan: FleetPlan
    view: ViewState
    on_change: Callable[[], None]
    samples: list[FleetSample] = field(default_factory=list)
    decisions: list[DecisionRecord] = field(default_factory=list)
    run: str | None = None
    run_started: float = 0.0  # loop time
    pattern: TrafficPattern | None = None
    status: dict = field(default_factory=dict)  # what the operator would write to the resource's status
    timed_decisions: list[dict] = field(default_factory=list)  # for `specserve status --local`

    def say(self, message: str) -> None:
        self.plan.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.plan.run_dir / "fleet.log", "a") as log:
            log.write(f"{datetime.now(UTC).isoformat(timespec='seconds')} {message}\n")
        self.view.messages.append(message)
        self.view.stage = message
        self.on_change()


def sidecar_executable() -> Path:
    exe = Path(sys.executable).parent / "specserve-sidecar"
    if not exe.exists():
        raise LocalFleetError(
            f"specserve-sidecar is not installed next to {sys.executable}",
            hint="run `make setup` (it installs the project into .venv)",
        )
    return exe


def prepare(opts: UpOptions) -> tuple[FleetPlan, Path]:
    """Validate everything and lay the fleet out; starts nothing."""
    resource = load_manifest(opts.manifest)
    preflight.require_prometheus()
    count = opts.replicas if opts.replicas is not None else resource.spec.replicas
    with_stock = RUN_OFF in opts.compare
    preflight.check_memory(
        count,
        int((ENGINE_RSS_GIB + opts.kv_cache_gib) * (2 if with_stock else 1) * preflight.GIB),
        preflight.available_memory_bytes(),
        int(RESERVE_GIB * preflight.GIB),
    )
    if opts.prometheus_port is not None:
        preflight.require_ports_free([("Prometheus (--prometheus-port)", opts.prometheus_port)])
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = (opts.out_dir / f"{resource.metadata.name}-{stamp}").resolve()
    ports: list[int] = []
    while len(ports) < (3 if with_stock else 2) * max(1, count):
        port = free_port()
        if port not in ports and port != opts.prometheus_port:
            ports.append(port)
    pod_ports = ports[: 2 * max(1, count)]
    plan = plan_fleet(
        resource,
        run_dir=run_dir,
        models_dir=opts.models_dir.resolve(),
        ports=pod_ports,
        replicas=opts.replicas,
        kv_cache_gib=opts.kv_cache_gib,
        stock_ports=ports[len(pod_ports) :] if with_stock else None,
    )
    return plan, run_dir


async def _wait_http(
    url: str, proc_alive: Callable[[], bool], what: str, log: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if not proc_alive():
                raise LocalFleetError(f"{what} exited during start-up", hint=f"see its log: {log}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(1.0)
    raise LocalFleetError(
        f"{what} was not ready at {url} after {timeout_s:.0f} s", hint=f"see its log: {log}"
    )


async def start_fleet(s: Session, rt: FleetRuntime) -> None:
    plan = s.plan
    plan.token_file.parent.mkdir(parents=True, exist_ok=True)
    plan.token_file.write_text(secrets.token_urlsafe(24))
    plan.token_file.chmod(0o600)
    exe = sidecar_executable()
    s.say(f"starting {len(plan.replicas)} engine(s) and sidecar(s) (vLLM takes a minute or two on a CPU)")
    for r in plan.replicas:
        r.run_dir.mkdir(parents=True, exist_ok=True)
        r.sidecar_config_path.write_text(r.sidecar.model_dump_json(by_alias=True, indent=1))
        rt.engines.append(start_engine(r.engine, r.run_dir / "engine.log"))
        sidecar = GroupProcess(
            f"{r.name}-sidecar", [str(exe), "--config", str(r.sidecar_config_path)], r.run_dir / "sidecar.log"
        )
        sidecar.start()
        rt.sidecars.append(sidecar)
    for stock in plan.stock_engines:
        log = plan.run_dir / f"stock-{stock.port}" / "engine.log"
        rt.stock_engines.append(start_engine(stock, log))
    for r, engine, sidecar in zip(plan.replicas, rt.engines, rt.sidecars, strict=True):
        await _wait_http(
            f"{engine.url}/health",
            lambda e=engine: e.process.poll() is None,
            f"engine {r.name}",
            engine.log_path,
            s.opts.engine_timeout_s,
        )
        s.say(
            f"engine {r.name} ready at {engine.url} ({group_rss_bytes(engine.process.pid) / 2**30:.1f} GiB)"
        )
        await _wait_http(
            f"{r.sidecar_url}/readyz", sidecar.running, f"sidecar {r.name}", sidecar.log_path, 300
        )
        s.say(
            f"sidecar {r.name} ready at {r.sidecar_url} ({group_rss_bytes(sidecar.pid or 0) / 2**30:.2f} GiB)"
        )
    for engine in rt.stock_engines:
        await _wait_http(
            f"{engine.url}/health",
            lambda e=engine: e.process.poll() is None,
            "stock engine (the plain-decoding run's)",
            engine.log_path,
            s.opts.engine_timeout_s,
        )
        s.say(f"stock vLLM ready at {engine.url} ({group_rss_bytes(engine.process.pid) / 2**30:.1f} GiB)")
    targets = [(r.name, "engine", f"127.0.0.1:{r.engine_port}") for r in plan.replicas]
    targets += [(r.name, "sidecar", f"127.0.0.1:{r.sidecar.port}") for r in plan.replicas]
    rules = usable_rule_files(REPO / "charts" / "specserve" / "files")
    rt.prometheus = PrometheusProcess(
        scrape_configs=scrape_jobs(plan.namespace, targets),
        rule_files=rules,
        port=s.opts.prometheus_port,
        data_dir=plan.run_dir / PROMETHEUS_DATA_DIR,
        log_path=plan.run_dir / "prometheus.log",
    )
    try:
        await asyncio.to_thread(rt.prometheus.start)
        await asyncio.to_thread(rt.prometheus.wait_scraped)
    except PrometheusError as exc:
        raise LocalFleetError(f"Prometheus did not start: {exc}", hint=preflight.PROMETHEUS_HINT) from None
    s.say(f"Prometheus at {rt.prometheus.url} ({len(rules)} rule file(s) from the chart)")
    (plan.run_dir / FLEET_FILE).write_text(
        json.dumps(
            {
                "prometheus": rt.prometheus.url,
                "pods": {
                    r.name: {
                        "engine": r.engine_url,
                        "sidecar": r.sidecar_url,
                        "runtimeDir": r.sidecar.runtime_dir,
                    }
                    for r in plan.replicas
                },
                "stockEngines": [e.url for e in rt.stock_engines],
                "pids": [e.process.pid for e in rt.engines + rt.stock_engines] + [p.pid for p in rt.sidecars],
            },
            indent=1,
        )
    )


async def _sampler(s: Session, observer: FleetObserver, session: aiohttp.ClientSession) -> None:
    loop = asyncio.get_running_loop()
    while True:
        pods = await observer.pods(session)
        run, pattern = s.run, s.pattern
        if run is not None and pattern is not None:
            t = loop.time() - s.run_started
            at = pattern.phase_at(t)
            progress = s.view.progress
            sample = FleetSample(
                run=run,
                t_s=t,
                phase_index=at.index if at else -1,
                phase=at.phase.name if at else "draining",
                target_concurrency=at.phase.concurrency if at else 0,
                in_flight=progress.in_flight if progress else 0,
                pods=pods,
            )
            s.samples.append(sample)
            s.view.sample = sample
        else:
            s.view.sample = FleetSample("idle", 0.0, -1, "idle", 0, 0, pods)
        s.on_change()
        await asyncio.sleep(1.0)


async def _controller_loop(s: Session, controller: FleetController, token: str) -> None:
    """The operator's controller, every evaluationInterval, during the specserve run only (the comparison
    runs hold fixed policies)."""
    loop = asyncio.get_running_loop()
    plan = s.plan
    view = ResourceView(plan.namespace, plan.name, plan.spec, tuple(r.name for r in plan.replicas))
    endpoints = {r.name: r.sidecar_url for r in plan.replicas}
    interval_s = plan.spec.speculation.evaluation_interval_seconds
    while True:
        await asyncio.sleep(interval_s)
        if s.run != RUN_SPECSERVE:
            continue
        result = await controller.tick(view, endpoints, token)
        t = loop.time() - s.run_started
        d = result.decision
        if d is None:
            reason = str(result.metrics_error) if result.metrics_error else "no decision"
            s.decisions.append(DecisionRecord(RUN_SPECSERVE, t, "*", "noMetrics", reason))
        elif d.changed or d.action != "hold":
            targets = {(p.drafter, p.mode, tuple(p.k_by_bucket.items())) for p in d.pods.values()}
            # One record for the fleet, or one per pod where pods differ (a canary).
            for pod, target in d.pods.items() if len(targets) > 1 else [("*", None)]:
                drafter = target.drafter if target else d.drafter
                table = target.k_by_bucket if target else d.k_by_bucket
                s.decisions.append(DecisionRecord(RUN_SPECSERVE, t, pod, d.action, d.reason, drafter, table))
        for pod, why in result.unreachable.items():
            s.decisions.append(DecisionRecord(RUN_SPECSERVE, t, pod, "unreachable", why))
        record_tick(plan.run_dir, s.status, s.timed_decisions, view, result, datetime.now(UTC))
        s.view.decisions = s.decisions
        s.on_change()


POLICY_IN_FORCE_TIMEOUT_S = 120.0  # a model drafter's first use loads and warms it


async def _apply_everywhere(
    clients: dict[str, SidecarClient], drafter: str, mode: str, k_for: Callable[[str], int], what: str
) -> None:
    """Put one policy on every pod and wait until each sidecar has it in force."""
    for pod, client in clients.items():
        state = await client.state()
        version = state.policy_version + 1
        table = {bucket: k_for(bucket) for bucket in state.k_by_bucket}
        policy = PolicyRequest(policyVersion=version, drafter=drafter, mode=mode, kByBucket=table)
        try:
            await client.put_policy(policy)
        except SidecarError as exc:
            raise LocalFleetError(f"{pod}: the sidecar refused the {what} policy: {exc}") from None
        deadline = time.monotonic() + POLICY_IN_FORCE_TIMEOUT_S
        while (await client.state()).policy_version != version:
            if time.monotonic() > deadline:
                raise LocalFleetError(
                    f"{pod}: the {what} policy was not in force after {POLICY_IN_FORCE_TIMEOUT_S:.0f} s"
                )
            await asyncio.sleep(0.05)


async def _push_fixed(s: Session, clients: dict[str, SidecarClient]) -> None:
    """The static-speculation run's fixed policy: the initial drafter at its maximum K in every bucket."""
    drafter = s.plan.spec.initial_drafter
    if drafter is None:
        raise LocalFleetError("static speculation needs a drafter", hint="add one to spec.drafters")
    max_k = drafter.max_speculative_tokens
    await _apply_everywhere(clients, drafter.name, "on", lambda _: max_k, "static")


async def _sweep(
    s: Session, loadgen: LoadGenerator, clients: dict[str, SidecarClient], pattern: TrafficPattern
) -> SweepResult:
    """Measure off and every drafter at every K on each shape of the pattern, on the fleet's own pods, in
    rounds (every candidate once a round, so the machine's drift falls on all of them alike), and pick the
    best static table in hindsight (local/sweep.py)."""
    spec = s.plan.spec
    # Only what the pods can switch to live: an engine started with a colocated drafter runs that one.
    engine_drafter = s.plan.replicas[0].sidecar.engine_drafter
    drafters = [d for d in spec.drafters if live_switchable(d, engine_drafter)]
    candidates = sweep_candidates({d.name: d.max_speculative_tokens for d in drafters})
    first = drafters[0].name
    points: list[SweepPoint] = []
    rounds = s.opts.sweep_rounds
    for n in range(rounds):
        for shape in sweep_shapes(pattern):
            for candidate in candidates:
                k = candidate.k
                await _apply_everywhere(
                    clients, candidate.drafter or first, "on" if k else "off", lambda _, k=k: k, "sweep"
                )
                phase = Phase(RUN_SWEEP, s.opts.sweep_point_s, shape.concurrency, shape.code_fraction)
                s.say(f"sweep {n + 1}/{rounds}: {_candidate_name(candidate)} at {_shape_name(shape)}")
                records = await loadgen.run(RUN_SWEEP, TrafficPattern((phase,)))
                tokens_per_s = window_tokens_per_s(records, 0.0, s.opts.sweep_point_s)
                points.append(SweepPoint(shape, candidate, tokens_per_s))
    table = best_static_table(points, pattern, spec.speculation.batch_buckets)
    s.say(f"best static table: {table.drafter} {table.k_by_bucket}")
    return SweepResult(points, table)


def _candidate_name(c: Candidate) -> str:
    return f"{c.drafter} K={c.k}" if c.drafter else "off"


def _shape_name(shape: Shape) -> str:
    return f"concurrency {shape.concurrency}, {shape.code_fraction:.0%} code"


async def _run_traffic(
    s: Session,
    loadgen: LoadGenerator,
    label: str,
    pattern: TrafficPattern,
    endpoints: dict[str, str] | None = None,
) -> None:
    s.run, s.pattern = label, pattern
    s.view.pattern = pattern
    s.run_started = asyncio.get_running_loop().time()
    s.say(f"run {label}: {pattern.render()}")
    loadgen.progress = None  # the previous run's, until this run makes its own
    s.view.progress = None
    task = asyncio.create_task(loadgen.run(label, pattern, endpoints))
    while s.view.progress is None and not task.done():
        s.view.progress = loadgen.progress
        await asyncio.sleep(0.05)
    await task
    s.run = None


async def run_session(s: Session, rt: FleetRuntime) -> Path:
    """Start the fleet, run the traffic three ways, write the report; the caller stops `rt`."""
    opts, plan = s.opts, s.plan
    await start_fleet(s, rt)
    assert rt.prometheus is not None
    prompts = load_prompts(opts.models_dir)
    token = plan.token_file.read_text().strip()
    windows: dict[str, tuple[float, float]] = {}
    patterns: dict[str, TrafficPattern] = {}
    sweep: SweepResult | None = None
    async with aiohttp.ClientSession() as http:
        clients = {r.name: SidecarClient(r.sidecar_url, token, http) for r in plan.replicas}
        observer = FleetObserver(
            rt.prometheus.url, plan.namespace, clients, tuple(plan.spec.speculation.batch_buckets)
        )
        controller = FleetController(rt.prometheus.url, http, window_s=opts.window_s)
        loadgen = LoadGenerator(
            endpoints={r.name: r.engine_url for r in plan.replicas},
            model=plan.spec.model.name,
            prompts=prompts,
            max_tokens=opts.max_tokens,
            seed=opts.seed,
        )
        background = [
            asyncio.create_task(_sampler(s, observer, http)),
            asyncio.create_task(_controller_loop(s, controller, token)),
        ]
        try:
            runs: list[tuple[str, TrafficPattern]] = [(RUN_SPECSERVE, opts.pattern)]
            runs += [(label, opts.pattern.scaled(opts.compare_scale)) for label in opts.compare]
            stock = {r.name: e.url for r, e in zip(plan.replicas, rt.stock_engines, strict=False)}
            for label, pattern in runs:
                if label == RUN_STATIC:
                    await _push_fixed(s, clients)
                if label == RUN_BEST_STATIC:
                    sweep = await _sweep(s, loadgen, clients, pattern)
                    table = sweep.table
                    await _apply_everywhere(
                        clients, table.drafter, "on", table.k_by_bucket.__getitem__, "best static"
                    )
                # Recorded before the run, so that a Ctrl-C in the middle still reports what ran.
                windows[label] = (time.time(), math.inf)
                patterns[label] = pattern
                await _run_traffic(s, loadgen, label, pattern, stock if label == RUN_OFF else None)
                windows[label] = (windows[label][0], time.time())
                await asyncio.sleep(opts.settle_s)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            s.say("writing the report")
            mal: dict[str, dict[str, float]] = {}
            steps: dict[str, dict[str, float]] = {}
            for label, (start, end) in windows.items():
                with contextlib.suppress(Exception):
                    mal[label], steps[label] = await observer.per_bucket(http, start, min(end, time.time()))
            report = (
                write_report(
                    plan.run_dir / "report",
                    ReportInput(
                        title=f"specserve local fleet: {plan.namespace}/{plan.name}",
                        patterns=patterns,
                        samples=s.samples,
                        decisions=s.decisions,
                        records=loadgen.records,
                        mal_by_bucket=mal,
                        steps_by_bucket=steps,
                        facts=_facts(plan, opts),
                        sweep=sweep,
                    ),
                )
                if patterns
                else None
            )
    if report is None:
        raise LocalFleetError("no traffic run finished, so there is no report")
    return report


def _facts(plan: FleetPlan, opts: UpOptions) -> dict[str, str]:
    spec = plan.spec
    drafters = ", ".join(
        f"{d.name} ({d.method}, {d.placement}, K≤{d.max_speculative_tokens})" for d in spec.drafters
    )
    return {
        "manifest": str(opts.manifest),
        "model": f"{spec.model.name} ({plan.model_path})",
        "replicas": str(len(plan.replicas)),
        "drafters": drafters or "none",
        "speculation": f"mode {spec.speculation.mode}, every {spec.speculation.evaluation_interval}, "
        f"cooldown {spec.speculation.cooldown}, minGain {spec.speculation.min_gain}",
        "comparison runs": f"{', '.join(opts.compare) or 'none'} at {opts.compare_scale:g}× the duration",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def install_signal_handlers(task: asyncio.Task[object]) -> None:
    """Ctrl-C or SIGTERM cancel the session; `finally` blocks then stop every process."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
