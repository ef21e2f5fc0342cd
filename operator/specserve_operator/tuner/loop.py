"""The controller's I/O: one shared fleet read per Prometheus per tick, a decision per resource, the
policy pushed to every pod's sidecar. Used by the kopf timer (timer.py) and by the local fleet.

Faults fail static: when Prometheus is down, slow or answers garbage, nothing is decided or pushed (each
pod keeps the policy in force) and reads back off exponentially; a sidecar that does not answer is
retried on the next tick while the other pods are served.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import Counter, Histogram

from specserve_engine import metric_names as mn
from specserve_engine.api import PolicyRequest
from specserve_engine.client import SidecarClient, SidecarError
from specserve_operator.tuner import core
from specserve_operator.tuner import policy as pol
from specserve_operator.tuner.observations import FleetSnapshot
from specserve_operator.tuner.reader import MetricsUnavailable, PrometheusReader

DECISIONS = Counter(
    mn.OPERATOR_DECISIONS.name, mn.OPERATOR_DECISIONS.help, list(mn.OPERATOR_DECISIONS.labels)
)
TICK_SECONDS = Histogram(mn.OPERATOR_TICK_SECONDS.name, mn.OPERATOR_TICK_SECONDS.help)

BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0
PUSH_ATTEMPTS = 2


@dataclass
class Backoff:
    failures: int = 0
    retry_at: float = -math.inf
    error: MetricsUnavailable | None = None

    def fail(self, error: MetricsUnavailable, now: float) -> None:
        self.failures += 1
        self.error = error
        self.retry_at = now + min(BACKOFF_BASE_S * 2 ** (self.failures - 1), BACKOFF_MAX_S)

    def ok(self) -> None:
        self.failures, self.retry_at, self.error = 0, -math.inf, None


@dataclass
class ResourceTick:
    """What one tick did for one resource: the decision (None when metrics were unavailable), pods that
    did not take their policy, and the metrics error if any."""

    decision: core.Decision | None
    metrics_error: MetricsUnavailable | None = None
    unreachable: dict[str, str] = field(default_factory=dict)
    pushed: list[str] = field(default_factory=list)


@dataclass
class _Read:
    at: float
    snapshot: FleetSnapshot
    costs: core.FleetCosts | None = None
    costs_views: int = 0  # resources the costs were pooled over (a newly seen one means pool again)


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
        clock: Callable[[], float] = time.time,
        reader_factory: Callable[[str], PrometheusReader] | None = None,
    ) -> None:
        self.default_url = default_prometheus_url
        self.session = session
        self.window_s = window_s
        self.max_age_s = max_age_s
        self.clock = clock
        self._reader_factory = reader_factory or (lambda url: PrometheusReader(url, window_s, timeout_s))
        self.readers: dict[str, PrometheusReader] = {}
        self.states: dict[tuple[str, str], core.ResourceState] = {}
        self.views: dict[tuple[str, str], core.ResourceView] = {}
        self.pushed: dict[tuple[str, str], PolicyRequest] = {}
        self._reads: dict[str, _Read] = {}
        self._backoff: dict[str, Backoff] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.ratios = pol.RatioMemory()  # measured step-time ratios, remembered across ticks

    def url_for(self, view: core.ResourceView) -> str:
        return view.spec.monitoring.prometheus_url or self.default_url

    def forget(self, key: tuple[str, str]) -> None:
        self.states.pop(key, None)
        self.views.pop(key, None)

    async def read(self, url: str, now: float) -> _Read:
        """The fleet behind `url`, read at most once per `max_age_s`; raises MetricsUnavailable, and
        while backing off after a failure raises the last error without asking Prometheus."""
        lock = self._locks.setdefault(url, asyncio.Lock())
        async with lock:
            cached = self._reads.get(url)
            if cached is not None and now - cached.at < self.max_age_s:
                return cached
            backoff = self._backoff.setdefault(url, Backoff())
            if now < backoff.retry_at and backoff.error is not None:
                raise backoff.error
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

    async def decide(self, view: core.ResourceView, status: Mapping | None = None) -> ResourceTick:
        """Read (shared) and decide for one resource, without pushing."""
        now = self.clock()
        previous = self.views.get(view.key)
        for gone in set(previous.pods if previous else ()) - set(view.pods):
            self.pushed.pop((view.namespace, gone), None)
        self.views[view.key] = view
        state = self.state_for(view, status)
        url = self.url_for(view)
        try:
            read = await self.read(url, now)
        except MetricsUnavailable as exc:
            return ResourceTick(None, metrics_error=exc)
        decision = core.decide(view, read.snapshot, state, self._costs(url, read, now), now)
        DECISIONS.labels(view.namespace, view.name, decision.action).inc()
        return ResourceTick(decision)

    async def tick(
        self,
        view: core.ResourceView,
        endpoints: Mapping[str, str],
        token: str | None,
        status: Mapping | None = None,
    ) -> ResourceTick:
        """Decide for one resource and push each pod its policy (endpoints: pod → sidecar base URL)."""
        started = time.perf_counter()
        result = await self.decide(view, status)
        if result.decision is not None:
            await self._push(view, result, endpoints, token)
        TICK_SECONDS.observe(time.perf_counter() - started)
        return result

    async def _push(
        self, view: core.ResourceView, result: ResourceTick, endpoints: Mapping[str, str], token: str | None
    ) -> None:
        decision = result.decision
        assert decision is not None
        state = self.states[view.key]
        for pod, target in decision.pods.items():
            url = endpoints.get(pod)
            if url is None:
                result.unreachable[pod] = "no sidecar address (pod not ready)"
                continue
            request = PolicyRequest(
                policyVersion=state.policy_version,
                drafter=target.drafter,
                mode=target.mode,
                kByBucket=target.k_by_bucket,
            )
            if self.pushed.get((view.namespace, pod)) == request:
                continue
            client = SidecarClient(url, token, self.session)
            error = await self._put(client, request, state)
            if error is None:
                self.pushed[(view.namespace, pod)] = request.model_copy(
                    update={"policy_version": state.policy_version}
                )
                result.pushed.append(pod)
            else:
                result.unreachable[pod] = error

    async def _put(
        self, client: SidecarClient, request: PolicyRequest, state: core.ResourceState
    ) -> str | None:
        """Apply a policy; None on success, else why not. A 409 means the pod holds a newer version
        (an operator restart lost count): continue numbering above it."""
        error = "not tried"
        for attempt in range(PUSH_ATTEMPTS):
            try:
                await client.put_policy(request)
                return None
            except SidecarError as exc:
                error = str(exc)
                if exc.status == 409:
                    try:
                        held = (await client.state()).policy_version
                    except SidecarError as inner:
                        return f"{error}; then {inner}"
                    state.policy_version = max(state.policy_version, held) + 1
                    request = request.model_copy(update={"policy_version": state.policy_version})
                    continue
                if exc.status is not None and exc.status < 500:
                    return error  # refused (422, 401): retrying the same request cannot help
                if attempt + 1 < PUSH_ATTEMPTS:
                    await asyncio.sleep(0.2)
        return error

    async def decide_all(self, views: Iterable[core.ResourceView]) -> dict[tuple[str, str], ResourceTick]:
        """Decide for many resources in one tick (one read per Prometheus), without pushing."""
        views = list(views)
        for view in views:
            self.views[view.key] = view
        return {view.key: await self.decide(view) for view in views}
