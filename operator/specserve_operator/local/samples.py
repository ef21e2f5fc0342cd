"""What the local fleet observes over time, as plain data: the live view draws the latest sample, the
report draws all of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from specserve_engine.buckets import DEFAULT_BUCKETS, bucket_for


@dataclass(frozen=True)
class PodSample:
    pod: str
    batch_size: float | None  # requests running in the engine (Prometheus gauge); None = no data yet
    tokens_per_s: float | None  # generated tokens per second over the last few seconds
    mal: float | None  # mean accepted length over the last window; None = no drafts in it
    drafter: str | None  # drafter in force (sidecar state); None = sidecar unreachable
    mode: str | None  # "on" | "off"
    k_by_bucket: dict[str, int] = field(default_factory=dict)
    policy_version: int | None = None
    bucket_bounds: tuple[int, ...] = DEFAULT_BUCKETS

    @property
    def k_now(self) -> int | None:
        """K the engine uses for its current batch size (0 = not speculating)."""
        if self.mode is None:
            return None
        if self.mode == "off":
            return 0
        batch = max(1, round(self.batch_size or 0))
        return self.k_by_bucket.get(bucket_for(batch, self.bucket_bounds), 0)

    @property
    def speculating(self) -> bool | None:
        k = self.k_now
        return None if k is None else k > 0


@dataclass(frozen=True)
class FleetSample:
    run: str
    t_s: float  # from the start of the run
    phase_index: int  # -1 outside the pattern (draining)
    phase: str
    target_concurrency: int
    in_flight: int
    pods: tuple[PodSample, ...]


@dataclass(frozen=True)
class DecisionRecord:
    run: str
    t_s: float
    pod: str  # a pod name, or "*" for a fleet-wide decision
    action: str  # e.g. enable, disable, set-k, switch-drafter, hold
    reason: str
    drafter: str | None = None
    k_by_bucket: dict[str, int] | None = None


def to_jsonable(items: Sequence[object]) -> list[dict]:
    return [asdict(i) for i in items]  # type: ignore[call-overload]
