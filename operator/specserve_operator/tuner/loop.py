"""The controller's I/O: one shared fleet read per Prometheus per tick, a decision per resource, the
policy pushed to every pod's sidecar. Used by the kopf timer (timer.py) and by the local fleet.

speculation.mode advise decides as auto does, from the same remembered state, but without canaries or
trials, and pushes nothing and rolls nothing out: the decision is a recommendation (status, Events and
the recommended-K metrics show it). Back in auto, the next tick pushes the recommended policy, and rolls
the pods out first where its drafter needs an engine restart; from auto to advise the pods keep theirs.

Every tick reconciles what the pods run: each pod's sidecar is asked what it runs, and given its policy
where that differs (a new decision, a sidecar that restarted at its start-up policy, a pod started
later), all pods at once with a deadline per call.

Faults fail static: when Prometheus is down, slow or answers garbage, nothing is decided (each pod keeps,
or is given back, the policy last applied to it) and reads back off exponentially; a sidecar that does
not answer is retried on the next tick while the other pods are served; an exception while deciding for
one resource is that resource's (ResourceTick.error), never the others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
from prometheus_client import Counter, Gauge, Histogram

from specserve_engine import metric_names
from specserve_engine.api import PolicyRequest, SidecarState
from specserve_engine.client import SidecarClient, SidecarError
from specserve_operator.tuner import core
from specserve_operator.tuner import policy as tuner_policy
from specserve_operator.tuner.observations import FleetSnapshot
from specserve_operator.tuner.reader import MetricsUnavailable, PrometheusReader

DECISIONS = Counter(
    metric_names.OPERATOR_DECISIONS.name,
    metric_names.OPERATOR_DECISIONS.help,
    list(metric_names.OPERATOR_DECISIONS.labels),
)
TICK_SECONDS = Histogram(metric_names.OPERATOR_TICK_SECONDS.name, metric_names.OPERATOR_TICK_SECONDS.help)
RECOMMENDED_K = Gauge(
    metric_names.OPERATOR_RECOMMENDED_K.name,
    metric_names.OPERATOR_RECOMMENDED_K.help,
    list(metric_names.OPERATOR_RECOMMENDED_K.labels),
)
PREDICTED_GAIN = Gauge(
    metric_names.OPERATOR_PREDICTED_GAIN.name,
    metric_names.OPERATOR_PREDICTED_GAIN.help,
    list(metric_names.OPERATOR_PREDICTED_GAIN.labels),
)

BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0
PUSH_ATTEMPTS = 2
# Each call to a sidecar gives up after this long; with the calls of a tick made concurrently, hung
# sidecars cost a tick about this much, however many there are.
SIDECAR_TIMEOUT_S = 2.0
FAN_OUT = 16  # sidecar calls in flight at once, over all resources

log = logging.getLogger("specserve.tuner")

TokenRefresh = Callable[[], Awaitable[str | None]]
T = TypeVar("T")


# gen0 threshold while the operator runs (CPython's default is 700 allocations).
GC_GEN0_THRESHOLD = 50_000


def tune_garbage_collector() -> None:
    """Set once at the operator's start-up, from its main thread. A tick over a large fleet decodes tens
    of megabytes of Prometheus JSON into millions of short-lived objects; with CPython's default
    thresholds each of the many collections this triggers also walks every long-lived object (kopf, the
    Kubernetes client, the controller's state). Freezing what start-up made and collecting generation 0
    less often halves the CPU of a 1,000-resource tick (benchmarks/controller_bench.py --scale); garbage
    is still collected, only in fewer, larger passes."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


@dataclass
class Backoff:
    failures: int = 0
    retry_at: float = -math.inf
    error: tuple[str, str] | None = None  # the last failure's reason and message

    def fail(self, error: MetricsUnavailable, now: float) -> None:
        self.failures += 1
        self.error = (error.reason, str(error))
        self.retry_at = now + min(BACKOFF_BASE_S * 2 ** (self.failures - 1), BACKOFF_MAX_S)

    def ok(self) -> None:
        self.failures, self.retry_at, self.error = 0, -math.inf, None

    def last_error(self) -> MetricsUnavailable:
        """The last failure as a new exception: raising one object again and again grows its traceback."""
        assert self.error is not None
        return MetricsUnavailable(*self.error)


@dataclass
class ResourceTick:
    """What one tick did for one resource: the decision (None when metrics were unavailable or deciding
    failed), the pods that did not take their policy, and the policy version each pod reports in force
    (its sidecar's policy-info metric, as read this tick)."""

    decision: core.Decision | None
    metrics_error: MetricsUnavailable | None = None
    error: str | None = None  # deciding raised: the exception, in words (nothing new was decided)
    unreachable: dict[str, str] = field(default_factory=dict)
    pushed: list[str] = field(default_factory=list)
    # Pods whose sidecar ran another policy than the one last applied there (a restarted sidecar, or
    # another client): what it ran; each was given its policy again.
    restored: dict[str, str] = field(default_factory=dict)
    # Pods whose engine cannot switch to the intended drafter live: a rollout replaces them.
    awaiting_rollout: list[str] = field(default_factory=list)
    reported_versions: dict[str, int] = field(default_factory=dict)
    advice: bool = False  # speculation.mode advise: a recommendation, nothing pushed or rolled out

    @property
    def predicted_gain(self) -> float | None:
        """Predicted goodput of the decided drafter's policy over plain decoding (None: not measured)."""
        d = self.decision
        return None if d is None else d.scores.get(d.drafter)


@dataclass
class _Read:
    at: float
    snapshot: FleetSnapshot
    costs: core.FleetCosts | None = None
    costs_views: int = 0  # resources the costs were pooled over (a newly seen one means pool again)


class _Token:
    """A resource's control token during one tick. After a 401 it is re-read, at most once per tick
    (the Secret was rotated), and the call is made again with the new token."""

    def __init__(
        self,
        token: str | None,
        refresh: TokenRefresh | None,
        session: aiohttp.ClientSession,
        timeout_s: float,
    ) -> None:
        self.token = token
        self._refresh = refresh
        self._refreshed = False
        self._lock = asyncio.Lock()
        self._session = session
        self._timeout_s = timeout_s

    async def call(self, url: str, method: Callable[..., Awaitable[T]], *args: PolicyRequest) -> T:
        """`method` (a SidecarClient method) on the sidecar at `url`; raises SidecarError."""
        used = self.token
        try:
            return await method(SidecarClient(url, used, self._session, self._timeout_s), *args)
        except SidecarError as exc:
            if exc.status != 401 or not await self._renewed(used):
                raise
        return await method(SidecarClient(url, self.token, self._session, self._timeout_s), *args)

    async def _renewed(self, used: str | None) -> bool:
        """Whether a token other than `used` is known now."""
        async with self._lock:
            if self.token == used and self._refresh is not None and not self._refreshed:
                self._refreshed = True
                try:
                    self.token = await self._refresh()
                except Exception:  # the Kubernetes API failed: the 401 stands, next tick reads again
                    log.exception("re-reading the control token failed")
        return self.token != used


def _holds(held: SidecarState, request: PolicyRequest) -> bool:
    """Whether a sidecar reporting `held` runs `request` (or the same policy under a newer version)."""
    running = (held.drafter, held.mode, held.k_by_bucket)
    wanted = (request.drafter, request.mode, request.k_by_bucket)
    return running == wanted and held.policy_version >= request.policy_version


class FleetController:
    """Holds every resource's controller state; shares one fleet read per Prometheus URL between the
    resources whose ticks fall within `max_age_s` of it."""

    def __init__(
        self,
        default_prometheus_url: str,
        session: aiohttp.ClientSession,
        *,
        window_s: float = 300.0,
        timeout_s: float = 5.0,
        max_age_s: float = 5.0,
        # Durations only (cooldowns, backoff, canary ends): a wall clock that steps would stretch them.
        clock: Callable[[], float] = time.monotonic,
        reader_factory: Callable[[str], PrometheusReader] | None = None,
        sidecar_timeout_s: float = SIDECAR_TIMEOUT_S,
        fan_out: int = FAN_OUT,
    ) -> None:
        self.default_url = default_prometheus_url
        self.session = session
        self.window_s = window_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.sidecar_timeout_s = sidecar_timeout_s
        self._fan_out = asyncio.Semaphore(fan_out)
        self._reader_factory = reader_factory or (
            lambda url: PrometheusReader(url, window_s=window_s, timeout_s=timeout_s)
        )
        self.readers: dict[str, PrometheusReader] = {}
        self.states: dict[tuple[str, str], core.ResourceState] = {}
        self.views: dict[tuple[str, str], core.ResourceView] = {}
        self.uids: dict[tuple[str, str], str] = {}  # the resource object each key's state belongs to
        # resource → pod → the policy last applied there (what a sidecar that lost it is given back)
        self.applied: dict[tuple[str, str], dict[str, PolicyRequest]] = {}
        self._reads: dict[str, _Read] = {}
        self._backoff: dict[str, Backoff] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.ratios = tuner_policy.RatioMemory()  # measured step-time ratios, remembered across ticks
        self.advising: set[tuple[str, str]] = set()  # resources whose last decision was advice
        # The recommendation series each resource set last: (gauge, label values).
        self._gauges: dict[tuple[str, str], list[tuple[Gauge, tuple]]] = {}
        self._actions: dict[tuple[str, str], set[str]] = {}  # the decision counter's series per resource

    def url_for(self, view: core.ResourceView) -> str:
        return view.spec.monitoring.prometheus_url or self.default_url

    def forget(self, key: tuple[str, str]) -> None:
        """Drop all a resource left behind (it was deleted, or made again under a new uid): its state,
        what its pods were given, its metric series, and the reads of a Prometheus no resource uses."""
        self._set_gauges(key, [], [])
        for action in self._actions.pop(key, ()):
            with contextlib.suppress(KeyError):
                DECISIONS.remove(*key, action)
        for store in (self.states, self.views, self.uids, self.applied, self._gauges):
            store.pop(key, None)
        self.advising.discard(key)
        used = {self.url_for(view) for view in self.views.values()}
        for per_url in (self.readers, self._reads, self._backoff, self._locks):
            for url in set(per_url) - used:
                del per_url[url]

    def _owner(self, key: tuple[str, str], uid: str | None) -> None:
        """A resource deleted and made again under the same name starts afresh."""
        if uid is not None and self.uids.get(key, uid) != uid:
            self.forget(key)
        if uid is not None:
            self.uids[key] = uid

    async def read(self, url: str, now: float) -> _Read:
        """The fleet behind `url`, read at most once per `max_age_s`; raises MetricsUnavailable, and
        while backing off after a failure raises the last error again without asking Prometheus."""
        lock = self._locks.setdefault(url, asyncio.Lock())
        async with lock:
            cached = self._reads.get(url)
            if cached is not None and now - cached.at < self.max_age_s:
                return cached
            # The expired read goes (the cache's reference and this frame's) before the next one is made:
            # held while its successor is folded, a large fleet's snapshot would add to the peak memory.
            self._reads.pop(url, None)
            del cached
            backoff = self._backoff.setdefault(url, Backoff())
            if now < backoff.retry_at and backoff.error is not None:
                raise backoff.last_error()
            reader = self.readers.get(url) or self.readers.setdefault(url, self._reader_factory(url))
            try:
                snapshot = await asyncio.to_thread(reader.read)
            except MetricsUnavailable as exc:
                backoff.fail(exc, now)
                raise
            backoff.ok()
            read = _Read(now, snapshot)
            self._reads[url] = read
            return read

    def _costs(self, url: str, read: _Read, now: float) -> core.FleetCosts:
        if read.costs is None or read.costs_views != len(self.views):
            views = [v for v in self.views.values() if self.url_for(v) == url]
            mixed = {
                (v.namespace, pod)
                for v in views
                if v.key in self.states
                for pod in self.states[v.key].switched_pods(now, self.window_s)
            }
            read.costs = core.FleetCosts(views, read.snapshot, mixed, self.ratios, now)
            read.costs_views = len(self.views)
        return read.costs

    def state_for(self, view: core.ResourceView, status: Mapping | None) -> core.ResourceState:
        if view.key not in self.states:
            self.states[view.key] = core.ResourceState.initial(view.spec, status)
        return self.states[view.key]

    async def decide(
        self, view: core.ResourceView, status: Mapping | None = None, *, uid: str | None = None
    ) -> ResourceTick:
        """Read (shared) and decide for one resource, without pushing. `uid`: the resource object's, so
        that one made again under the same name inherits nothing. An exception while deciding is this
        resource's alone: the tick carries it in `error`, and the state stays as it was."""
        now = self.clock()
        self._owner(view.key, uid)
        applied = self.applied.get(view.key, {})
        for gone in set(applied) - set(view.pods):
            del applied[gone]
        self.views[view.key] = view
        state = self.state_for(view, status)
        url = self.url_for(view)
        try:
            read = await self.read(url, now)
        except MetricsUnavailable as exc:
            return ResourceTick(None, metrics_error=exc)
        advising = view.spec.speculation.mode == "advise"
        engine_in_pods = state.engine_drafter
        before = state.copy()
        try:
            decision = core.decide(
                _without_canaries(view) if advising else view,
                read.snapshot,
                state,
                self._costs(url, read, now),
                now,
            )
        except Exception as exc:  # bad data or a bug in one resource's decision must not stop the others
            log.exception("deciding for %s/%s failed", *view.key)
            self.states[view.key] = before
            return ResourceTick(None, error=f"{type(exc).__name__}: {exc}")
        if advising:
            # Nothing is rolled out: the engines keep the drafter they were started with.
            state.engine_drafter = engine_in_pods
            decision.rollout_drafter = None
            self.advising.add(view.key)
        elif view.key in self.advising:
            self.advising.discard(view.key)
            _apply_advice(view, state, decision)
        DECISIONS.labels(view.namespace, view.name, decision.action).inc()
        self._actions.setdefault(view.key, set()).add(decision.action)
        reported = {
            pod: obs.policy_version
            for pod in view.pods
            if (obs := read.snapshot.pods.get((view.namespace, pod))) is not None
            and obs.policy_version is not None
        }
        tick = ResourceTick(decision, reported_versions=reported, advice=advising)
        self._export(view, tick)
        return tick

    def _export(self, view: core.ResourceView, tick: ResourceTick) -> None:
        d = tick.decision
        assert d is not None
        mode = view.spec.speculation.mode
        k_labels = [
            (view.namespace, view.name, mode, d.drafter, b, float(k)) for b, k in d.k_by_bucket.items()
        ]
        gain = tick.predicted_gain
        gain_labels = [] if gain is None else [(view.namespace, view.name, mode, d.drafter, gain)]
        self._set_gauges(view.key, k_labels, gain_labels)

    def _set_gauges(self, key: tuple[str, str], k_labels: list[tuple], gain_labels: list[tuple]) -> None:
        """Set this resource's recommendation gauges, removing the series it set before and no longer
        sets (another drafter or mode), so that dashboards never show a stale recommendation."""
        now = {(RECOMMENDED_K, labels[:-1]) for labels in k_labels}
        now |= {(PREDICTED_GAIN, labels[:-1]) for labels in gain_labels}
        for gauge, labels in set(self._gauges.get(key, ())) - now:
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        for labels in k_labels:
            RECOMMENDED_K.labels(*labels[:-1]).set(labels[-1])
        for labels in gain_labels:
            PREDICTED_GAIN.labels(*labels[:-1]).set(labels[-1])
        self._gauges[key] = list(now)

    async def tick(
        self,
        view: core.ResourceView,
        endpoints: Mapping[str, str],
        token: str | None,
        status: Mapping | None = None,
        *,
        uid: str | None = None,
        refresh_token: TokenRefresh | None = None,
    ) -> ResourceTick:
        """Decide for one resource and bring each pod's sidecar to its policy (endpoints: pod → sidecar
        base URL). `refresh_token` reads the token again after a 401 (a rotated Secret)."""
        started = time.perf_counter()
        result = await self.decide(view, status, uid=uid)
        targets = self._targets(view, result)
        if targets:
            tokens = _Token(token, refresh_token, self.session, self.sidecar_timeout_s)
            await self._sync(view.key, result, targets, endpoints, tokens)
        TICK_SECONDS.observe(time.perf_counter() - started)
        return result

    def _targets(self, view: core.ResourceView, result: ResourceTick) -> dict[str, PolicyRequest]:
        """The policy each pod should run: the decision's; where nothing new is pushed (metrics
        unavailable or missing, deciding failed, advise mode) the one last applied there, so that a
        sidecar that restarted meanwhile gets back the policy in force rather than its start-up one
        (fail static)."""
        d = result.decision
        if d is None or result.advice or not d.push:
            applied = self.applied.get(view.key, {})
            return {pod: applied[pod] for pod in view.pods if pod in applied}
        version = self.states[view.key].policy_version
        return {
            pod: PolicyRequest(
                policyVersion=version, drafter=target.drafter, mode=target.mode, kByBucket=target.k_by_bucket
            )
            for pod, target in d.pods.items()
        }

    async def _sync(
        self,
        key: tuple[str, str],
        result: ResourceTick,
        targets: Mapping[str, PolicyRequest],
        endpoints: Mapping[str, str],
        tokens: _Token,
    ) -> None:
        """Every pod at once, at most FAN_OUT calls in flight over all resources."""

        async def one(pod: str, request: PolicyRequest) -> None:
            url = endpoints.get(pod)
            if url is None:
                result.unreachable[pod] = "no sidecar address (pod not ready)"
                return
            async with self._fan_out:
                await self._sync_pod(key, pod, url, request, result, tokens)

        await asyncio.gather(*(one(pod, request) for pod, request in targets.items()))
        result.pushed.sort()
        result.awaiting_rollout.sort()

    async def _sync_pod(
        self,
        key: tuple[str, str],
        pod: str,
        url: str,
        request: PolicyRequest,
        result: ResourceTick,
        tokens: _Token,
    ) -> None:
        """Ask the sidecar what it runs (GET /v1/state) and push `request` where that differs.

        What a pod runs is read from the sidecar itself on every tick rather than from the scraped
        policy-info metric: the metric lags a scrape interval and the metrics window, so a sidecar that
        restarted would run its start-up policy that long, and a push just made would look like drift.
        The price is one small request per pod per evaluation interval, made concurrently."""
        applied = self.applied.setdefault(key, {})
        last = applied.get(pod)
        try:
            held = await tokens.call(url, SidecarClient.state)
        except SidecarError as exc:
            result.unreachable[pod] = str(exc)
            return
        loading = held.pending_drafter == request.drafter and last == request  # accepted (202) earlier
        if _holds(held, request) or loading:
            applied[pod] = request
            return
        if request.drafter not in {d.name for d in held.drafters}:
            result.awaiting_rollout.append(pod)
            return
        if last is not None and not _holds(held, last):
            result.restored[pod] = (
                f"ran policy version {held.policy_version} (drafter {held.drafter}, mode {held.mode}) "
                f"instead of version {last.policy_version}"
            )
        error, sent = await self._put(url, request, self.states[key], tokens)
        if error is None:
            applied[pod] = sent
            result.pushed.append(pod)
        else:
            result.unreachable[pod] = error

    async def _put(
        self, url: str, request: PolicyRequest, state: core.ResourceState, tokens: _Token
    ) -> tuple[str | None, PolicyRequest]:
        """Apply a policy; returns None and the request sent on success, else why not. A 409 means the
        pod holds this version or a newer one (an operator restart lost count): continue numbering above
        it, for every pod of the resource."""
        error = "not tried"
        for attempt in range(PUSH_ATTEMPTS):
            try:
                await tokens.call(url, SidecarClient.put_policy, request)
                return None, request
            except SidecarError as exc:
                error = str(exc)
                if exc.status == 409:
                    try:
                        held = (await tokens.call(url, SidecarClient.state)).policy_version
                    except SidecarError as inner:
                        return f"{error}; then {inner}", request
                    state.policy_version = max(state.policy_version, held + 1, request.policy_version + 1)
                    request = request.model_copy(update={"policy_version": state.policy_version})
                    continue
                if exc.status is not None and exc.status < 500:
                    return error, request  # refused (422, 401): retrying the same request cannot help
                if attempt + 1 < PUSH_ATTEMPTS:
                    await asyncio.sleep(0.2)
        return error, request

    async def decide_all(self, views: Iterable[core.ResourceView]) -> dict[tuple[str, str], ResourceTick]:
        """Decide for many resources in one tick (one read per Prometheus), without pushing; a resource
        whose decision fails gets a tick with `error`, the others go on."""
        views = list(views)
        for view in views:
            self.views[view.key] = view
        return {view.key: await self.decide(view) for view in views}


def _without_canaries(view: core.ResourceView) -> core.ResourceView:
    """The view advise mode decides on: no exploration share, so no canary and no trial is started."""
    speculation = view.spec.speculation.model_copy(update={"exploration_share": 0.0})
    spec = view.spec.model_copy(update={"speculation": speculation})
    return dataclasses.replace(view, spec=spec)


def _apply_advice(view: core.ResourceView, state: core.ResourceState, decision: core.Decision) -> None:
    """The first decision back in auto after advise: it puts the recommendation in force, so it counts as
    a change (an Event, lastDecision), and rolls the pods out first where the recommended drafter is one
    the running engines cannot switch to live."""
    decision.changed = True
    decision.reason = f"applying the recommendation made in advise mode; {decision.reason}"
    drafters = {d.name: d for d in view.spec.drafters}
    active = drafters.get(state.drafter)
    needs_restart = active is not None and not core.live_switchable(active, state.engine_drafter)
    if decision.rollout_drafter is None and active is not None and needs_restart:
        decision.rollout_drafter = active.name
        decision.action = "rollout"
        state.engine_drafter = active.name if active.placement == "colocated" else None
