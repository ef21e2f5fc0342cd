"""One controller decision for one SpeculativeServing: snapshot + remembered state → the policy per pod.

Pure: no I/O, the clock is an argument. The operator's timer (timer.py) and the fleet simulator
(specserve_operator.simulator) both call `decide`, so the simulator runs the real controller.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from specserve_engine.buckets import bucket_for, bucket_labels
from specserve_operator.api.models import DrafterSpec, SpeculativeServingSpec
from specserve_operator.tuner import policy as pol
from specserve_operator.tuner.costmodel import StepCostPrior, drafter_cost, gpu_spec, model_shape
from specserve_operator.tuner.observations import BucketStats, FleetSnapshot, PodObservation

# A drafter beats the one in force only by this much predicted goodput (no switching on noise).
SWITCH_MARGIN = 0.05
# Every drafter that could serve is tried on a canary pod this often, for TRIAL_TICKS evaluations.
TRIAL_PERIOD_S = 1200.0
TRIAL_TICKS = 4
EXPLORE_TICKS = 2
# A demotion is reconsidered (the drafter tried again) after this long: traffic changes.
DEMOTION_TTL_S = 3600.0
DEFAULT_GPU = "NVIDIA-H100"


def live_switchable(drafter: DrafterSpec, engine_drafter: str | None) -> bool:
    """Whether pods can run `drafter` without a restart. An engine started with a colocated drafter
    (vLLM's own method) runs only that one; an engine started with the sidecar proposer (custom_class,
    `engine_drafter` None) switches live among the sidecar-hosted drafters (DESIGN §4)."""
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

    def cost_group(self, drafter: DrafterSpec) -> tuple[str, str, int, str, str]:
        """Step-time measurements are shared by every resource with the same model, GPU and drafter."""
        return (
            self.spec.model.name,
            self.gpu_product,
            self.spec.model.tensor_parallel_size,
            drafter.method,
            drafter.source or "",
        )

    def prior(self, drafter: DrafterSpec) -> StepCostPrior:
        context = float(min(self.spec.model.max_model_len or 2048, 2048)) / 2
        return StepCostPrior(
            model=model_shape(self.spec.model.name),
            gpu=gpu_spec(self.gpu_product),
            drafter=drafter_cost(drafter.method),
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


@dataclass
class ResourceState:
    """What the controller remembers about one resource between ticks (the desired policy)."""

    drafter: str
    k_by_bucket: dict[str, int]
    engine_drafter: str | None  # the colocated drafter the running engines were started with
    policy_version: int = 0
    flipped_at: dict[str, float] = field(default_factory=dict)
    last_switch_at: float = -math.inf
    canary: Canary | None = None
    canary_round: int = 0
    last_explore_at: float = -math.inf
    last_trial_at: dict[str, float] = field(default_factory=dict)
    under_floor_since: dict[str, float] = field(default_factory=dict)
    demoted: dict[str, float] = field(default_factory=dict)
    cliff: int | None = None
    pod_drafter: dict[str, tuple[str, float]] = field(default_factory=dict)  # pod → (drafter, since)
    last_score: dict[str, float] = field(default_factory=dict)  # drafter → its last measured score

    def switched_pods(self, now: float, window_s: float) -> set[str]:
        """Pods whose drafter changed within the metrics window: their speculative step times mix two
        drafters (the engine's step counters carry no drafter label), so calibration skips them."""
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
        k_status = status.get("kByBucket") or {}
        k_by_bucket = {label: int(k_status.get(label, 0)) for label in labels}
        return cls(
            drafter=drafter,
            k_by_bucket=k_by_bucket,
            engine_drafter=engine,
            policy_version=int(status.get("policyVersion") or 0),
            cliff=status.get("cliffBatchSize"),
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


class FleetCosts:
    """Calibrated step-time models, one per (model, GPU, TP, drafter) group, pooled over every pod of
    every resource in that group: what one resource learns about the hardware, all use. With `memory`
    (kept by the caller between ticks), every ratio measured in this window is remembered, and a bucket
    without a measurement in the window uses its remembered ratio (until `memory.ttl_s` after `now`)."""

    def __init__(
        self,
        views: Iterable[ResourceView],
        snapshot: FleetSnapshot,
        mixed: Iterable[tuple[str, str]] = (),
        memory: pol.RatioMemory | None = None,
        now: float = 0.0,
    ) -> None:
        mixed_pods = set(mixed)
        pooled: dict[tuple, dict[str, BucketStats]] = {}
        self._priors: dict[tuple, StepCostPrior] = {}
        self._bounds: dict[tuple, tuple[int, ...]] = {}
        for view in views:
            by_name = {d.name: d for d in view.spec.drafters}
            for d in view.spec.drafters:
                group = view.cost_group(d)
                self._priors.setdefault(group, view.prior(d))
                self._bounds.setdefault(group, tuple(view.spec.speculation.batch_buckets))
            for pod in view.pods:
                obs = snapshot.pods.get((view.namespace, pod))
                if obs is None or obs.drafter not in by_name:
                    continue
                group = view.cost_group(by_name[obs.drafter])
                target = pooled.setdefault(group, {})
                for label, stats in obs.buckets.items():
                    if (view.namespace, pod) in mixed_pods:
                        stats = pol.BucketStats(stats.steps_plain, stats.seconds_plain, stats.tokens_plain)
                    target.setdefault(label, pol.BucketStats()).add(stats)
        self._pooled = pooled
        self._cache: dict[tuple, pol.CalibratedCost] = {}
        self._own_cache: dict[tuple, pol.CalibratedCost] = {}
        groups = set(memory.plain) | set(memory.spec) if memory is not None else set()
        self._remembered = {group: memory.recall(group, now) for group in groups}  # type: ignore[union-attr]
        if memory is not None:
            for group in pooled:
                own = self._own(group)
                memory.record(group, own.plain_ratio, own.spec_ratio, now)

    def _own(
        self, group: tuple, view: ResourceView | None = None, drafter: DrafterSpec | None = None
    ) -> pol.CalibratedCost:
        if group not in self._own_cache:
            prior = self._priors.get(group) or view.prior(drafter)  # type: ignore[arg-type,union-attr]
            bounds = self._bounds.get(group) or tuple(view.spec.speculation.batch_buckets)  # type: ignore[union-attr]
            self._own_cache[group] = pol.CalibratedCost(
                prior, self._pooled.get(group, {}), bounds, remembered=self._remembered.get(group, ({}, {}))
            )
        return self._own_cache[group]

    def cost(self, view: ResourceView, drafter: DrafterSpec) -> pol.CalibratedCost:
        group = view.cost_group(drafter)
        if group not in self._cache:
            own = self._own(group, view, drafter)
            excess = None
            if not own.spec_ratio:
                siblings = [
                    self._own(g, view, None).spec_excess
                    for g in self._pooled
                    if g[:3] == group[:3] and g != group
                ]
                measured = sorted(e for e in siblings if e is not None)
                excess = measured[len(measured) // 2] if measured else None
            prior = self._priors.get(group) or view.prior(drafter)
            bounds = self._bounds.get(group) or tuple(view.spec.speculation.batch_buckets)
            self._cache[group] = pol.CalibratedCost(
                prior, self._pooled.get(group, {}), bounds, excess, self._remembered.get(group, ({}, {}))
            )
        return self._cache[group]


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


def _action(old: Mapping[str, int], new: Mapping[str, int]) -> str:
    on = [b for b in new if new[b] > 0 and old.get(b, 0) == 0]
    off = [b for b in new if new[b] == 0 and old.get(b, 0) > 0]
    if off:
        return "disable"
    if on:
        return "enable"
    return "setK" if dict(old) != dict(new) else "hold"


def decide(
    view: ResourceView, snapshot: FleetSnapshot, state: ResourceState, costs: FleetCosts, now: float
) -> Decision:
    """Decide this resource's policy; updates `state` (the desired policy) in place."""
    spec = view.spec
    spc = spec.speculation
    bounds = tuple(spc.batch_buckets)
    labels = bucket_labels(bounds)
    drafters = {d.name: d for d in spec.drafters}
    observations = [
        snapshot.pods[(view.namespace, p)] for p in view.pods if (view.namespace, p) in snapshot.pods
    ]
    missing = [
        p
        for p in view.pods
        if not snapshot.pods.get((view.namespace, p), PodObservation("", "")).has_engine_data
    ]

    def finish(action: str, reason: str, changed: bool, rollout: str | None = None) -> Decision:
        if changed:
            state.policy_version += 1
        return _decision(view, state, observations, action, reason, changed, rollout, scores, now)

    scores: dict[str, float] = {}
    old_table = dict(state.k_by_bucket)
    old_drafter = state.drafter
    old_canary = state.canary

    if spc.mode == "off" or not drafters:
        state.k_by_bucket = {label: 0 for label in labels}
        state.canary = None
        changed = old_table != state.k_by_bucket or old_canary is not None
        return finish("disable" if changed else "hold", "speculation.mode is off", changed)
    if state.drafter not in drafters:
        state.drafter = (spec.initial_drafter or spec.drafters[0]).name
    if spc.mode == "on":
        default = spec.initial_drafter or spec.drafters[0]
        state.drafter = default.name
        state.k_by_bucket = {label: default.max_speculative_tokens for label in labels}
        state.canary = None
        changed = old_table != state.k_by_bucket or old_drafter != state.drafter or old_canary is not None
        return finish("enable" if changed else "hold", "speculation.mode is on", changed)
    if not view.pods:
        return finish("hold", "no ready pods", False)
    if missing:
        # Partial data: deciding on the pods that answered could push the others a policy learned from
        # a different load; keep everything in force until the whole group is seen again.
        return finish("noData", f"no metrics for pods {', '.join(sorted(missing))}", False)

    # Acceptance per drafter on this resource's traffic in the window. Only drafters measured now are
    # compared: an older measurement was taken on another traffic mix (trials keep the others fresh).
    accs: dict[str, pol.Acceptance] = {}
    for name, d in drafters.items():
        stats, fallback = _pooled_acceptance_stats(observations, name)
        accs[name] = pol.acceptance(stats, d.max_speculative_tokens, fallback if fallback.drafts else None)

    weights: dict[str, float] = {}
    for obs in observations:
        for label, s in obs.buckets.items():
            weights[label] = weights.get(label, 0.0) + s.steps_plain + s.steps_spec
    for name, d in drafters.items():
        if accs[name].source != "prior":
            scores[name] = pol.drafter_score(
                accs[name], costs.cost(view, d), bounds, d.max_speculative_tokens, weights
            )

    # Demotion: a drafter whose MAL at its largest K stays under the floor for a cooldown.
    notes: list[str] = []
    for name in list(state.demoted):
        if now - state.demoted[name] >= DEMOTION_TTL_S:
            del state.demoted[name]
    for name, d in drafters.items():
        acc = accs[name]
        if acc.source == "prior" or name in state.demoted:
            continue
        if acc.tokens(d.max_speculative_tokens) < spc.mal_floor:
            since = state.under_floor_since.setdefault(name, now)
            if now - since >= spc.cooldown_seconds:
                state.demoted[name] = now
                state.under_floor_since.pop(name, None)
                notes.append(
                    f"demoted {name}: MAL {acc.tokens(d.max_speculative_tokens):.2f} < floor {spc.mal_floor}"
                )
        else:
            state.under_floor_since.pop(name, None)

    # Which drafter: the best measured one, by a margin, after a cooldown; never a demoted one. A demoted
    # drafter in force gives way at once, to the best measured one or else the best remembered one.
    rollout: str | None = None
    state.last_score.update(scores)
    eligible = {n: sc for n, sc in scores.items() if n not in state.demoted}
    best: str | None = None
    if state.drafter in state.demoted:
        fallback = {n: state.last_score.get(n, 0.0) for n in drafters if n not in state.demoted}
        pool = eligible or fallback
        best = max(pool, key=lambda n: pool[n]) if pool else None
    elif eligible and now - state.last_switch_at >= spc.cooldown_seconds:
        candidate = max(eligible, key=lambda n: eligible[n])
        if eligible[candidate] >= eligible.get(state.drafter, 0.0) * (1 + SWITCH_MARGIN):
            best = candidate
    if best is not None and best != state.drafter:
        notes.append(
            f"drafter {state.drafter}→{best}: predicted gain {state.last_score.get(best, 0.0):.2f} "
            f"vs {scores.get(state.drafter, 0.0):.2f}"
        )
        # The drafter left behind is tried again after one cooldown, not a whole trial period: the
        # fleet-wide measurement of the new one may disappoint.
        state.last_trial_at[state.drafter] = now - TRIAL_PERIOD_S + spc.cooldown_seconds
        if not live_switchable(drafters[best], state.engine_drafter):
            rollout = best
            state.engine_drafter = best if drafters[best].placement == "colocated" else None
        state.drafter = best
        state.last_switch_at = now
        state.flipped_at = {}
        state.k_by_bucket = {label: 0 for label in labels}
    if state.drafter in state.demoted:
        # Every drafter demoted: speculation off until a demotion expires and a trial finds one above
        # the floor.
        state.k_by_bucket = {label: 0 for label in labels}
        state.cliff = 1
        _plan_canary(view, state, accs, costs, observations, now, notes)
        changed = old_table != state.k_by_bucket or old_canary != state.canary
        reason = "; ".join(notes) or f"every drafter demoted ({', '.join(sorted(state.demoted))})"
        return finish("demote" if changed else "hold", reason, changed)

    active = drafters[state.drafter]
    acc, cost = accs[state.drafter], costs.cost(view, active)
    max_k = active.max_speculative_tokens
    choices = pol.choose_table(acc, cost, bounds, max_k)
    hysteresis = pol.Hysteresis(spc.min_gain, spc.cooldown_seconds)
    current = {label: min(state.k_by_bucket.get(label, 0), max_k) for label in labels}
    update = pol.update_table(current, choices, hysteresis, state.flipped_at, now)
    state.k_by_bucket = update.k_by_bucket
    state.flipped_at.update(update.flipped)
    state.cliff = pol.cliff_batch_size(acc, cost, bounds, max_k, spc.min_gain)
    notes.extend(update.reasons)
    _plan_canary(view, state, accs, costs, observations, now, notes)

    changed = old_table != state.k_by_bucket or old_drafter != state.drafter or old_canary != state.canary
    if rollout:
        action = "rollout"
    elif old_drafter != state.drafter:
        action = "switchDrafter"
    elif any(n.startswith("demoted") for n in notes):
        action = "demote"
    else:
        action = _action(old_table, state.k_by_bucket)
        if action == "hold" and old_canary != state.canary and state.canary is not None:
            action = state.canary.purpose
    if not notes:
        notes.append(_summary(state, acc))
    return finish(action, "; ".join(notes), changed, rollout)


def _summary(state: ResourceState, acc: pol.Acceptance) -> str:
    cliff = f"cliff at batch {state.cliff}" if state.cliff else "no cliff up to the largest bucket"
    return f"{state.drafter}: {cliff}, acceptance {acc.source} α1={acc.alphas[0]:.2f}"


def _plan_canary(
    view: ResourceView,
    state: ResourceState,
    accs: Mapping[str, pol.Acceptance],
    costs: FleetCosts,
    observations: list[PodObservation],
    now: float,
    notes: list[str],
) -> None:
    """Keep measuring what is switched off: one canary pod at a time either tries another drafter
    (trial) or speculates in the off bucket nearest the cliff that has traffic (explore)."""
    spc = view.spec.speculation
    interval = spc.evaluation_interval_seconds
    if state.canary is not None:
        alive = state.canary.pod in view.pods and state.canary.drafter not in state.demoted
        if state.canary.until > now and alive:
            return
        state.canary = None
    if spc.exploration_share <= 0:
        return
    drafters = {d.name: d for d in view.spec.drafters}
    pod = sorted(view.pods)[state.canary_round % len(view.pods)]
    active_score = state.last_score.get(state.drafter, 0.0) if accs[state.drafter].source != "prior" else 0.0
    # Trials: drafters that can run live and have not been measured for a trial period.
    for name, d in drafters.items():
        if name == state.drafter or name in state.demoted or not live_switchable(d, state.engine_drafter):
            continue
        since_trial = now - state.last_trial_at.get(name, -math.inf)
        # Due every trial period, and sooner when its last score beats the live score of the drafter
        # in force (the traffic mix may have moved in its favour): measure it again, then compare.
        promising = state.last_score.get(name, 0.0) > active_score * (1 + SWITCH_MARGIN)
        if since_trial < TRIAL_PERIOD_S and not (promising and since_trial >= 2 * TRIAL_TICKS * interval):
            continue
        cost = costs.cost(view, d)
        choices = pol.choose_table(accs[name], cost, spc.batch_buckets, d.max_speculative_tokens)
        # Every bucket with a positive predicted gain, so the trial measures the drafter where it may pay.
        table = {label: (c.k if c.gain >= 1.0 else 0) for label, c in choices.items()}
        if not any(table.values()):
            table = {label: 1 for label in choices}
        state.canary = Canary(pod, name, table, now + TRIAL_TICKS * interval, "trial")
        state.last_trial_at[name] = now
        state.canary_round += 1
        notes.append(f"trial of drafter {name} on pod {pod}")
        return
    # Exploration: speculate on the canary in the lowest off bucket that sees traffic but has no
    # speculative step-time measurement; often enough that the canary's share stays near explorationShare.
    period = EXPLORE_TICKS * interval / (spc.exploration_share * len(view.pods))
    if now - state.last_explore_at < max(period, EXPLORE_TICKS * interval):
        return
    active = drafters[state.drafter]
    cost = costs.cost(view, active)
    traffic: dict[str, float] = {}
    for obs in observations:
        for label, s in obs.buckets.items():
            traffic[label] = traffic.get(label, 0.0) + s.steps_plain
    for label in bucket_labels(spc.batch_buckets):
        if state.k_by_bucket.get(label, 0) > 0 or traffic.get(label, 0.0) < pol.MIN_STEPS:
            continue
        if cost.measured_spec(label):
            continue
        choice = pol.best_k(accs[state.drafter], cost, label, active.max_speculative_tokens)
        table = dict(state.k_by_bucket)
        table[label] = choice.k
        state.canary = Canary(pod, state.drafter, table, now + EXPLORE_TICKS * interval, "explore")
        state.last_explore_at = now
        state.canary_round += 1
        notes.append(f"explore bucket {label} with k={choice.k} on pod {pod}")
        return


def _decision(
    view: ResourceView,
    state: ResourceState,
    observations: list[PodObservation],
    action: str,
    reason: str,
    changed: bool,
    rollout: str | None,
    scores: dict[str, float],
    now: float,
) -> Decision:
    mode = "off" if view.spec.speculation.mode == "off" else "on"
    pods: dict[str, PodTarget] = {}
    for pod in view.pods:
        if state.canary is not None and state.canary.pod == pod:
            pods[pod] = PodTarget(state.canary.drafter, mode, dict(state.canary.k_by_bucket))
        else:
            pods[pod] = PodTarget(state.drafter, mode, dict(state.k_by_bucket))
        if state.pod_drafter.get(pod, ("", 0.0))[0] != pods[pod].drafter:
            state.pod_drafter[pod] = (pods[pod].drafter, now)
    for pod in set(state.pod_drafter) - set(view.pods):
        del state.pod_drafter[pod]
    fleet = BucketStats()
    by_bucket: dict[str, BucketStats] = {}
    for obs in observations:
        for label, s in obs.by_drafter.get(state.drafter, {}).items():
            by_bucket.setdefault(label, BucketStats()).add(s)
            fleet.add(s)
        if not obs.by_drafter and obs.fallback is not None:
            fleet.add(obs.fallback)
    utils = [o.gpu_util for o in observations if o.gpu_util is not None]
    pod_batch = {o.pod: o.running for o in observations}
    return Decision(
        action=action,
        reason=reason,
        changed=changed,
        policy_version=state.policy_version,
        drafter=state.drafter,
        k_by_bucket=dict(state.k_by_bucket),
        cliff=state.cliff,
        pods=pods,
        rollout_drafter=rollout,
        fleet_mal={label: round(s.mal, 3) for label, s in by_bucket.items() if s.mal is not None},
        mean_accepted_length=fleet.mal,
        acceptance_rate=(fleet.accepted / fleet.draft_tokens) if fleet.draft_tokens > 0 else None,
        gpu_utilization=sum(utils) / len(utils) if utils else None,
        pod_mal={o.pod: o.mal for o in observations},
        pod_batch=pod_batch,
        pod_drafter={o.pod: o.drafter for o in observations},
        scores=scores,
        demoted=tuple(sorted(state.demoted)),
    )


def speculating(target: PodTarget, batch: float | None, bounds: Iterable[int]) -> bool | None:
    """Whether a pod at this batch size speculates under its target policy."""
    if batch is None:
        return None
    return (
        target.mode == "on" and target.k_by_bucket.get(bucket_for(max(1, round(batch)), tuple(bounds)), 0) > 0
    )
