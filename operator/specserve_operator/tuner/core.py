"""One controller decision for one SpeculativeServing: snapshot + remembered state → the policy per pod.

Pure: no I/O, the clock is an argument. The operator's timer (timer.py) and the fleet simulator
(specserve_operator.simulator) both call `decide`, so the simulator runs the real controller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from specserve_engine.buckets import bucket_for, bucket_labels
from specserve_operator.api.models import DrafterSpec, SpeculationSpec, SpeculativeServingSpec
from specserve_operator.render.children import initial_policy, with_active_drafter
from specserve_operator.tuner import policy
from specserve_operator.tuner.costmodel import StepCostPrior, drafter_cost, gpu_spec, known_gpu, model_shape
from specserve_operator.tuner.observations import (
    BucketStats,
    FleetSnapshot,
    PodObservation,
    acceptance_window_of,
    stats_of,
)

# A drafter beats the one in force only by this much predicted goodput (no switching on noise).
SWITCH_MARGIN = 0.05
# Every drafter that could serve is tried on a canary pod this often, for TRIAL_TICKS evaluations.
TRIAL_PERIOD_S = 1200.0
TRIAL_TICKS = 4
EARLY_TRIAL_GAP_TICKS = 2 * TRIAL_TICKS  # the least time between two trials of a drafter before its period
EXPLORE_TICKS = 2
# A neighbouring K predicted this much below the K in force (or better) is probed (_k_probe).
PROBE_SHORTFALL = 0.1
# A demotion is reconsidered (the drafter tried again) after this long: traffic changes.
DEMOTION_TTL_S = 3600.0
# A drafter's last measured acceptance stands in for the prior this long: acceptance follows the traffic.
ACCEPTANCE_TTL_S = 3600.0
# Acceptance sources from this window's drafts: the engine's own counts of live drafts, else the sidecar's
# scores of shadow drafts on the same traffic (docs/policy.md, "Shadow acceptance").
MEASURED_NOW = ("measured", "totals", "shadow")
FRESH_ACCEPTANCE = ("measured", "shadow")  # per-position counts from the acceptance window
# A drafter's acceptance this tick when its own counters were refused (measured_acceptance).
REFUSED = "refused"
DEFAULT_GPU = "NVIDIA-H100"
# Decision.warnings keys: condition reasons (CamelCase) the operator reports on the resource.
METRICS_MISSING = "MetricsMissing"  # no pod of the resource has engine metrics yet: nothing is pushed
PARTIAL_DATA = "PartialData"  # some pods have no engine metrics: the policy in force stays
UNKNOWN_GPU = "UnknownGpu"  # engine.gpu.product is not in the cost model's table: a generic prior
DRAFTER_ERRORS = "DrafterErrors"  # a drafter's sidecar calls failed in the window
INVALID_METRICS = "InvalidMetrics"  # values read for the resource's pods were refused (observations.py)


def live_switchable(drafter: DrafterSpec, engine_drafter: str | None) -> bool:
    """Whether pods can run `drafter` without a restart. An engine started with a colocated drafter
    (vLLM's own method) runs only that one; an engine started with the sidecar proposer (custom_class,
    `engine_drafter` None) switches live among the sidecar-hosted drafters (docs/sidecar.md, "What
    switches live, and how")."""
    if engine_drafter is not None:
        return drafter.name == engine_drafter
    return drafter.placement != "colocated"


@dataclass(frozen=True)
class ResourceView:
    """What the controller needs of one resource: its spec and its ready pods."""

    namespace: str
    name: str
    spec: SpeculativeServingSpec
    pods: tuple[str, ...]

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def gpu_product(self) -> str:
        return self.spec.engine.gpu.product or DEFAULT_GPU

    @property
    def gpu_known(self) -> bool:
        return known_gpu(self.gpu_product) is not None

    def cost_group(self, drafter: DrafterSpec) -> tuple[str, str, int, str, str, bool]:
        """Step-time measurements are shared by every resource with the same model, GPU and drafter (a head
        drafting in parallel, P-EAGLE, costs differently from the same head drafting in sequence)."""
        return (
            self.spec.model.name,
            self.gpu_product,
            self.spec.model.tensor_parallel_size,
            drafter.method,
            drafter.source or "",
            drafter.parallel_drafting,
        )

    def prior(self, drafter: DrafterSpec) -> StepCostPrior:
        context = float(min(self.spec.model.max_model_len or 2048, 2048)) / 2
        return StepCostPrior(
            model=model_shape(self.spec.model.name),
            gpu=gpu_spec(self.gpu_product),
            drafter=drafter_cost(drafter.method, drafter.parallel_drafting),
            context_len=context,
            tp=self.spec.model.tensor_parallel_size,
        )


@dataclass
class Canary:
    pod: str
    drafter: str
    k_by_bucket: dict[str, int]
    until: float
    purpose: str  # explore | trial
    # An explore of a bucket whose step times are known, to measure the drafter's acceptance again.
    remeasure: bool = False


@dataclass
class ResourceState:
    """What the controller remembers about one resource between ticks (the desired policy)."""

    drafter: str
    k_by_bucket: dict[str, int]
    engine_drafter: str | None  # the colocated drafter the running engines were started with
    policy_version: int = 0
    flipped_at: dict[str, float] = field(default_factory=dict)
    # Buckets turned off while their plain step was not measured in the window: the gain that turned
    # them off compared measured speculative steps with a remembered plain step (k_table).
    off_on_estimate: set[str] = field(default_factory=set)
    # Off buckets a canary measures the drafter's acceptance in again (a remeasure explore), to when the
    # canary ends: a measurement on the traffic of now, not noise, so their cooldown is waived (k_table).
    remeasured_until: dict[str, float] = field(default_factory=dict)
    last_switch_at: float = -math.inf
    canary: Canary | None = None
    canary_round: int = 0
    last_explore_at: float = -math.inf
    # The bucket with the most steps in the acceptance window at the last tick, whether the batches have
    # moved to a smaller bucket since the last canary started, and when an explore last went early for it.
    mix_bucket: str | None = None
    load_fell: bool = False
    early_explore_at: float = -math.inf
    last_trial_at: dict[str, float] = field(default_factory=dict)
    under_floor_since: dict[str, float] = field(default_factory=dict)
    demoted: dict[str, float] = field(default_factory=dict)
    cliff: int | None = None
    pod_drafter: dict[str, tuple[str, float]] = field(default_factory=dict)  # pod → (drafter, since)
    last_score: dict[str, float] = field(default_factory=dict)  # drafter → its last measured score
    # Whether the policy was ever decided on measurements (or pushed, per status): until then it is only
    # the one the pods start with, and a tick without metrics pushes nothing.
    decided: bool = False
    # drafter → (its last measured acceptance, when): used while it makes no drafts (every bucket off)
    acceptance_seen: dict[str, tuple[policy.Acceptance, float]] = field(default_factory=dict)

    def copy(self) -> ResourceState:
        """A copy to roll back to, its containers copied one level: what they hold is never changed in
        place (numbers, strings, tuples, frozen Acceptances; a Canary is replaced, not edited), and a
        large fleet copies every resource's state each tick, where deepcopy walked every item."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict | set):
                setattr(out, f.name, value.copy())
        return out

    def switched_pods(self, now: float, window_s: float) -> set[str]:
        """Pods whose drafter changed within the metrics window: where the engine's step counters carry
        no drafter label (an engine from before it), their speculative step times mix two drafters and
        calibration skips them."""
        return {pod for pod, (_, since) in self.pod_drafter.items() if now - since < window_s}

    @classmethod
    def initial(cls, spec: SpeculativeServingSpec, status: Mapping | None = None) -> ResourceState:
        """A fresh state, resuming from what status recorded (an operator restart keeps the policy)."""
        status = status or {}
        first = spec.initial_drafter
        names = {d.name for d in spec.drafters}
        drafter = status.get("activeDrafter") if status.get("activeDrafter") in names else None
        drafter = drafter or (first.name if first else "")
        engine = next(
            (d.name for d in spec.drafters if d.name == drafter and d.placement == "colocated"), None
        )
        if engine is None and first is not None and first.placement == "colocated":
            engine = first.name
        labels = bucket_labels(spec.speculation.batch_buckets)
        k_status = status.get("kByBucket")
        if k_status:
            k_by_bucket = {label: int(k_status.get(label, 0)) for label in labels}
        elif drafter:
            # Nothing pushed yet: the pods run the policy they were rendered with.
            k_by_bucket = dict(initial_policy(with_active_drafter(spec, drafter)).k_by_bucket)
        else:
            k_by_bucket = dict.fromkeys(labels, 0)
        return cls(
            drafter=drafter,
            k_by_bucket=k_by_bucket,
            engine_drafter=engine,
            policy_version=int(status.get("policyVersion") or 0),
            cliff=status.get("cliffBatchSize"),
            decided=bool(k_status),
        )


@dataclass(frozen=True)
class PodTarget:
    drafter: str
    mode: str  # on | off
    k_by_bucket: dict[str, int]


@dataclass
class Decision:
    action: (
        str  # hold | enable | disable | setK | switchDrafter | rollout | explore | trial | demote | noData
    )
    reason: str
    changed: bool
    policy_version: int
    drafter: str
    k_by_bucket: dict[str, int]
    cliff: int | None
    pods: dict[str, PodTarget]
    rollout_drafter: str | None = None
    fleet_mal: dict[str, float] = field(default_factory=dict)
    mean_accepted_length: float | None = None
    acceptance_rate: float | None = None
    gpu_utilization: float | None = None
    pod_mal: dict[str, float | None] = field(default_factory=dict)
    pod_batch: dict[str, float | None] = field(default_factory=dict)
    pod_drafter: dict[str, str | None] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    demoted: tuple[str, ...] = ()
    # False: push nothing this tick, every pod keeps the policy it runs (no engine metrics from any pod,
    # and no policy decided on metrics yet: nothing may replace the policy the pods started with).
    push: bool = True
    # Condition reason (CamelCase, the constants above) → message: what the operator should show on the
    # resource although the decision went through (an unknown GPU, missing metrics, a failing drafter).
    warnings: dict[str, str] = field(default_factory=dict)


def engine_of(group: tuple) -> tuple:
    """The engine of a cost group (`ResourceView.cost_group`): model, GPU and TP, without the drafter."""
    return group[:3]


class CostModelError(Exception):
    """Step costs could not be set up for one resource or cost group; only that resource fails."""


class FleetCosts:
    """Calibrated step-time models, one per (model, GPU, TP, drafter) group, pooled over every pod of
    every resource in that group: what one resource learns about the hardware, all use. Plain steps run
    the target alone, whatever drafter is in force: every group of one engine (same model, GPU and TP)
    calibrates its plain step on all of that engine's plain steps, so a drafter never in force (its
    speculative steps measured only on a canary) does not rest on the prior's plain step, whose error
    its excess would otherwise absorb. A group without speculative measurements borrows its siblings'
    excess. With `memory` (kept by the caller between ticks), every ratio measured in this window is
    remembered (plain ones per engine), and a bucket without a measurement in the window uses its
    remembered ratio (until `memory.ttl_s` after `now`).

    One resource's failure stays its own: a view whose priors cannot be built, or a group whose
    measurements cannot be calibrated, is left out of the pooling, and `cost` raises CostModelError for
    it alone, so deciding for every other resource goes on."""

    def __init__(
        self,
        views: Iterable[ResourceView],
        snapshot: FleetSnapshot,
        mixed: Iterable[tuple[str, str]] = (),
        memory: policy.RatioMemory | None = None,
        now: float = 0.0,
    ) -> None:
        mixed_pods = set(mixed)
        pooled: dict[tuple, dict[str, BucketStats]] = {}
        self._priors: dict[tuple, StepCostPrior] = {}
        self._bounds: dict[tuple, tuple[int, ...]] = {}
        self._failed: dict[tuple, Exception] = {}  # view key or cost group → why its costs are unknown
        for view in views:
            try:
                priors = {view.cost_group(d): view.prior(d) for d in view.spec.drafters}
                measured = self._pod_stats(view, snapshot, mixed_pods)
            except Exception as exc:  # anything one resource's spec or data raises is that resource's
                self._failed[view.key] = exc
                continue
            for group, prior in priors.items():
                self._priors.setdefault(group, prior)
                self._bounds.setdefault(group, tuple(view.spec.speculation.batch_buckets))
            for group, stats in measured:
                target = pooled.setdefault(group, {})
                for label, s in stats.items():
                    stats_of(target, label).add(s)
        self._pooled = pooled
        self._plain: dict[tuple, dict[str, BucketStats]] = {}
        for group, stats in pooled.items():
            target = self._plain.setdefault(engine_of(group), {})
            for label, s in stats.items():
                stats_of(target, label).add(s.plain_side())
        self._memory, self._now = memory, now
        # Each measured group on its own measurements: what it remembers, and what its siblings borrow.
        self._measured: dict[tuple, policy.CalibratedCost] = {}
        for group in pooled:
            try:
                self._measured[group] = self._calibrated(group, self._priors[group], self._bounds[group])
            except Exception as exc:  # the group's resources fail, not the tick
                self._failed[group] = exc
        if memory is not None:
            # Every group of an engine calibrated on the same plain steps: one record per engine.
            plain = {engine_of(group): measured.plain_ratio for group, measured in self._measured.items()}
            for engine, ratios in plain.items():
                memory.record(engine, ratios, {}, now)
            for group, measured in self._measured.items():
                memory.record(group, {}, measured.excess_ratio, now, measured.excess_by_k)
        self._costs: dict[tuple, policy.CalibratedCost] = {}

    def _calibrated(
        self,
        group: tuple,
        prior: StepCostPrior,
        bounds: tuple[int, ...],
        sibling_excess: float | None = None,
    ) -> policy.CalibratedCost:
        """The group's step times: its engine's plain steps, its own speculative steps, and what memory
        holds of both."""
        stats: dict[str, BucketStats] = {}
        for label, s in self._plain.get(engine_of(group), {}).items():
            stats_of(stats, label).add(s)
        for label, s in self._pooled.get(group, {}).items():
            stats_of(stats, label).add(s.spec_side())
        remembered: policy.Remembered = ({}, {})
        by_k = None
        if self._memory is not None:
            remembered = (
                self._memory.recall(engine_of(group), self._now)[0],
                self._memory.recall(group, self._now)[1],
            )
            by_k = self._memory.recall_by_k(group, self._now)
        return policy.CalibratedCost(prior, stats, bounds, sibling_excess, remembered, by_k)

    @staticmethod
    def _pod_stats(
        view: ResourceView, snapshot: FleetSnapshot, mixed_pods: set[tuple[str, str]]
    ) -> list[tuple[tuple, dict[str, BucketStats]]]:
        """Each pod's bucket counters with their cost groups. Speculative steps labelled with their
        drafter go to that drafter's group, whatever the pod ran before or after in the window; plain
        steps go to the group of the drafter in force. Without drafter labels on step counters (an engine
        from before they were added), a pod whose drafter changed within the window (`mixed_pods`)
        contributes its plain steps only: its speculative steps mix two drafters. Everything is copied
        here, so that whatever a pod's data raises is raised before anything is pooled."""
        by_name = {d.name: d for d in view.spec.drafters}
        out = []
        for pod in view.pods:
            obs = snapshot.pods.get((view.namespace, pod))
            if obs is None or obs.drafter not in by_name:
                continue
            labelled = {
                name: buckets
                for name, buckets in obs.by_drafter.items()
                if any(b.steps_spec > 0 for b in buckets.values())
            }
            plain_only = bool(labelled) or (view.namespace, pod) in mixed_pods
            stats: dict[str, BucketStats] = {}
            for label, s in obs.buckets.items():
                if plain_only:
                    stats[label] = s.plain_side()
                else:
                    stats[label] = BucketStats()
                    stats[label].add(s)
            out.append((view.cost_group(by_name[obs.drafter]), stats))
            for name, buckets in labelled.items():
                if name not in by_name:
                    continue
                spec = {label: b.spec_side() for label, b in buckets.items() if b.steps_spec > 0}
                out.append((view.cost_group(by_name[name]), spec))
        return out

    def cost(self, view: ResourceView, drafter: DrafterSpec) -> policy.CalibratedCost:
        group = view.cost_group(drafter)
        for key in (view.key, group):
            if key in self._failed:
                error = self._failed[key]
                raise CostModelError(f"step costs of {'/'.join(key[:2])}: {error!r}") from error
        if group not in self._costs:
            measured = self._measured.get(group)
            if measured is not None and measured.excess_ratio:
                self._costs[group] = measured
            else:
                siblings = sorted(
                    excess
                    for other, cost in self._measured.items()
                    if engine_of(other) == engine_of(group)
                    and other != group
                    and (excess := cost.measured_excess) is not None
                )
                self._costs[group] = self._calibrated(
                    group,
                    self._priors.get(group) or view.prior(drafter),
                    self._bounds.get(group) or tuple(view.spec.speculation.batch_buckets),
                    siblings[len(siblings) // 2] if siblings else None,
                )
        return self._costs[group]


# ---- decide: a pipeline of pure steps ------------------------------------------------------------------
# decide() runs the steps below in order and carries their results into the ResourceState; each step
# takes what it needs and returns what it found, so each is tested on its own (tests/tuner/test_core.py).


@dataclass(frozen=True)
class ForcedPolicy:
    """What `speculation.mode` imposes whatever was measured."""

    mode: str  # off | on
    drafter: str | None  # None: the drafter in force stays
    k_by_bucket: dict[str, int]


def forced_policy(spec: SpeculativeServingSpec) -> ForcedPolicy | None:
    """Mode off (or no drafter at all): K 0 everywhere. Mode on: the initial drafter at its largest K
    everywhere. Mode auto: None, the controller decides."""
    labels = bucket_labels(spec.speculation.batch_buckets)
    if spec.speculation.mode == "off" or not spec.drafters:
        return ForcedPolicy("off", None, {label: 0 for label in labels})
    if spec.speculation.mode == "on":
        default = spec.initial_drafter or spec.drafters[0]
        return ForcedPolicy("on", default.name, {label: default.max_speculative_tokens for label in labels})
    return None


@dataclass(frozen=True)
class MissingData:
    """Why there is nothing to decide on, and what follows for the pods."""

    action: str  # hold | noData
    reason: str
    warning: str | None  # the condition reason (METRICS_MISSING or PARTIAL_DATA), None when no pods
    push: bool  # False: no pod has metrics (pushed all the same once a policy was decided on metrics)


def missing_data(view: ResourceView, snapshot: FleetSnapshot) -> MissingData | None:
    """What holds the decision back: no ready pod, or a pod without engine metrics.

    No pod with metrics (a new resource, or a Prometheus that never scrapes it): nothing is decided, and
    until a policy was decided on metrics nothing is pushed, so the pods keep the policy they started
    with. Some pods without: deciding on the pods that answered could push the others a policy learned
    from a different load; the remembered policy stays in force (and is pushed, so that a pod started
    later gets it)."""
    if not view.pods:
        return MissingData("hold", "no ready pods", None, push=True)
    missing = [
        p
        for p in view.pods
        if not snapshot.pods.get((view.namespace, p), PodObservation("", "")).has_engine_data
    ]
    if not missing:
        return None
    reason = f"no metrics for pods {', '.join(sorted(missing))}"
    if len(missing) == len(view.pods):
        return MissingData("noData", reason, METRICS_MISSING, push=False)
    return MissingData("noData", reason, PARTIAL_DATA, push=True)


def measured_acceptance(
    drafters: Mapping[str, DrafterSpec], observations: list[PodObservation]
) -> dict[str, policy.Acceptance]:
    """Acceptance per drafter on this resource's traffic in the window. Only drafters measured now are
    compared: an older measurement was taken on another traffic mix (trials and shadow drafts keep the
    others fresh). In order: the engine's per-position counts of live drafts in the acceptance window;
    the sidecars' scores of shadow drafts in that same window; the live drafts' totals over the metrics
    window. Shadow scores come before those totals: a drafter switched out within the metrics window
    still has live totals there, from the traffic before the switch, while the shadow measures it on
    this traffic (docs/policy.md, "Two windows").

    A drafter whose counters were refused on some pod (observations.py) is measured by the other pods'
    live counts or not at all: a weaker source standing in for the refused one would measure something
    else (its shadow drafts, say, on other steps), and the policy would move on what the bad values took
    away. It is then `refused`, and recalled_acceptance holds its last good measurement."""
    accs: dict[str, policy.Acceptance] = {}
    for name, d in drafters.items():
        stats, fallback = _pooled_acceptance_stats(observations, name)
        acc = policy.acceptance(stats, d.max_speculative_tokens, fallback if fallback.drafts else None)
        if acc.source != "measured":
            if any(name in obs.refused_drafters for obs in observations):
                acc = dataclasses.replace(acc, source=REFUSED)
            else:
                stats, rows = _pooled_shadow(observations, name)
                shadow = policy.acceptance(stats, d.max_speculative_tokens)
                if shadow.source == "measured":
                    rate = policy.shadow_proposal_rate(stats, rows)
                    acc = dataclasses.replace(shadow, source="shadow", proposal_rate=rate)
        accs[name] = acc
    return accs


def _pooled_shadow(observations: list[PodObservation], drafter: str) -> tuple[BucketStats, float]:
    """A drafter's shadow counts over the resource's pods, and the rows they drafted for. A pod whose
    sidecar does not count rows adds drafts without rows: while such pods remain, the rate reads high
    (at most 1, what it read before rows were counted)."""
    stats, rows = BucketStats(), 0.0
    for obs in observations:
        shadow = obs.shadow.get(drafter)
        if shadow is not None:
            stats.add(shadow)
            rows += obs.shadow_rows.get(drafter, 0.0)
    return stats, rows


def recalled_acceptance(
    accs: Mapping[str, policy.Acceptance],
    seen: Mapping[str, tuple[policy.Acceptance, float]],
    now: float,
    acceptance_window_s: float = 0.0,
) -> tuple[dict[str, policy.Acceptance], dict[str, tuple[policy.Acceptance, float]]]:
    """Measurement before prior: a drafter with no drafts in the window (every bucket off) keeps its last
    measured acceptance, as `remembered`, for ACCEPTANCE_TTL_S; the prior only stands for drafters never
    measured. A drafter whose counters were refused keeps its last measurement as it was (source and
    all: the policy holds), without refreshing it. A drafter measured only by the metrics window's totals
    now, but from its acceptance window (live or shadow) less than `acceptance_window_s` ago, keeps that
    measurement, as `remembered`: its window overlaps this one, while the totals reach back to the
    traffic of minutes before (docs/policy.md, "Two windows"). Returns the acceptances to decide with
    and the updated memory."""
    memory = {name: (acc, at) for name, (acc, at) in seen.items() if now - at < ACCEPTANCE_TTL_S}
    out: dict[str, policy.Acceptance] = {}
    for name, acc in accs.items():
        last = memory.get(name)
        if acc.source == REFUSED:
            out[name] = last[0] if last is not None else dataclasses.replace(acc, source="prior")
        elif (
            acc.source == "totals"
            and last is not None
            and last[0].source in FRESH_ACCEPTANCE
            and now - last[1] < acceptance_window_s
        ):
            out[name] = dataclasses.replace(last[0], source="remembered")
        elif acc.source != "prior":
            memory[name] = (acc, now)
            out[name] = acc
        elif last is not None:
            out[name] = dataclasses.replace(last[0], source="remembered")
        else:
            out[name] = acc
    return out, memory


def _pooled_acceptance_stats(
    observations: list[PodObservation], drafter: str
) -> tuple[BucketStats, BucketStats]:
    """Spec counters of one drafter over the resource's pods, all buckets pooled, plus vLLM's fallback
    totals from pods that run it without the plugin."""
    stats, fallback = BucketStats(), BucketStats()
    for obs in observations:
        for buckets in obs.by_drafter.get(drafter, {}).values():
            stats.add(buckets)
        if obs.fallback is not None and obs.drafter == drafter and not obs.by_drafter:
            fallback.add(obs.fallback)
    return stats, fallback


def recent_steps(observations: Iterable[PodObservation]) -> dict[str, float]:
    """Steps per bucket in the acceptance window, over the pods (empty where no pod reports them)."""
    recent: dict[str, float] = {}
    for obs in observations:
        for label, steps in obs.recent_steps.items():
            recent[label] = recent.get(label, 0.0) + steps
    return recent


def drafter_scores(
    view: ResourceView,
    accs: Mapping[str, policy.Acceptance],
    costs: FleetCosts,
    observations: list[PodObservation],
    names: Iterable[str] | None = None,
    in_force: str | None = None,
) -> dict[str, float]:
    """Predicted goodput on the resource's batch mix of every drafter measured now, or of the drafters
    `names`, whatever their acceptance rests on. The batch mix is the steps per bucket in the acceptance
    window, where the pods report it, else in the metrics window: drafters are ranked on the acceptance
    measured now, and on the metrics window's mix a phase of new traffic would be weighed mostly at
    the batch sizes of the traffic before it. Every drafter but the one `in_force` counts as off in the
    buckets more than `policy.MAX_EXTRAPOLATION` times the batches its speculative steps were measured at
    (`CalibratedCost.above_measured_range`): the fleet does not switch to a drafter on step times extrapolated
    that far; the one in force turns such buckets on (`policy.gain_caps`) and is measured there a tick
    later."""
    recent = recent_steps(observations)
    weights: dict[str, float] = {}
    for obs in observations:
        for label, s in obs.buckets.items():
            weights[label] = weights.get(label, 0.0) + s.steps_plain + s.steps_spec
    if sum(recent.values()) > 0:
        weights = recent
    bounds = tuple(view.spec.speculation.batch_buckets)
    wanted = set(names) if names is not None else {n for n, a in accs.items() if a.source in MEASURED_NOW}
    return {
        name: policy.drafter_score(
            accs[name], costs.cost(view, d), bounds, d.max_speculative_tokens, weights, name != in_force
        )
        for name, d in {d.name: d for d in view.spec.drafters}.items()
        if name in wanted
    }


@dataclass(frozen=True)
class Demotions:
    demoted: dict[str, float]  # drafter → when it was demoted
    under_floor_since: dict[str, float]  # drafter → since when its MAL is under the floor
    notes: list[str]  # one per drafter demoted now
    reinstated: list[str] = dataclasses.field(default_factory=list)  # one per demotion lifted now


def failing_drafters(observations: list[PodObservation]) -> dict[str, str]:
    """Drafters that are broken, not unlucky, → why: those a sidecar reports failed (it stopped calling
    them after failures in a row), and those whose sidecar calls failed in the window (the sidecars'
    error counter) without a single draft token accepted on any of the resource's pods."""
    errors: dict[str, float] = {}
    for obs in observations:
        for name, n in obs.drafter_errors.items():
            if n > 0:
                errors[name] = errors.get(name, 0.0) + n
    for obs in observations:
        for name, buckets in obs.by_drafter.items():
            if name in errors and any(b.accepted > 0 for b in buckets.values()):
                del errors[name]
    why = {
        name: f"{n:g} failed draft calls and no accepted draft in the window" for name, n in errors.items()
    }
    for obs in observations:
        for name in sorted(obs.failed_drafters):
            why.setdefault(name, f"its sidecar on pod {obs.pod} reports it failed")
    return why


def demotions(
    drafters: Mapping[str, DrafterSpec],
    accs: Mapping[str, policy.Acceptance],
    demoted: Mapping[str, float],
    under_floor_since: Mapping[str, float],
    speculation: SpeculationSpec,
    now: float,
    failing: Mapping[str, float] | None = None,
    paying: Collection[str] = (),
) -> Demotions:
    """A drafter whose MAL at its largest K stays under the floor for a cooldown is demoted, unless it
    still pays (`paying`: its predicted goodput on the resource's batch mix, on calibrated step times,
    reaches minGain; a free drafter such as n-gram pays at low batches with a MAL under 2), and at once
    one whose sidecar calls failed in the window without a single accepted draft (`failing`, from
    failing_drafters): it is broken, not unlucky. A demotion is reconsidered (the drafter tried again)
    after DEMOTION_TTL_S: traffic changes, and a broken drafter may have been fixed. It is lifted sooner
    when the drafter, not failing, is measured now (in practice by its shadow drafts) with a MAL above the
    floor by SWITCH_MARGIN: the traffic has turned its way."""
    demoted = {name: at for name, at in demoted.items() if now - at < DEMOTION_TTL_S}
    under = dict(under_floor_since)
    notes: list[str] = []
    reinstated: list[str] = []
    for name, d in drafters.items():
        acc = accs[name]
        failed = (failing or {}).get(name)
        if name in demoted and failed is None and acc.source in MEASURED_NOW:
            mal = acc.tokens(d.max_speculative_tokens)
            if mal >= speculation.mal_floor * (1 + SWITCH_MARGIN):
                del demoted[name]
                reinstated.append(f"reinstated {name}: MAL {mal:.2f} ({acc.source}) >= floor")
                continue
        if name not in demoted and failed is not None:
            demoted[name] = now
            under.pop(name, None)
            notes.append(f"demoted {name}: {failed}")
            continue
        # Shadow drafts cost the pods nothing: a drafter not in force is not demoted for them, so it can
        # win when the traffic turns its way.
        if acc.source not in MEASURED_NOW or acc.source == "shadow" or name in demoted:
            continue
        mal = acc.tokens(d.max_speculative_tokens)
        if mal < speculation.mal_floor and name not in paying:
            since = under.setdefault(name, now)
            if now - since >= speculation.cooldown_seconds:
                demoted[name] = now
                under.pop(name, None)
                notes.append(f"demoted {name}: MAL {mal:.2f} < floor {speculation.mal_floor}")
        else:
            under.pop(name, None)
    return Demotions(demoted, under, notes, reinstated)


def better_drafter(
    current: str,
    candidates: Iterable[str],
    scores: Mapping[str, float],
    last_score: Mapping[str, float],
    demoted: Mapping[str, float],
    cooled_down: bool,
    never_measured: float = 1.0,
) -> str | None:
    """The drafter to run instead of `current`, or None to keep it. The best measured one, by
    SWITCH_MARGIN over the one in force, once the last switch has cooled down; never a demoted one. The
    one in force, not measured now (every bucket off, so no live drafts), counts at its last score, else
    at `never_measured` (`decide` passes what the prior predicts for it; by default plain decoding, 1.0):
    a trial's measurement alone must not win against a drafter that merely sat out, or that has not had
    its turn since the pods started plain. A demoted drafter in force gives way at once, to the best
    measured one or else the best remembered one (`last_score`)."""
    eligible = {n: s for n, s in scores.items() if n not in demoted}
    if current in demoted:
        remembered = {n: last_score.get(n, 0.0) for n in candidates if n not in demoted}
        pool = eligible or remembered
        return max(pool, key=lambda n: pool[n]) if pool else None
    if eligible and cooled_down:
        best = max(eligible, key=lambda n: eligible[n])
        if eligible[best] >= scores.get(current, last_score.get(current, never_measured)) * (
            1 + SWITCH_MARGIN
        ):
            return best
    return None


def k_table(
    acc: policy.Acceptance,
    cost: policy.CalibratedCost,
    max_k: int,
    current: Mapping[str, int],
    flipped_at: Mapping[str, float],
    speculation: SpeculationSpec,
    now: float,
    off_on_estimate: Collection[str] = (),
    remeasured_until: Mapping[str, float] | None = None,
) -> tuple[policy.TableUpdate, int | None]:
    """K per bucket for the drafter in force, with hysteresis against the table in force, and the cliff
    (the batch size from which no K pays). Where no speculative step of this engine and drafter was ever
    measured, the prior alone does not turn buckets on fleet-wide: an exploration canary measures first
    (unless exploration is off, where the prior is all there is).

    A bucket turned off on a remembered plain step (`off_on_estimate`) whose plain step is measured now
    may turn on again within the cooldown: the cooldown keeps noise from flapping a bucket, and this is
    an estimate corrected. A plain step remembered from another time (shorter contexts, say) under-predicts
    one measured now, and the gain of every K with it. So may a bucket a canary measured acceptance in
    again (`remeasured_until`), while the acceptance in hand is fresh, until the tick after the canary
    ends: what turned it off was measured on traffic that has gone (the load fell, or the acceptance in
    hand is stale); the cooldown held the local fleet's batch 1 off 23 s after its canary had measured
    the quiet phase's acceptance."""
    bounds = tuple(speculation.batch_buckets)
    choices = policy.choose_table(acc, cost, bounds, max_k)
    hysteresis = policy.Hysteresis(speculation.min_gain, speculation.cooldown_seconds)
    capped = {label: min(current.get(label, 0), max_k) for label in bucket_labels(bounds)}
    waived = {label for label in off_on_estimate if cost.measured_plain_now(label)}
    if acc.source in FRESH_ACCEPTANCE:
        waived |= {
            label
            for label, until in (remeasured_until or {}).items()
            if _remeasure_open(until, now, speculation)
        }
    update = policy.update_table(capped, choices, hysteresis, flipped_at, now, waived)
    if speculation.exploration_share > 0 and not cost.any_spec_measured:
        held = [label for label, k in update.k_by_bucket.items() if k > 0 and capped[label] == 0]
        if held:
            table = {label: (0 if label in held else k) for label, k in update.k_by_bucket.items()}
            flipped = {label: at for label, at in update.flipped.items() if label not in held}
            reasons = [r for r in update.reasons if not any(r.startswith(f"bucket {h} on") for h in held)]
            reasons.append(f"buckets {', '.join(held)} wait for a canary's measurement (prior only)")
            update = policy.TableUpdate(table, flipped, reasons)
    return update, policy.cliff_batch_size(acc, cost, bounds, max_k, speculation.min_gain)


def _remeasure_open(until: float, now: float, speculation: SpeculationSpec) -> bool:
    """Whether a remeasure canary that ends at `until` still waives its bucket's cooldown: to the tick
    after it ends, which reads its last interval."""
    return now < until + speculation.evaluation_interval_seconds


def next_canary(
    view: ResourceView,
    state: ResourceState,
    accs: Mapping[str, policy.Acceptance],
    costs: FleetCosts,
    observations: list[PodObservation],
    now: float,
) -> tuple[Canary | None, str | None]:
    """Keep measuring what is switched off: one canary pod at a time either tries another drafter
    (trial) or speculates in the off bucket nearest the cliff that has traffic (explore). Returns the
    canary for this tick and, for a new one, a note saying what it measures."""
    _follow_batch_mix(view, state, observations)
    ended = state.canary
    if ended is not None:
        alive = ended.pod in view.pods and ended.drafter not in state.demoted
        if ended.until > now and alive and not _trial_settled(view, state, accs, costs, ended):
            return ended, None
        if alive and ended.remeasure and accs[state.drafter].source not in FRESH_ACCEPTANCE:
            # Too little traffic reached its bucket to measure acceptance: it cost as little, and does
            # not count against the share (a busy phase's few batch-1 steps, say, until the quiet
            # returns). The next canary may go at once, on the same pod.
            state.last_explore_at = -math.inf
        else:
            ended = None
    if view.spec.speculation.exploration_share <= 0:
        return None, None
    pod = ended.pod if ended is not None else sorted(view.pods)[state.canary_round % len(view.pods)]
    # Cold start (the pods began plain, docs/policy.md): the drafter in force, the one the pods have
    # loaded, is measured first, by exploring, before another is tried; on a small fleet the canary is
    # much of it, and a trial of a worse drafter first costs its whole length.
    if state.drafter not in state.last_score:
        order = (_explore_canary, _trial_canary)
    else:
        order = (_trial_canary, _explore_canary)
    for make in order:
        found = make(view, state, accs, costs, observations, now, pod)
        if found is None:
            continue
        canary = found[0]
        if ended is not None and (canary.drafter, canary.k_by_bucket) == (ended.drafter, ended.k_by_bucket):
            # The same measurement on the same pod: it goes on. The same object, so the policy in
            # force is unchanged and nothing is pushed.
            ended.until = canary.until
            state.last_explore_at = now
            return ended, None
        return found
    return None, None


def _follow_batch_mix(view: ResourceView, state: ResourceState, observations: list[PodObservation]) -> None:
    """Note whether the batches moved to a smaller bucket (the load fell): the bucket with the most steps
    in the acceptance window, against the last tick's. Pods that do not report those steps say nothing."""
    recent = recent_steps(observations)
    if not recent or max(recent.values()) <= 0:
        return
    order = {label: i for i, label in enumerate(bucket_labels(view.spec.speculation.batch_buckets))}
    busiest = max(recent, key=lambda label: (recent[label], -order.get(label, 0)))
    if busiest not in order:
        return
    before = order.get(state.mix_bucket, order[busiest])
    if order[busiest] < before:
        state.load_fell = True
    elif order[busiest] > before:
        state.load_fell = False
    state.mix_bucket = busiest


def _trial_settled(
    view: ResourceView,
    state: ResourceState,
    accs: Mapping[str, policy.Acceptance],
    costs: FleetCosts,
    canary: Canary,
) -> bool:
    """Whether a running trial has measured enough to end before its TRIAL_TICKS: its drafter's live
    acceptance and its own speculative steps are measured now, and its score (this tick's) is below the
    drafter in force's last score by the switch margin, so no longer trial would make it win. On a
    one-pod fleet the trial is the fleet; a worse drafter tried for its whole length cost the local
    fleet a fifth of a phase. A trial that measures a better drafter needs no early end: the fleet
    switches to it (`better_drafter`)."""
    if canary.purpose != "trial" or canary.drafter == state.drafter:
        return False
    drafter = next((d for d in view.spec.drafters if d.name == canary.drafter), None)
    if drafter is None or accs[canary.drafter].source != "measured":
        return False
    cost = costs.cost(view, drafter)
    if not any(k > 0 and cost.measured_spec_now(label) for label, k in canary.k_by_bucket.items()):
        return False
    score = state.last_score.get(canary.drafter, 0.0)
    return score * (1 + SWITCH_MARGIN) < state.last_score.get(state.drafter, 1.0)


def _trial_canary(
    view: ResourceView,
    state: ResourceState,
    accs: Mapping[str, policy.Acceptance],
    costs: FleetCosts,
    observations: list[PodObservation],
    now: float,
    pod: str,
) -> tuple[Canary, str] | None:
    speculation = view.spec.speculation
    interval = speculation.evaluation_interval_seconds
    drafters = {d.name: d for d in view.spec.drafters}
    # The drafter in force at its last score (this tick's, where it was measured now), else as plain.
    active_score = state.last_score.get(state.drafter, 1.0)
    # Trials: drafters that can run live and have not been measured for a trial period.
    for name, d in drafters.items():
        if name == state.drafter or name in state.demoted or not live_switchable(d, state.engine_drafter):
            continue
        cost = costs.cost(view, d)
        # Measured in the shadow now: its acceptance is known. With its own step times measured before
        # (a trial, a time in force) everything a trial would measure is known; without them its score
        # rests on borrowed step times, and a trial is worth its canary only where that score comes
        # within the switch margin of the drafter in force (clearly better: `better_drafter` switches).
        if accs[name].source == "shadow" and (
            cost.own_spec_measured or state.last_score.get(name, 0.0) * (1 + SWITCH_MARGIN) < active_score
        ):
            continue
        since_trial = now - state.last_trial_at.get(name, -math.inf)
        # Due every trial period, and sooner when its last score beats the last score of the drafter
        # in force (the traffic mix may have moved in its favour): measure it again, then compare. Its
        # last score was made on the batches of its time, though: it must also win on this tick's
        # (a draft model scored at batch 1 in a quiet phase is no candidate for a busy one's batch 16).
        bar = active_score * (1 + SWITCH_MARGIN)
        if since_trial < TRIAL_PERIOD_S and not (
            since_trial >= EARLY_TRIAL_GAP_TICKS * interval
            and state.last_score.get(name, 0.0) > bar
            and drafter_scores(view, accs, costs, observations, [name], state.drafter)[name] > bar
        ):
            continue
        choices = policy.choose_table(accs[name], cost, speculation.batch_buckets, d.max_speculative_tokens)
        # Every bucket with a positive predicted gain, so the trial measures the drafter where it may pay.
        table = {label: (c.k if c.gain >= 1.0 else 0) for label, c in choices.items()}
        if not any(table.values()):
            table = {label: 1 for label in choices}
        canary = Canary(pod, name, table, now + TRIAL_TICKS * interval, "trial")
        return canary, f"trial of drafter {name} on pod {pod}"
    return None


def _explore_canary(
    view: ResourceView,
    state: ResourceState,
    accs: Mapping[str, policy.Acceptance],
    costs: FleetCosts,
    observations: list[PodObservation],
    now: float,
    pod: str,
) -> tuple[Canary, str] | None:
    """Speculate on the canary in the lowest off bucket that sees traffic and either has no speculative
    step-time measurement, or only a remembered one that predicts at least plain decoding's speed, or,
    while the drafter in force's acceptance is stale, could pay at all and has steps now (in the
    acceptance window); often enough that the canary's share stays near explorationShare. The bucket the
    batches just moved to (the load fell) has its acceptance measured again whatever its source, and
    sooner than the period, once a period."""
    speculation = view.spec.speculation
    interval = speculation.evaluation_interval_seconds
    period = EXPLORE_TICKS * interval / (speculation.exploration_share * len(view.pods))
    # No drafts of the drafter in force in the acceptance window: its acceptance is from traffic that
    # may have gone (a busy phase's prose, say), and with every bucket that has traffic switched off
    # nothing would measure it again (docs/policy.md, "Keeping measurements fresh").
    stale = accs[state.drafter].source not in FRESH_ACCEPTANCE
    # The batches moved to a smaller bucket (the load fell): what decided it off was measured largely on
    # the traffic before (a busy phase's mix), so it is measured again, now rather than up to a period
    # later, once a period (docs/policy.md, "Keeping measurements fresh").
    moved_to = state.mix_bucket if state.load_fell else None
    since = now - state.last_explore_at
    early = since < period
    if since < EXPLORE_TICKS * interval or (
        early and (moved_to is None or now - state.early_explore_at < period)
    ):
        return None
    active = view.spec.drafter(state.drafter)
    max_k = active.max_speculative_tokens
    cost = costs.cost(view, active)
    cold = state.drafter not in state.last_score
    traffic: dict[str, float] = {}
    for obs in observations:
        for label, s in obs.buckets.items():
            traffic[label] = traffic.get(label, 0.0) + s.steps_plain
    recent = recent_steps(observations)
    # Buckets the traffic has left: no steps in the acceptance window (where the pods report it).
    now_idle = {label for label in traffic if recent.get(label, 0.0) <= 0} if recent else set()
    for label in bucket_labels(speculation.batch_buckets):
        # The bucket the batches moved to has them (its steps until this tick may all be speculative).
        if state.k_by_bucket.get(label, 0) > 0 or (
            label != moved_to and traffic.get(label, 0.0) < policy.MIN_STEPS
        ):
            continue
        if early and label != moved_to:
            continue
        why, remeasure = "", False
        if cost.measured_spec(label) and (stale or label == moved_to):
            # Its step times are measured: a canary measures acceptance again, worth it where a drafter
            # accepting every draft would clear minGain here; at the largest K, so that every position
            # is measured. The bucket the batches moved to is measured again whatever its step times
            # say: they were timed on the traffic before as well (on the local fleet, a busy phase's
            # batch-1 steps at K 4 took 15-17 ms against 10-11 in the quiet phase after it, and bucket 1
            # waited 60 s for the next explore; docs/policy.md, "Keeping measurements fresh").
            if label != moved_to and policy.ceiling_gain(cost, label, max_k) < speculation.min_gain:
                continue
            # Drafts where the traffic has left would measure nothing: in a burst, the acceptance is
            # measured where the batches are now.
            if label in now_idle:
                continue
            k, remeasure = max_k, True
            why = (
                f": acceptance {accs[state.drafter].source}, not measured now"
                if stale
                else ": acceptance measured on the traffic before the batches moved here"
            )
        elif cost.measured_spec_now(label):
            continue  # step times measured in the window stand: they decided this bucket off
        elif cost.measured_spec(label):
            # Remembered step times (from another hour: another batch within the bucket, a few steps at
            # one K) are measured again where they predict at least plain decoding's speed: below minGain
            # there, a pessimistic error would keep the bucket off for good (docs/policy.md, "Keeping
            # measurements fresh").
            choice = policy.best_k(accs[state.drafter], cost, label, max_k)
            if choice.gain < 1.0:
                continue
            k, why = choice.k, f": step times remembered (gain {choice.gain:.2f}), not measured now"
        else:
            choice = policy.best_k(accs[state.drafter], cost, label, max_k)
            # Slower than plain decoding by what was measured in other buckets: no canary. At a cold
            # start nothing was measured, and the prior alone does not keep the drafter in force from its
            # first measurement (a tiny draft model on a CPU, say, which a GPU roofline prices as never
            # paying).
            if choice.gain < 1.0 and not cold:
                continue
            # Cold, at the largest K: its drafts then measure acceptance at every position, which a small
            # K leaves to the prior (and a draft model whose later positions pay, ranked below n-gram).
            k = max_k if cold else choice.k
        table = dict(state.k_by_bucket)
        table[label] = k
        canary = Canary(pod, state.drafter, table, now + EXPLORE_TICKS * interval, "explore", remeasure)
        if early:
            state.early_explore_at = now
            if stale or not remeasure:
                why += "; the batches moved to a smaller bucket"
        return canary, f"explore bucket {label} with k={k} on pod {pod}{why}"
    if early or accs[state.drafter].source not in FRESH_ACCEPTANCE:
        return None
    probe = _k_probe(state.k_by_bucket, accs[state.drafter], cost, max_k, observations)
    why = "its step time is not measured now"
    if probe is None and not cold:
        probe = _off_bucket_probe(state.k_by_bucket, accs[state.drafter], cost, max_k, traffic)
        why = "measured off at other Ks, this one predicted at least plain decoding's speed"
    if probe is None:
        return None
    label, k = probe
    table = dict(state.k_by_bucket)
    table[label] = k
    canary = Canary(pod, state.drafter, table, now + EXPLORE_TICKS * interval, "explore")
    return canary, f"probe bucket {label} at k={k} on pod {pod}: {why}"


def _off_bucket_probe(
    table: Mapping[str, int],
    acc: policy.Acceptance,
    cost: policy.CalibratedCost,
    max_k: int,
    traffic: Mapping[str, float],
) -> tuple[str, int] | None:
    """The bucket and K of the next probe of an off bucket, or None: the lowest off bucket with traffic
    whose step times were measured in the window at some Ks, at least one of them at plain decoding's
    speed or better, at the K not measured there predicted best, if that K predicts at least plain
    decoding's speed. The Ks measured decided the bucket off; the others are priced from them (a fitted
    fixed cost, or the prior's shape), and a step time need not follow either: on the measured CPU truth
    n-gram's steps at batch 2 cost the same at K = 1, 2 and 3 and more at K = 4, and a line through
    K = 1, 2 and 4 priced K = 3 dear enough to keep the bucket off (docs/policy.md, "Keeping
    measurements fresh: canaries")."""
    for label in cost.ranges:
        if table.get(label, 0) > 0 or traffic.get(label, 0.0) < policy.MIN_STEPS:
            continue
        measured = cost.measured_ks_now(label)
        if not measured:
            continue
        choice = policy.best_k(acc, cost, label, max_k)
        if max(choice.gain_at(k) for k in measured) < 1.0:
            # Slower than plain decoding at every K it ran: a K priced from those is not measured on
            # extrapolation alone (a first version probed batch 16 at K 1 on the measured CPU truth,
            # where nothing pays above batch 4).
            continue
        unmeasured = [k for k in range(1, max_k + 1) if k not in measured and choice.gain_at(k) >= 1.0]
        if unmeasured:
            return label, max(unmeasured, key=choice.gain_at)
    return None


def _k_probe(
    table: Mapping[str, int],
    acc: policy.Acceptance,
    cost: policy.CalibratedCost,
    max_k: int,
    observations: list[PodObservation],
) -> tuple[str, int] | None:
    """The bucket and K of the next probe, or None: in the on bucket with the most speculative steps
    in the window whose step time was measured there at one K only, the neighbouring K predicted to come
    within PROBE_SHORTFALL of the K in force (the better of the two). The prior's shape in K prices
    every other K from that one measurement; on the gpu truth, measured at K = 3 at batch 57, it priced
    K = 5 at 17.5 ms where it takes 13.6 (docs/policy.md, "Keeping measurements fresh: canaries")."""
    steps: dict[str, float] = {}
    for obs in observations:
        for label, s in obs.buckets.items():
            steps[label] = steps.get(label, 0.0) + s.steps_spec
    for label in sorted(steps, key=lambda b: -steps[b]):
        k_now = table.get(label, 0)
        if k_now <= 0 or cost.measured_ks_now(label) != (k_now,):
            continue
        choice = policy.best_k(acc, cost, label, max_k)
        near = [
            k
            for k in (k_now - 1, k_now + 1)
            if 1 <= k <= max_k and choice.gain_at(k) >= choice.gain_at(k_now) * (1 - PROBE_SHORTFALL)
        ]
        if near:
            return label, max(near, key=choice.gain_at)
    return None


def table_action(old: Mapping[str, int], new: Mapping[str, int]) -> str:
    """How a K table changed: a bucket switched off, on, a K retuned, or nothing."""
    on = [b for b in new if new[b] > 0 and old.get(b, 0) == 0]
    off = [b for b in new if new[b] == 0 and old.get(b, 0) > 0]
    if off:
        return "disable"
    if on:
        return "enable"
    return "setK" if dict(old) != dict(new) else "hold"


@dataclass(frozen=True)
class PolicyInForce:
    """The part of a ResourceState that pods see: a change of it is a new policy version."""

    drafter: str
    k_by_bucket: dict[str, int]
    canary: Canary | None

    @classmethod
    def of(cls, state: ResourceState) -> PolicyInForce:
        return cls(state.drafter, dict(state.k_by_bucket), state.canary)


def policy_changed(old: PolicyInForce, new: PolicyInForce, every_drafter_demoted: bool) -> bool:
    """Whether pods get a new policy. With every drafter demoted pods speculate nowhere, so only the K
    table and the canary count."""
    if every_drafter_demoted:
        return (new.k_by_bucket, new.canary) != (old.k_by_bucket, old.canary)
    return new != old


def action_name(
    old: PolicyInForce,
    new: PolicyInForce,
    rollout: str | None,
    demoted_now: bool,
    every_drafter_demoted: bool,
) -> str:
    """The one word a decision is recorded and counted by, the weightiest change first."""
    if every_drafter_demoted:
        return "demote" if policy_changed(old, new, every_drafter_demoted) else "hold"
    if rollout:
        return "rollout"
    if old.drafter != new.drafter:
        return "switchDrafter"
    if demoted_now:
        return "demote"
    action = table_action(old.k_by_bucket, new.k_by_bucket)
    if action == "hold" and old.canary != new.canary and new.canary is not None:
        return new.canary.purpose
    return action


@dataclass(frozen=True)
class Outcome:
    """What one decision did, before it is dressed with the measurements it was made on."""

    action: str
    reason: str
    changed: bool
    rollout: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    push: bool = True
    warnings: dict[str, str] = field(default_factory=dict)


def decide(
    view: ResourceView, snapshot: FleetSnapshot, state: ResourceState, costs: FleetCosts, now: float
) -> Decision:
    """Decide this resource's policy; updates `state` (the desired policy) in place. The steps run in
    order, each a function above: the mode's override, the data gate, acceptance, scores, demotion, the
    drafter, the K table, the canary, and the action's name."""
    drafters = {d.name: d for d in view.spec.drafters}
    labels = bucket_labels(view.spec.speculation.batch_buckets)
    observations = [
        snapshot.pods[(view.namespace, p)] for p in view.pods if (view.namespace, p) in snapshot.pods
    ]
    old = PolicyInForce.of(state)
    forced = forced_policy(view.spec)
    if forced is not None:
        state.drafter = forced.drafter or state.drafter
        state.k_by_bucket, state.canary = forced.k_by_bucket, None
        changed = PolicyInForce.of(state) != old
        action = ("enable" if forced.mode == "on" else "disable") if changed else "hold"
        return _finish(
            view, state, observations, Outcome(action, f"speculation.mode is {forced.mode}", changed), now
        )
    if state.drafter not in drafters:  # removed from the spec: the initial drafter takes over
        state.drafter = (view.spec.initial_drafter or view.spec.drafters[0]).name
    waiting = missing_data(view, snapshot)
    if waiting is not None:
        push = waiting.push or state.decided
        reason = waiting.reason if push else f"{waiting.reason}; the pods keep the policy they run"
        warnings = {waiting.warning: reason} if waiting.warning else {}
        outcome = Outcome(waiting.action, reason, False, push=push, warnings=warnings)
        return _finish(view, state, observations, outcome, now)
    state.decided = True

    accs, state.acceptance_seen = recalled_acceptance(
        measured_acceptance(drafters, observations),
        state.acceptance_seen,
        now,
        acceptance_window_of(snapshot.window_s),
    )
    scores = drafter_scores(view, accs, costs, observations, in_force=state.drafter)
    failing = failing_drafters(observations)
    paying = {name for name, score in scores.items() if score >= view.spec.speculation.min_gain}
    demoted = demotions(
        drafters, accs, state.demoted, state.under_floor_since, view.spec.speculation, now, failing, paying
    )
    state.demoted, state.under_floor_since = demoted.demoted, demoted.under_floor_since
    state.last_score.update(scores)
    notes = demoted.notes + demoted.reinstated
    cooled_down = now - state.last_switch_at >= view.spec.speculation.cooldown_seconds
    never_measured = 1.0
    if state.drafter not in state.last_score:
        # Never scored: the pods have run plain since they started (docs/policy.md, "Cold start"), or the
        # operator restarted. Until it is measured, the drafter in force stands at what the prior predicts
        # for it on the calibrated step times, not at plain decoding, which any drafter a trial measured
        # would beat.
        never_measured = drafter_scores(view, accs, costs, observations, (state.drafter,), state.drafter)[
            state.drafter
        ]
    # A drafter whose speculative steps were never measured on its own (only its shadow acceptance, on
    # borrowed step times) is tried on a canary first (next_canary), not switched to fleet-wide.
    candidates = {
        n: score
        for n, score in scores.items()
        if n == state.drafter or costs.cost(view, drafters[n]).own_spec_measured
    }
    best = better_drafter(
        state.drafter, drafters, candidates, state.last_score, state.demoted, cooled_down, never_measured
    )
    rollout = None
    if best is not None and best != state.drafter:
        standing = scores.get(state.drafter, state.last_score.get(state.drafter, never_measured))
        rollout = _switch_drafter(view, state, drafters[best], standing, notes, now)
    every_drafter_demoted = state.drafter in state.demoted
    if every_drafter_demoted:
        # Speculation off until a demotion expires and a trial finds a drafter above the floor.
        state.k_by_bucket, state.cliff = {label: 0 for label in labels}, 1
    else:
        notes.extend(_retune(view, state, drafters[state.drafter], accs[state.drafter], costs, now))
    canary, canary_note = next_canary(view, state, accs, costs, observations, now)
    if canary is not None and canary_note is not None:
        _started(state, canary, now)
        notes.append(canary_note)
    state.canary = canary
    new = PolicyInForce.of(state)
    if every_drafter_demoted:
        reason = "; ".join(notes) or f"every drafter demoted ({', '.join(sorted(state.demoted))})"
    else:
        reason = "; ".join(notes) or _summary(state, accs[state.drafter])
    action = action_name(old, new, rollout, bool(demoted.notes), every_drafter_demoted)
    warnings = {}
    if failing:
        warnings[DRAFTER_ERRORS] = "; ".join(f"{name}: {why}" for name, why in sorted(failing.items()))
    refused = {o.pod: o.dropped for o in observations if o.dropped}
    if refused:
        counts = ", ".join(f"{pod}: {n}" for pod, n in sorted(refused.items()))
        warnings[INVALID_METRICS] = (
            f"values read from Prometheus refused as invalid ({counts}); decided without them "
            "and the counters they belong with"
        )
    changed = policy_changed(old, new, every_drafter_demoted)
    outcome = Outcome(action, reason, changed, rollout, scores, warnings=warnings)
    return _finish(view, state, observations, outcome, now)


def _switch_drafter(
    view: ResourceView,
    state: ResourceState,
    best: DrafterSpec,
    standing: float,
    notes: list[str],
    now: float,
) -> str | None:
    """Put `best` in force with every bucket off (the K table starts again); returns it if the engines
    must be restarted for it (a rollout). `standing`: the score the drafter in force was compared at."""
    notes.append(
        f"drafter {state.drafter}→{best.name}: predicted gain {state.last_score.get(best.name, 0.0):.2f} "
        f"vs {standing:.2f}"
    )
    # The drafter left behind was measured in force until now, as a trial would have: its next trial is
    # due a trial period on, and sooner only as any early trial is, where it wins on the batches of that
    # tick (`_trial_canary`). It counts as tried one early-trial gap ago, so that it may come back at
    # once where the new drafter's fleet-wide measurement disappoints.
    interval = view.spec.speculation.evaluation_interval_seconds
    state.last_trial_at[state.drafter] = now - EARLY_TRIAL_GAP_TICKS * interval
    rollout = None
    if not live_switchable(best, state.engine_drafter):
        rollout = best.name
        state.engine_drafter = best.name if best.placement == "colocated" else None
    state.drafter = best.name
    state.last_switch_at = now
    state.flipped_at, state.off_on_estimate, state.remeasured_until = {}, set(), {}
    state.k_by_bucket = {label: 0 for label in bucket_labels(view.spec.speculation.batch_buckets)}
    return rollout


def _retune(
    view: ResourceView,
    state: ResourceState,
    active: DrafterSpec,
    acc: policy.Acceptance,
    costs: FleetCosts,
    now: float,
) -> list[str]:
    """Put the K table and cliff of the drafter in force (`active`) in `state`; returns what changed, in
    words."""
    cost = costs.cost(view, active)
    update, state.cliff = k_table(
        acc,
        cost,
        active.max_speculative_tokens,
        state.k_by_bucket,
        state.flipped_at,
        view.spec.speculation,
        now,
        state.off_on_estimate,
        state.remeasured_until,
    )
    state.k_by_bucket = update.k_by_bucket
    state.flipped_at.update(update.flipped)
    # The waiver is used once: a bucket's plain step measured now settles the estimate either way.
    state.off_on_estimate = {
        label
        for label in state.off_on_estimate | set(update.flipped)
        if update.k_by_bucket[label] == 0 and not cost.measured_plain_now(label)
    }
    state.remeasured_until = {
        label: until
        for label, until in state.remeasured_until.items()
        if update.k_by_bucket.get(label) == 0 and _remeasure_open(until, now, view.spec.speculation)
    }
    return update.reasons


def _started(state: ResourceState, canary: Canary, now: float) -> None:
    """Record a new canary's start: the next one goes to the next pod, and the measured drafter (trial)
    or bucket (explore) is not due again for a while."""
    state.canary_round += 1
    state.load_fell = False  # it measures acceptance on the traffic of now
    if canary.purpose == "trial":
        state.last_trial_at[canary.drafter] = now
    else:
        state.last_explore_at = now
    if canary.remeasure:
        for label, k in canary.k_by_bucket.items():
            if k > 0 and state.k_by_bucket.get(label, 0) == 0:
                state.remeasured_until[label] = canary.until


def _summary(state: ResourceState, acc: policy.Acceptance) -> str:
    cliff = f"cliff at batch {state.cliff}" if state.cliff else "no cliff up to the largest bucket"
    return f"{state.drafter}: {cliff}, acceptance {acc.source} α1={acc.alphas[0]:.2f}"


def _finish(
    view: ResourceView, state: ResourceState, observations: list[PodObservation], outcome: Outcome, now: float
) -> Decision:
    """A new policy version if the policy changed, each pod's target, and the measurements behind it."""
    if outcome.changed:
        state.policy_version += 1
    mode = "off" if view.spec.speculation.mode == "off" else "on"
    pods: dict[str, PodTarget] = {}
    # A pod seen for the first time runs the drafter it reports since before the window: only a change
    # of drafter from here on mixes two drafters in its step counters.
    reported = {o.pod: o.drafter for o in observations}
    for pod in view.pods:
        if state.canary is not None and state.canary.pod == pod:
            pods[pod] = PodTarget(state.canary.drafter, mode, dict(state.canary.k_by_bucket))
        else:
            pods[pod] = PodTarget(state.drafter, mode, dict(state.k_by_bucket))
        running = state.pod_drafter.get(pod)
        if running is None and reported.get(pod) is not None:
            running = (reported[pod], -math.inf)
        if running is not None:
            state.pod_drafter[pod] = running if running[0] == pods[pod].drafter else (pods[pod].drafter, now)
    for pod in set(state.pod_drafter) - set(view.pods):
        del state.pod_drafter[pod]
    # Only the draft counters are summed: the per-K and per-position counts are not reported.
    fleet = BucketStats()
    by_bucket: dict[str, BucketStats] = {}
    for obs in observations:
        for label, s in obs.by_drafter.get(state.drafter, {}).items():
            stats_of(by_bucket, label).add_drafts(s)
            fleet.add_drafts(s)
        if not obs.by_drafter and obs.fallback is not None:
            fleet.add_drafts(obs.fallback)
    utils = [o.gpu_util for o in observations if o.gpu_util is not None]
    pod_batch = {o.pod: o.running for o in observations}
    warnings = dict(outcome.warnings)
    if not view.gpu_known:
        warnings[UNKNOWN_GPU] = (
            f"engine.gpu.product {view.gpu_product!r} is not in the cost model's table: step times start "
            "from a generic prior until measured (docs/policy.md)"
        )
    return Decision(
        action=outcome.action,
        reason=outcome.reason,
        changed=outcome.changed,
        policy_version=state.policy_version,
        drafter=state.drafter,
        k_by_bucket=dict(state.k_by_bucket),
        cliff=state.cliff,
        pods=pods,
        rollout_drafter=outcome.rollout,
        fleet_mal={label: round(s.mal, 3) for label, s in by_bucket.items() if s.mal is not None},
        mean_accepted_length=fleet.mal,
        acceptance_rate=(fleet.accepted / fleet.draft_tokens) if fleet.draft_tokens > 0 else None,
        gpu_utilization=sum(utils) / len(utils) if utils else None,
        pod_mal={o.pod: o.mal for o in observations},
        pod_batch=pod_batch,
        pod_drafter={o.pod: o.drafter for o in observations},
        scores=outcome.scores,
        demoted=tuple(sorted(state.demoted)),
        push=outcome.push,
        warnings=warnings,
    )


def speculating(target: PodTarget, batch: float | None, bounds: Iterable[int]) -> bool | None:
    """Whether a pod at this batch size speculates under its target policy."""
    if batch is None:
        return None
    return (
        target.mode == "on" and target.k_by_bucket.get(bucket_for(max(1, round(batch)), tuple(bounds)), 0) > 0
    )
