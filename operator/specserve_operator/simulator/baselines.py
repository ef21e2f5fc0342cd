"""The alternatives specserve is compared with, as the simulator runs them (docs/policy.md, "Baselines").

- `StaticTable`: one drafter and a fixed K per batch-size bucket, 0 from a cut-off on: vLLM's dynamic
  speculative decoding table, configured once. `static_candidates` lists the tables the benchmark sweeps
  to find the best one for a trace in hindsight.
- `EmaTiers` (SGLang-style): an exponential moving average of the accepted length per draft moves K one
  tier up when most drafts are accepted and one tier down when few are; batch size plays no part.
- `BucketBandit` (Nightjar-style): per batch-size bucket, a discounted UCB bandit over K = 0..max, its
  reward the tokens per second each sequence got, pooled over the fleet's pods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StaticTable:
    drafter: int
    k_by_bucket: tuple[int, ...]  # one per bucket, "+Inf" last


class EmaTiers:
    """K per pod from tiers (1, ⌈max/2⌉, max): up when the EMA of accepted tokens per draft reaches `up`
    of K, down when it falls under `down` of K."""

    def __init__(self, pods: int, max_k: int, beta: float = 0.2, up: float = 0.6, down: float = 0.3) -> None:
        self.tiers = np.array(sorted({1, math.ceil(max_k / 2), max_k}))
        self.tier = np.full(pods, len(self.tiers) - 1)
        self.ema = np.full(pods, np.nan)
        self.beta, self.up, self.down = beta, up, down
        self.switches = 0

    def k(self) -> np.ndarray:
        return self.tiers[self.tier]

    def observe(self, accepted_per_draft: np.ndarray) -> None:
        """One quantum's accepted tokens per draft, per pod (NaN: the pod drafted nothing)."""
        seen = ~np.isnan(accepted_per_draft)
        fresh = seen & np.isnan(self.ema)
        self.ema = np.where(fresh, accepted_per_draft, self.ema)
        blend = seen & ~fresh
        self.ema = np.where(blend, (1 - self.beta) * self.ema + self.beta * accepted_per_draft, self.ema)
        k = self.k()
        move = np.where(
            seen & (self.ema >= self.up * k), 1, np.where(seen & (self.ema < self.down * k), -1, 0)
        )
        new = np.clip(self.tier + move, 0, len(self.tiers) - 1)
        self.switches += int((new != self.tier).sum())
        self.tier = new


class BucketBandit:
    """Discounted UCB over K = 0..max_k per batch-size bucket, shared by the fleet's pods. Rewards are
    normalised by the best reward seen in the bucket, so the exploration bonus `c` is relative."""

    def __init__(self, buckets: int, max_k: int, gamma: float = 0.98, c: float = 0.1) -> None:
        self.n = np.zeros((buckets, max_k + 1))
        self.s = np.zeros((buckets, max_k + 1))
        self.best = np.zeros(buckets)
        self.gamma, self.c = gamma, c
        self.last = np.full(0, -1)
        self.switches = 0

    def choose(self, bucket: np.ndarray) -> np.ndarray:
        n, s = self.n[bucket], self.s[bucket]
        total = n.sum(axis=1, keepdims=True)
        mean = np.where(n > 0, s / np.maximum(n, 1e-12), 0.0)
        ucb = np.where(
            n > 0, mean + self.c * np.sqrt(np.log(np.maximum(total, 1.0)) / np.maximum(n, 1e-12)), np.inf
        )
        k = np.argmax(ucb, axis=1)  # untried arms first, lowest K first
        if self.last.shape == k.shape:
            self.switches += int((k != self.last).sum())
        self.last = k
        return k

    def observe(self, bucket: np.ndarray, k: np.ndarray, reward: np.ndarray) -> None:
        """Per pod that decoded this quantum: its bucket, the K it ran and tokens per second per sequence."""
        if not bucket.size:
            return
        seen = np.unique(bucket)
        self.n[seen] *= self.gamma
        self.s[seen] *= self.gamma
        np.maximum.at(self.best, bucket, reward)
        np.add.at(self.n, (bucket, k), 1.0)
        np.add.at(self.s, (bucket, k), reward / np.maximum(self.best[bucket], 1e-12))


def static_candidates(goodput: np.ndarray) -> dict[str, StaticTable]:
    """The static tables a hindsight sweep tries, from the true goodput of every (drafter, bucket, K),
    `goodput[d, b, k]` (tokens per second at the bucket's batch size, K = 0 plain). Per drafter: each
    bucket at its best K, speculation off from a cut-off on, the cut-off at the drafter's break-even
    bucket, one bucket either side of it, or none; and each single K in every bucket below the
    break-even; and no speculation at all. The goodput estimate proposes candidates; the sweep's
    simulation picks among them."""
    nd, nb, nk = goodput.shape
    tables: dict[str, StaticTable] = {"off": StaticTable(0, (0,) * nb)}  # speculation may not pay at all
    for d in range(nd):
        best = np.argmax(goodput[d, :, 1:], axis=1) + 1
        pays = goodput[d, np.arange(nb), best] > goodput[d, :, 0]
        even = int(np.argmin(pays)) if not pays.all() else nb
        for cut in sorted({max(even - 1, 0), even, min(even + 1, nb), nb}):
            k = tuple(int(best[b]) if b < cut else 0 for b in range(nb))
            tables[f"d{d}/best-k/cut{cut}"] = StaticTable(d, k)
        for kk in range(1, nk):
            tables[f"d{d}/k{kk}/cut{even}"] = StaticTable(d, tuple(kk if b < even else 0 for b in range(nb)))
    unique: dict[tuple, str] = {}
    for name, table in tables.items():
        unique.setdefault((table.drafter, table.k_by_bucket), name)
    return {name: tables[name] for name in unique.values()}
