"""The controller's I/O: one shared fleet read per Prometheus per tick, a decision per resource, the
policy pushed to every pod's sidecar. Used by the kopf timer (timer.py) and by the local fleet.

speculation.mode advise decides as auto does, from the same remembered state, but without canaries or
trials, and pushes nothing and rolls nothing out: the decision is a recommendation (status, Events and
the recommended-K metrics show it). Back in auto, the next tick pushes the recommended policy, and rolls
the pods out first where its drafter needs an engine restart; from auto to advise the pods keep theirs.

Faults fail static: when Prometheus is down, slow or answers garbage, nothing is decided or pushed (each
pod keeps the policy in force) and reads back off exponentially; a sidecar that does not answer is
retried on the next tick while the other pods are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import Counter, Gauge, Histogram

from specserve_engine import metric_names
from specserve_engine.api import PolicyRequest
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
    did not take their policy, the metrics error if any, and the policy version each pod reports in force
    (its sidecar's policy-info metric, as read this tick)."""

    decision: core.Decision | None
    metrics_error: MetricsUnavailable | None = None
    unreachable: dict[str, str] = field(default_factory=dict)
    pushed: list[str] = field(default_factory=list)
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
        self.ratios = tuner_policy.RatioMemory()  # measured step-time ratios, remembered across ticks
        self.advising: set[tuple[str, str]] = set()  # resources whose last decision was advice
        # The recommendation series each resource set last: (gauge, label values).
        self._gauges: dict[tuple[str, str], list[tuple[Gauge, tuple]]] = {}

    def url_for(self, view: core.ResourceView) -> str:
        return view.spec.monitoring.prometheus_url or self.default_url

    def forget(self, key: tuple[str, str]) -> None:
        self.states.pop(key, None)
        self.views.pop(key, None)
        self.advising.discard(key)
        self._set_gauges(key, [], [])

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
        advising = view.spec.speculation.mode == "advise"
        engine_in_pods = state.engine_drafter
        decision = core.decide(
            _without_canaries(view) if advising else view,
            read.snapshot,
            state,
            self._costs(url, read, now),
            now,
        )
        if advising:
            # Nothing is rolled out: the engines keep the drafter they were started with.
            state.engine_drafter = engine_in_pods
            decision.rollout_drafter = None
            self.advising.add(view.key)
        elif view.key in self.advising:
            self.advising.discard(view.key)
            _apply_advice(view, state, decision)
        DECISIONS.labels(view.namespace, view.name, decision.action).inc()
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
    ) -> ResourceTick:
        """Decide for one resource and push each pod its policy (endpoints: pod → sidecar base URL)."""
        started = time.perf_counter()
        result = await self.decide(view, status)
        if result.decision is not None and not result.advice:
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
