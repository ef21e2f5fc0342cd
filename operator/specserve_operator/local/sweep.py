"""The best static table in hindsight, the strongest fixed alternative to the controller: what a user who
tuned vLLM's dynamic speculative-decoding table (one drafter, K per batch-size bucket) for exactly this
traffic would run. The local fleet measures every candidate on its own pods for each traffic shape of
the pattern (concurrency and code/prose mix), then this module picks the table, as a plain function of
the measurements (docs/local-fleet.md, "The best static table")."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specserve_engine.buckets import bucket_for, bucket_labels
from specserve_operator.local.traffic import Phase, TrafficPattern


@dataclass(frozen=True)
class Shape:
    """What a phase looks like to the engine: how many requests in flight, and which prompts."""

    concurrency: int
    code_fraction: float


@dataclass(frozen=True)
class Candidate:
    drafter: str | None  # None: speculation off
    k: int  # the same K in every bucket; 0 with drafter None


@dataclass(frozen=True)
class SweepPoint:
    shape: Shape
    candidate: Candidate
    tokens_per_s: float


@dataclass(frozen=True)
class StaticTable:
    drafter: str
    k_by_bucket: dict[str, int]
    predicted_tokens: float  # sum over the pattern's phases of duration x measured tokens/s


def shape_of(phase: Phase) -> Shape:
    return Shape(phase.concurrency, phase.code_fraction)


def sweep_shapes(pattern: TrafficPattern) -> list[Shape]:
    """The pattern's distinct shapes, in the order they first occur."""
    return list(dict.fromkeys(shape_of(p) for p in pattern.phases))


def sweep_candidates(max_k_by_drafter: dict[str, int]) -> list[Candidate]:
    """Off, then every drafter at every K from 1 to its maximum."""
    return [Candidate(None, 0)] + [
        Candidate(name, k) for name, max_k in max_k_by_drafter.items() for k in range(1, max_k + 1)
    ]


def best_static_table(
    points: Sequence[SweepPoint], pattern: TrafficPattern, bucket_bounds: Sequence[int]
) -> StaticTable:
    """Per drafter, each bucket's K is the one (0 included) that generates the most tokens over the
    phases whose concurrency falls in that bucket; the drafter whose table generates the most tokens over
    the whole pattern wins. A candidate measured in several rounds counts at the median of its rounds. A
    bucket no phase falls in takes the choice of the nearest bucket that one does (by ratio of bounds):
    the batch passes through it only on the way between phases."""
    tps = median_tokens_per_s(points)
    drafters = list(dict.fromkeys(p.candidate.drafter for p in points if p.candidate.drafter is not None))
    if not drafters:
        raise ValueError("points: no drafter was measured")
    labels = bucket_labels(bucket_bounds)
    phases_in: dict[str, list[Phase]] = {}
    for phase in pattern.phases:
        phases_in.setdefault(bucket_for(phase.concurrency, bucket_bounds), []).append(phase)

    def tokens(phases: list[Phase], candidate: Candidate) -> float:
        missing = [shape_of(p) for p in phases if (shape_of(p), candidate) not in tps]
        if missing:
            raise ValueError(f"points: {candidate} was not measured at {missing[0]}")
        return sum(p.duration_s * tps[(shape_of(p), candidate)] for p in phases)

    best: StaticTable | None = None
    for drafter in drafters:
        ks = sorted({p.candidate.k for p in points if p.candidate.drafter == drafter})
        options = [Candidate(None, 0)] + [Candidate(drafter, k) for k in ks]
        chosen = {b: max(options, key=lambda c, b=b: tokens(phases_in[b], c)) for b in phases_in}
        k_by_bucket = {b: chosen[_nearest(b, list(phases_in), labels, bucket_bounds)].k for b in labels}
        total = sum(tokens(phases_in[b], chosen[b]) for b in phases_in)
        if best is None or total > best.predicted_tokens:
            best = StaticTable(drafter, k_by_bucket, total)
    assert best is not None
    return best


def tokens_per_s_by_round(points: Sequence[SweepPoint]) -> dict[tuple[Shape, Candidate], list[float]]:
    """Each (shape, candidate)'s tokens/s in every round it was measured, in the order measured."""
    rounds: dict[tuple[Shape, Candidate], list[float]] = {}
    for p in points:
        rounds.setdefault((p.shape, p.candidate), []).append(p.tokens_per_s)
    return rounds


def median_tokens_per_s(points: Sequence[SweepPoint]) -> dict[tuple[Shape, Candidate], float]:
    """Each (shape, candidate)'s tokens/s, the median of its rounds."""
    return {key: statistics.median(values) for key, values in tokens_per_s_by_round(points).items()}


def _nearest(bucket: str, measured: list[str], labels: list[str], bounds: Sequence[int]) -> str:
    if bucket in measured:
        return bucket
    # The overflow bucket (+Inf) sits one doubling above the last bound.
    upper = {label: float(b) for label, b in zip(labels, [*bounds, 2 * bounds[-1]], strict=True)}
    return min(measured, key=lambda m: abs(math.log(upper[m] / upper[bucket])))
