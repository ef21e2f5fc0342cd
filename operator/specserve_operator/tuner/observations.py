"""What the controller knows about the fleet after one read: counter increases over a window, per pod and
batch-size bucket; the per-position acceptance counts (live and shadow) and the steps per bucket over a
shorter window, since acceptance and the batch mix follow the traffic, which can change within seconds,
while step times are the hardware's and want many samples (docs/policy.md, "Two windows"). Built from
rows of (series kind, labels, value), whether the rows come from PromQL vectors (reader.py) or from the
simulator's counters, so both feed the policy through the same code.

`build_snapshot` is the one place rows become observations, and it validates them (docs/policy.md,
"Inputs the controller rejects"): a row that is not finite, negative, beyond any engine's reach, or without
the labels its kind needs is dropped; after folding, a bucket whose speculative counters contradict each
other (more accepted than drafted tokens, ...) loses those counters, and a side of a bucket whose steps
took no time, or implausibly long, or whose time was counted without steps, loses its step counters.
What was dropped is counted by reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# Row kinds: the `m` label the reader's queries attach (see reader.py), one per counter or gauge.
STEPS = "steps"
STEP_SECONDS = "step_seconds"
TOKENS = "tokens"
DRAFTS = "drafts"
DRAFT_TOKENS = "draft_tokens"
ACCEPTED = "accepted"
ACCEPTED_POS = "accepted_pos"
PROPOSED_POS = "proposed_pos"
POLICY_INFO = "policy_info"
RUNNING = "running"
GPU_UTIL = "gpu_util"
VLLM_DRAFTS = "vllm_drafts"
VLLM_DRAFT_TOKENS = "vllm_draft_tokens"
VLLM_ACCEPTED = "vllm_accepted"
DRAFTER_ERRORS = "drafter_errors"
SHADOW_ACCEPTED_POS = "shadow_accepted_pos"  # the sidecar's shadow drafts (docs/policy.md)
SHADOW_PROPOSED_POS = "shadow_proposed_pos"
SHADOW_ROWS = "shadow_rows"  # rows shadow-drafted for, with a proposal or without: the proposal rate's base
RECENT_STEPS = "recent_steps"  # steps per bucket over the acceptance window: the batch mix now
ALL_BUCKETS = "*"  # the bucket of counters summed over buckets

# Why a row, or a bucket's folded counters, was dropped: the `reason` label of the operator's
# dropped-rows counter (metric_names.OPERATOR_DROPPED_ROWS).
DROP_LABELS = "missing_labels"  # no namespace or pod, or not what its kind needs (bucket, position)
DROP_KIND = "unknown_kind"
DROP_NON_FINITE = "non_finite"
DROP_NEGATIVE = "negative"
DROP_IMPLAUSIBLE = "implausible"  # beyond what any engine counts in a window, or a GPU above 100 %
DROP_INCONSISTENT = "inconsistent"
DROP_ZERO_DURATION = "zero_duration"
DROP_REASONS = (
    DROP_LABELS,
    DROP_KIND,
    DROP_NON_FINITE,
    DROP_NEGATIVE,
    DROP_IMPLAUSIBLE,
    DROP_INCONSISTENT,
    DROP_ZERO_DURATION,
)
# No counter of one pod grows this much in a metrics window (a million steps a second for a day is
# 1e11); anything above is corruption, and bounding values keeps every ratio the policy takes finite.
MAX_VALUE = 1e12
# A decode step of any engine takes longer than a microsecond and less than an hour: a mean step time
# outside is a broken counter (and one near zero makes every step-time ratio divide by zero).
MIN_STEP_S = 1e-6
MAX_STEP_S = 3600.0
# The CRD's largest maxSpeculativeTokens (api/models.py): no draft is longer, no position higher.
MAX_SPECULATIVE_TOKENS = 16
MAX_POLICY_VERSION = 2**63 - 1  # the API server's int64
# Counters that are equal on the engine (drafts and draft tokens at K = 1, accepted and proposed at a
# position every draft passed) come out of PromQL's increase() a few ulps apart: a bound between two
# counters holds within this relative slack.
COUNTER_SLACK = 1e-9
# The acceptance window's share of the metrics window: 60 s of a cluster's 300 (two 30 s evaluation
# intervals), 12 s of the local fleet's 60 (two and a half of its 5 s intervals).
ACCEPTANCE_WINDOW_SHARE = 0.2
_DECIMAL = re.compile(r"[0-9]{1,19}")
# The K and position labels as the engine writes them, parsed once: a large fleet's tick has ~10^5 rows
# with one, and a lookup here costs a fraction of a regular expression and an int() per row.
_KS = {str(k): k for k in range(MAX_SPECULATIVE_TOKENS + 1)}
_POSITIONS = {str(p): p for p in range(MAX_SPECULATIVE_TOKENS)}


def acceptance_window_of(window_s: float) -> float:
    """The default acceptance window for a metrics window."""
    return window_s * ACCEPTANCE_WINDOW_SHARE


def stats_of(buckets: dict[str, BucketStats], label: str) -> BucketStats:
    """`buckets[label]`, made on first use (not `setdefault`, which would build one on every call)."""
    stats = buckets.get(label)
    if stats is None:
        stats = buckets[label] = BucketStats()
    return stats


def _merge(into: dict[int, float], other: dict[int, float]) -> None:
    for key, value in other.items():
        into[key] = into.get(key, 0.0) + value


@dataclass(slots=True)  # slots: a large fleet makes ~10^5 of these a tick
class BucketStats:
    """Counter increases for one bucket (of one pod, or summed over pods)."""

    steps_plain: float = 0.0
    seconds_plain: float = 0.0
    tokens_plain: float = 0.0
    steps_spec: float = 0.0
    seconds_spec: float = 0.0
    tokens_spec: float = 0.0
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_pos: dict[int, float] = field(default_factory=dict)
    proposed_pos: dict[int, float] = field(default_factory=dict)
    # Speculative steps and their seconds by the K they verified (engines that label K; see metrics.md).
    steps_by_k: dict[int, float] = field(default_factory=dict)
    seconds_by_k: dict[int, float] = field(default_factory=dict)

    def add(self, other: BucketStats) -> None:
        self.steps_plain += other.steps_plain
        self.seconds_plain += other.seconds_plain
        self.tokens_plain += other.tokens_plain
        self.steps_spec += other.steps_spec
        self.seconds_spec += other.seconds_spec
        self.tokens_spec += other.tokens_spec
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        # Most buckets have none of these: skip the loops (a large fleet adds buckets ~10^5 times a tick).
        if other.accepted_pos or other.proposed_pos:
            _merge(self.accepted_pos, other.accepted_pos)
            _merge(self.proposed_pos, other.proposed_pos)
        if other.steps_by_k or other.seconds_by_k:
            _merge(self.steps_by_k, other.steps_by_k)
            _merge(self.seconds_by_k, other.seconds_by_k)

    def add_drafts(self, other: BucketStats) -> None:
        """Add only the draft counters (drafts, draft tokens, accepted tokens): what MAL is read from."""
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted

    def plain_side(self) -> BucketStats:
        """A copy of the plain steps' counters only."""
        return BucketStats(self.steps_plain, self.seconds_plain, self.tokens_plain)

    def spec_side(self) -> BucketStats:
        """A copy of the speculative steps' counters, with the drafts and accepted tokens that give their
        batch size."""
        return BucketStats(
            steps_spec=self.steps_spec,
            seconds_spec=self.seconds_spec,
            tokens_spec=self.tokens_spec,
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted=self.accepted,
            steps_by_k=dict(self.steps_by_k),
            seconds_by_k=dict(self.seconds_by_k),
        )

    @property
    def mal(self) -> float | None:
        """Mean accepted length: tokens per verify step, bonus token included."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None


@dataclass
class PodObservation:
    namespace: str
    pod: str
    buckets: dict[str, BucketStats] = field(default_factory=dict)
    drafter: str | None = None  # the drafter in force (sidecar policy info), else the spec metrics' label
    mode: str | None = None
    policy_version: int | None = None
    running: float | None = None  # requests running now
    gpu_util: float | None = None  # 0..1
    fallback: BucketStats | None = None  # vLLM's own spec counters, no buckets (a stock image)
    # Spec counters split by the drafter that made the drafts (a canary pod may have run two).
    by_drafter: dict[str, dict[str, BucketStats]] = field(default_factory=dict)
    drafter_errors: dict[str, float] = field(default_factory=dict)  # drafter → failed draft calls
    # Per-position counts of the sidecar's shadow drafts, by drafter (loaded drafters not in force), and
    # the rows each shadow-drafted for (drafts at position 0 over these: its proposal rate).
    shadow: dict[str, BucketStats] = field(default_factory=dict)
    shadow_rows: dict[str, float] = field(default_factory=dict)
    failed_drafters: set[str] = field(default_factory=set)  # drafters the sidecar reports failed
    recent_steps: dict[str, float] = field(default_factory=dict)  # bucket → steps in the acceptance window
    # Drafters some of whose draft, per-position or shadow counters were refused in this read.
    refused_drafters: set[str] = field(default_factory=set)
    dropped: int = 0  # this pod's values refused as invalid (counted in the snapshot's `dropped` too)

    def bucket(self, label: str) -> BucketStats:
        return stats_of(self.buckets, label)

    @property
    def has_engine_data(self) -> bool:
        return bool(self.buckets) or self.fallback is not None

    @property
    def mal(self) -> float | None:
        """Mean accepted length over the pod's buckets, else from vLLM's own counters."""
        total = BucketStats()
        for b in self.buckets.values():
            total.add_drafts(b)
        if total.drafts > 0:
            return total.mal
        return self.fallback.mal if self.fallback else None


@dataclass
class FleetSnapshot:
    """One read of the whole fleet: pods by (namespace, pod)."""

    pods: dict[tuple[str, str], PodObservation] = field(default_factory=dict)
    window_s: float = 300.0
    dropped: dict[str, int] = field(default_factory=dict)  # reason (DROP_*) → rows or buckets dropped

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def pod(self, namespace: str, name: str) -> PodObservation:
        key = (namespace, name)
        if key not in self.pods:
            self.pods[key] = PodObservation(namespace, name)
        return self.pods[key]


Row = tuple[str, dict[str, str], float]

_ENGINE_KINDS = {STEPS: "steps", STEP_SECONDS: "seconds", TOKENS: "tokens"}
_SPEC_KINDS = frozenset((DRAFTS, DRAFT_TOKENS, ACCEPTED))
_POSITION_KINDS = frozenset((ACCEPTED_POS, PROPOSED_POS))
_SHADOW_KINDS = frozenset((SHADOW_ACCEPTED_POS, SHADOW_PROPOSED_POS))
_SHADOW_DRAFTER_KINDS = _SHADOW_KINDS | {SHADOW_ROWS}  # a drafter's shadow counters: each needs its label
_BUCKET_KINDS = frozenset((*_ENGINE_KINDS, *_SPEC_KINDS, RECENT_STEPS))  # rows per batch-size bucket
_BY_K = {STEPS: "steps_by_k", STEP_SECONDS: "seconds_by_k"}  # the engine counters also kept per K
# A bucket's engine counters of each side, plain then speculative (indexed by `speculating`), by attribute
# name, and by the row kind that adds to each: named once, since ~10^5 buckets a tick are checked.
_ENGINE_ATTRS = tuple(
    {kind: f"{attr}_{side}" for kind, attr in _ENGINE_KINDS.items()} for side in ("plain", "spec")
)
_SIDES = tuple(tuple(attrs.values()) for attrs in _ENGINE_ATTRS)  # (steps, seconds, tokens) of each side
_FALLBACK_KINDS = {VLLM_DRAFTS: "drafts", VLLM_DRAFT_TOKENS: "draft_tokens", VLLM_ACCEPTED: "accepted"}
_KINDS = frozenset(
    {
        *_ENGINE_KINDS,
        *_SPEC_KINDS,
        *_POSITION_KINDS,
        *_SHADOW_DRAFTER_KINDS,
        *_FALLBACK_KINDS,
        POLICY_INFO,
        RUNNING,
        GPU_UTIL,
        DRAFTER_ERRORS,
        RECENT_STEPS,
    }
)
# Per kind, which checks its rows need (bucket, K, position, drafter): one lookup per row, not a set each.
_RULES = {
    kind: (
        kind in _BUCKET_KINDS,
        kind in _ENGINE_KINDS,
        kind in _POSITION_KINDS | _SHADOW_KINDS,
        kind in _SHADOW_DRAFTER_KINDS,
    )
    for kind in _KINDS
}


def build_snapshot(rows: Iterable[Row], window_s: float) -> FleetSnapshot:
    """Fold valid rows into a snapshot, then drop the folded counters that contradict each other; every
    row or bucket left out is counted in `snapshot.dropped` by reason."""
    snap = FleetSnapshot(window_s=window_s)
    pods = snap.pods
    # Counters that lost a sibling row: a bucket whose accepted tokens were refused must not read as
    # drafts with nothing accepted, so its other counters of the same kind go too.
    tainted: dict[tuple[str, str], set[tuple]] = {}  # pod → what its refused rows leave incomplete
    for kind, labels, value in rows:
        reason = _row_problem(kind, labels, value)
        if reason is not None:
            snap.drop(reason)
            if labels.get("namespace") and labels.get("pod"):
                key = (labels["namespace"], labels["pod"])
                obs = pods.get(key) or pods.setdefault(key, PodObservation(*key))
                obs.dropped += 1
                tainted.setdefault(key, set()).add(_taint(kind, labels))
            continue
        key = (labels["namespace"], labels["pod"])
        obs = pods.get(key)
        if obs is None:
            obs = pods[key] = PodObservation(*key)
        _fold(obs, kind, labels, value)
    for key, obs in pods.items():
        _untaint(obs, tainted.get(key, ()))
        _check(obs, snap)
        if obs.drafter is None and len(obs.by_drafter) == 1:
            obs.drafter = next(iter(obs.by_drafter))
    return snap


def _taint(kind: str, labels: dict[str, str]) -> tuple:
    """What a refused row leaves without its sibling counters, in its pod: a (bucket, side) of step
    counters, a (drafter, bucket) of draft counters, or a drafter's per-position counters."""
    if kind in _ENGINE_KINDS:
        return ("steps", labels.get("bucket", ""), labels.get("speculating") == "true")
    if kind in _SPEC_KINDS:
        return ("drafts", labels.get("drafter", ""), labels.get("bucket", ""))
    if kind in _POSITION_KINDS:
        return ("positions", labels.get("drafter", ""))
    if kind in _SHADOW_DRAFTER_KINDS:
        return ("shadow", labels.get("drafter", ""))
    return ("other",)


def _untaint(obs: PodObservation, tainted: Iterable[tuple]) -> None:
    """Clear the pod's counters whose sibling rows were refused (see _taint)."""
    for taint in tainted:
        what = taint[0]
        if what == "steps":
            bucket, spec = taint[1], taint[2]
            stats = [obs.buckets.get(bucket)] + [b.get(bucket) for b in obs.by_drafter.values()]
            for b in (s for s in stats if s is not None):
                for attr in _SIDES[spec]:
                    setattr(b, attr, 0.0)
                if spec:
                    b.steps_by_k, b.seconds_by_k = {}, {}
        elif what == "drafts":
            obs.refused_drafters.add(taint[1])
            b = obs.by_drafter.get(taint[1], {}).get(taint[2])
            if b is not None:
                b.drafts = b.draft_tokens = b.accepted = 0.0
        elif what == "positions":
            obs.refused_drafters.add(taint[1])
            for b in obs.by_drafter.get(taint[1], {}).values():
                b.accepted_pos, b.proposed_pos = {}, {}
        elif what == "shadow":
            obs.refused_drafters.add(taint[1])
            obs.shadow.pop(taint[1], None)
            obs.shadow_rows.pop(taint[1], None)


def _row_problem(kind: str, labels: dict[str, str], value: float) -> str | None:
    """Why one row cannot be used on its own, or None."""
    rules = _RULES.get(kind)
    if rules is None:
        return DROP_KIND
    bucketed, engine, positioned, shadow = rules
    if not labels.get("namespace") or not labels.get("pod"):
        return DROP_LABELS
    if bucketed and not labels.get("bucket"):
        return DROP_LABELS
    if engine:
        k = labels.get("k")
        if k and k not in _KS:  # not as the engine writes it: parse it to tell a typo from a long draft
            if not _DECIMAL.fullmatch(k):
                return DROP_LABELS
            if int(k) > MAX_SPECULATIVE_TOKENS:
                return DROP_IMPLAUSIBLE
    if shadow and not labels.get("drafter"):
        return DROP_LABELS
    if positioned:
        position = labels.get("position", "")
        if position not in _POSITIONS:
            if not _DECIMAL.fullmatch(position):
                return DROP_LABELS
            if int(position) >= MAX_SPECULATIVE_TOKENS:
                return DROP_IMPLAUSIBLE
    if not math.isfinite(value):  # NaN from a 0/0 in PromQL, ±Inf from a broken exporter
        return DROP_NON_FINITE
    if value < 0:  # a counter's increase never is; a reset is already handled by increase()
        return DROP_NEGATIVE
    if value > MAX_VALUE or (kind == GPU_UTIL and value > 100.0):
        return DROP_IMPLAUSIBLE
    return None


def _number(label: str, parsed: dict[str, int]) -> int:
    """A K or position label that _row_problem accepted, as a number."""
    n = parsed.get(label)
    return int(label) if n is None else n


def _drafter_stats(obs: PodObservation, drafter: str, bucket: str) -> BucketStats:
    """One drafter's counters in one bucket of a pod, made on first use (no dict built per row)."""
    buckets = obs.by_drafter.get(drafter)
    if buckets is None:
        buckets = obs.by_drafter[drafter] = {}
    return stats_of(buckets, bucket)


def _fold(obs: PodObservation, kind: str, labels: dict[str, str], value: float) -> None:
    bucket = labels.get("bucket", "")
    if kind in _ENGINE_KINDS:
        spec = labels.get("speculating") == "true"
        attr = _ENGINE_ATTRS[spec][kind]
        targets = (obs.bucket(bucket),)
        drafter = labels.get("drafter") if spec else None
        if drafter:
            # Speculative steps of one drafter: its step times, even on a pod that switched drafters.
            targets = (targets[0], _drafter_stats(obs, drafter, bucket))
        k = _number(labels.get("k") or "0", _KS) if spec else 0
        by_k = _BY_K.get(kind) if k > 0 else None
        for b in targets:
            setattr(b, attr, getattr(b, attr) + value)
            if by_k is not None:
                counts = getattr(b, by_k)
                counts[k] = counts.get(k, 0.0) + value
    elif kind in _SPEC_KINDS:
        # Folded per drafter only; the bucket's totals are summed from the drafters that pass _check.
        obs.bucket(bucket)
        b = _drafter_stats(obs, labels.get("drafter", ""), bucket)
        setattr(b, kind, getattr(b, kind) + value)
    elif kind in _POSITION_KINDS:
        # Per-position counters may come pooled over buckets (the reader's query pools them).
        drafter = labels.get("drafter", "")
        b = _drafter_stats(obs, drafter, bucket or ALL_BUCKETS)
        target = b.accepted_pos if kind == ACCEPTED_POS else b.proposed_pos
        pos = _number(labels["position"], _POSITIONS)
        target[pos] = target.get(pos, 0.0) + value
    elif kind in _SHADOW_KINDS:
        b = stats_of(obs.shadow, labels["drafter"])
        target = b.accepted_pos if kind == SHADOW_ACCEPTED_POS else b.proposed_pos
        pos = _number(labels["position"], _POSITIONS)
        target[pos] = target.get(pos, 0.0) + value
    elif kind == POLICY_INFO:
        if value > 0:
            if labels.get("drafter_status") == "failed" and labels.get("drafter"):
                obs.failed_drafters.add(labels["drafter"])
            obs.drafter = labels.get("drafter") or obs.drafter
            obs.mode = labels.get("mode") or obs.mode
            version = labels.get("policy_version", "")
            if _DECIMAL.fullmatch(version) and int(version) <= MAX_POLICY_VERSION:
                obs.policy_version = int(version)
    elif kind == RUNNING:
        obs.running = (obs.running or 0.0) + value
    elif kind == GPU_UTIL:
        # DCGM reports percent per GPU; the reader's query averages a pod's GPUs.
        obs.gpu_util = value / 100.0
    elif kind in _FALLBACK_KINDS:
        fb = obs.fallback or BucketStats()
        attr = _FALLBACK_KINDS[kind]
        setattr(fb, attr, getattr(fb, attr) + value)
        obs.fallback = fb
    elif kind == SHADOW_ROWS:
        obs.shadow_rows[labels["drafter"]] = obs.shadow_rows.get(labels["drafter"], 0.0) + value
    elif kind == RECENT_STEPS:
        obs.recent_steps[bucket] = obs.recent_steps.get(bucket, 0.0) + value
    elif kind == DRAFTER_ERRORS:
        drafter = labels.get("drafter", "")
        obs.drafter_errors[drafter] = obs.drafter_errors.get(drafter, 0.0) + value


def _check(obs: PodObservation, snap: FleetSnapshot) -> None:
    """Validate what was folded for one pod, in place: rows that are each plausible can still contradict
    each other, and only once folded is a bucket's whole story known."""
    for b in obs.buckets.values():
        obs.dropped += _check_steps(b, snap)
    for buckets in obs.by_drafter.values():
        for label, b in buckets.items():
            obs.dropped += _check_steps(b, snap)
            if _spec_contradiction(b):
                snap.drop(DROP_INCONSISTENT)
                obs.dropped += 1
                b.drafts = b.draft_tokens = b.accepted = 0.0
            if _positions_contradiction(b):
                snap.drop(DROP_INCONSISTENT)
                obs.dropped += 1
                b.accepted_pos, b.proposed_pos = {}, {}
            if label in obs.buckets:
                obs.buckets[label].add_drafts(b)
    for name in [n for n, b in obs.shadow.items() if _positions_contradiction(b)]:
        snap.drop(DROP_INCONSISTENT)
        obs.dropped += 1
        del obs.shadow[name]
    # More shadow drafts than rows drafted for: the rows cannot be the base of a proposal rate.
    for name in [n for n, rows in obs.shadow_rows.items() if not _at_most(_shadow_drafts(obs, n), rows)]:
        snap.drop(DROP_INCONSISTENT)
        obs.dropped += 1
        del obs.shadow_rows[name]
    if obs.fallback is not None and _spec_contradiction(obs.fallback):
        snap.drop(DROP_INCONSISTENT)
        obs.dropped += 1
        obs.fallback = None


def _shadow_drafts(obs: PodObservation, drafter: str) -> float:
    """A drafter's shadow drafts in a pod: those with a token at position 0."""
    shadow = obs.shadow.get(drafter)
    return shadow.proposed_pos.get(0, 0.0) if shadow is not None else 0.0


def _step_time_fault(steps: float, seconds: float) -> str | None:
    """Why `steps` steps taking `seconds` in all cannot be true, or None. Time without steps is a
    step-seconds series without its step counter; steps that took no time (or next to none) would be
    infinitely fast and divide by zero downstream. Compared per step (a division): steps · MIN_STEP_S
    underflows to 0 for a subnormal step count."""
    if steps == 0:
        return DROP_INCONSISTENT
    if seconds / steps < MIN_STEP_S:
        return DROP_ZERO_DURATION
    if seconds / steps > MAX_STEP_S:
        return DROP_IMPLAUSIBLE
    return None


def _check_steps(b: BucketStats, snap: FleetSnapshot) -> int:
    """Drop a bucket's plain or speculative step counters where they cannot be true; how many sides."""
    dropped = 0
    for steps_attr, seconds_attr, tokens_attr in _SIDES:
        steps, seconds = getattr(b, steps_attr), getattr(b, seconds_attr)
        if steps == seconds == 0:
            continue
        reason = _step_time_fault(steps, seconds)
        if reason is not None:
            snap.drop(reason)
            dropped += 1
            for attr in (steps_attr, seconds_attr, tokens_attr):
                setattr(b, attr, 0.0)
    if not (b.steps_by_k or b.seconds_by_k):
        return dropped
    if b.steps_spec == 0:
        b.steps_by_k, b.seconds_by_k = {}, {}
    for k in set(b.steps_by_k) | set(b.seconds_by_k):  # the same rules for each K's share
        steps, seconds = b.steps_by_k.get(k, 0.0), b.seconds_by_k.get(k, 0.0)
        if steps == seconds == 0:  # a K used before the window: its series exists and did not grow
            b.steps_by_k.pop(k, None)
            b.seconds_by_k.pop(k, None)
        elif _step_time_fault(steps, seconds) is not None:
            snap.drop(DROP_INCONSISTENT if steps == 0 else DROP_IMPLAUSIBLE)
            dropped += 1
            b.steps_by_k.pop(k, None)
            b.seconds_by_k.pop(k, None)
    return dropped


def _spec_contradiction(b: BucketStats) -> bool:
    """Drafts, draft tokens and accepted tokens that cannot all be true: every draft has 1 to
    MAX_SPECULATIVE_TOKENS tokens, and no more tokens are accepted than were drafted."""
    if b.drafts == 0:
        return b.draft_tokens > 0 or b.accepted > 0
    return not (
        _at_most(b.drafts, b.draft_tokens)
        and _at_most(b.draft_tokens, b.drafts * MAX_SPECULATIVE_TOKENS)
        and _at_most(b.accepted, b.draft_tokens)
    )


def _at_most(a: float, b: float) -> bool:
    """a ≤ b, but for COUNTER_SLACK."""
    return a <= b * (1 + COUNTER_SLACK)


def _positions_contradiction(b: BucketStats) -> bool:
    """A position with more accepted than proposed tokens, or accepted tokens at a position never proposed."""
    return any(not _at_most(v, b.proposed_pos.get(pos, 0.0)) for pos, v in b.accepted_pos.items())
