"""What the controller knows about the fleet after one read: counter increases over a window, per pod and
batch-size bucket. Built from rows of (series kind, labels, value), whether the rows come from PromQL
vectors (reader.py) or from the simulator's counters, so both feed the policy through the same code.
"""

from __future__ import annotations

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
ALL_BUCKETS = "*"  # the bucket of counters summed over buckets


@dataclass
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
        for pos, v in other.accepted_pos.items():
            self.accepted_pos[pos] = self.accepted_pos.get(pos, 0.0) + v
        for pos, v in other.proposed_pos.items():
            self.proposed_pos[pos] = self.proposed_pos.get(pos, 0.0) + v

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

    def bucket(self, label: str) -> BucketStats:
        return self.buckets.setdefault(label, BucketStats())

    @property
    def has_engine_data(self) -> bool:
        return bool(self.buckets) or self.fallback is not None

    def total(self) -> BucketStats:
        out = BucketStats()
        for b in self.buckets.values():
            out.add(b)
        return out

    @property
    def mal(self) -> float | None:
        total = self.total()
        if total.drafts > 0:
            return total.mal
        return self.fallback.mal if self.fallback else None


@dataclass
class FleetSnapshot:
    """One read of the whole fleet: pods by (namespace, pod)."""

    pods: dict[tuple[str, str], PodObservation] = field(default_factory=dict)
    window_s: float = 300.0

    def pod(self, namespace: str, name: str) -> PodObservation:
        key = (namespace, name)
        if key not in self.pods:
            self.pods[key] = PodObservation(namespace, name)
        return self.pods[key]


Row = tuple[str, dict[str, str], float]


def build_snapshot(rows: Iterable[Row], window_s: float) -> FleetSnapshot:
    """Fold rows into a snapshot; rows whose labels lack what their kind needs are skipped."""
    snap = FleetSnapshot(window_s=window_s)
    pods = snap.pods
    for kind, labels, value in rows:
        ns, pod = labels.get("namespace"), labels.get("pod")
        if not ns or not pod or value != value:  # NaN from a 0/0 in PromQL
            continue
        obs = pods.get((ns, pod))
        if obs is None:
            obs = pods[(ns, pod)] = PodObservation(ns, pod)
        _fold(obs, kind, labels, value)
    for obs in snap.pods.values():
        if obs.drafter is None and len(obs.by_drafter) == 1:
            obs.drafter = next(iter(obs.by_drafter))
    return snap


def _fold(obs: PodObservation, kind: str, labels: dict[str, str], value: float) -> None:
    bucket = labels.get("bucket")
    if kind in (STEPS, STEP_SECONDS, TOKENS) and bucket:
        b = obs.bucket(bucket)
        spec = labels.get("speculating") == "true"
        attr = {STEPS: "steps", STEP_SECONDS: "seconds", TOKENS: "tokens"}[kind]
        attr += "_spec" if spec else "_plain"
        setattr(b, attr, getattr(b, attr) + value)
    elif kind in (DRAFTS, DRAFT_TOKENS, ACCEPTED) and bucket:
        drafter = labels.get("drafter", "")
        for b in (
            obs.bucket(bucket),
            obs.by_drafter.setdefault(drafter, {}).setdefault(bucket, BucketStats()),
        ):
            setattr(b, kind, getattr(b, kind) + value)
    elif kind in (ACCEPTED_POS, PROPOSED_POS) and labels.get("position", "").isdigit():
        # Per-position counters may come pooled over buckets (the reader's query pools them).
        drafter = labels.get("drafter", "")
        b = obs.by_drafter.setdefault(drafter, {}).setdefault(bucket or ALL_BUCKETS, BucketStats())
        target = b.accepted_pos if kind == ACCEPTED_POS else b.proposed_pos
        pos = int(labels["position"])
        target[pos] = target.get(pos, 0.0) + value
    elif kind == POLICY_INFO and value > 0:
        obs.drafter = labels.get("drafter") or obs.drafter
        obs.mode = labels.get("mode") or obs.mode
        version = labels.get("policy_version", "")
        obs.policy_version = int(version) if version.isdigit() else obs.policy_version
    elif kind == RUNNING:
        obs.running = (obs.running or 0.0) + value
    elif kind == GPU_UTIL:
        # DCGM reports percent per GPU; a pod with several GPUs gets their mean.
        obs.gpu_util = value / 100.0
    elif kind in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED):
        fb = obs.fallback or BucketStats()
        attr = {VLLM_DRAFTS: "drafts", VLLM_DRAFT_TOKENS: "draft_tokens", VLLM_ACCEPTED: "accepted"}[kind]
        setattr(fb, attr, getattr(fb, attr) + value)
        obs.fallback = fb
