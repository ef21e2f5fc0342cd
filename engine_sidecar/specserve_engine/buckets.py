"""Batch-size buckets: the key of every per-batch-size metric and of the K table (docs/metrics.md#labels).

A bucket is named by its upper bound; a batch larger than the last bound falls in "+Inf".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
INF = "+Inf"


def bucket_labels(bounds: Sequence[int]) -> list[str]:
    """Every bucket label for these bounds, in order, "+Inf" last."""
    return [str(b) for b in bounds] + [INF]


def bucket_for(batch_size: int, bounds: Sequence[int] = DEFAULT_BUCKETS) -> str:
    """The label of the smallest bucket whose bound is at least `batch_size`."""
    i = bisect_left(bounds, batch_size)
    return str(bounds[i]) if i < len(bounds) else INF
