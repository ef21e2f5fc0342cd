"""Shadow drafting: the hosted drafters that are loaded but not in force draft, now and then, for a few rows
of the live traffic, after the live answer has gone out; once the engine's next tokens for a row arrive,
each shadow draft is scored as the engine scores a live one, by the longest prefix of it that the target
produced. The counts are exported per drafter and position (docs/metrics.md), so the controller knows
every drafter's acceptance on the traffic of this very window, not only the one in force
(docs/policy.md, "Shadow acceptance").

Why the score is the acceptance the draft would have had live: the sidecar's drafters propose one token
per position, and vLLM accepts such a token with probability p_target(token) under speculative sampling;
the target's own token equals it with that same probability (and under greedy decoding both are 0 or 1
and agree). So a shadow draft's matched prefix is distributed as its accepted length would have been.

The cost is bounded twice: at most `rows` rows per drafter per call, and shadow work gets at most
`share` of the connection's wall time, split evenly between the shadow drafters, each timed on its own
(after a drafter's shadow draft of t seconds, its next waits t / its share): a costly drafter (a draft
model's K forward passes) drafts less often, and does not hold back a cheap one (n-gram lookup).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specserve_engine.drafters import Drafter, Seq

SHADOW_ROWS = 4
SHADOW_SHARE = 0.05


@dataclass
class _Pending:
    epoch: int
    start: int  # index in the sequence of the first drafted token
    tokens: list[int]


def matched_prefix(draft: Sequence[int], actual: np.ndarray) -> int | None:
    """How many leading draft tokens the target produced; None while too few actual tokens arrived to
    tell (a mismatch already seen decides early)."""
    for i, token in enumerate(draft):
        if i >= len(actual):
            return None
        if int(actual[i]) != token:
            return i
    return len(draft)


ScoreSink = Callable[[str, int, int], None]  # drafter, draft length (0: nothing to propose), matched prefix
ErrorSink = Callable[[str, Exception], None]  # drafter, what it raised


class ShadowDrafts:
    """One engine connection's shadow drafts: which rows each shadow drafter follows, its pending drafts,
    and the time budget. Used from that connection's thread only."""

    def __init__(
        self,
        on_score: ScoreSink,
        on_error: ErrorSink,
        rows: int = SHADOW_ROWS,
        share: float = SHADOW_SHARE,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.on_score = on_score
        self.on_error = on_error
        self.rows = rows
        self.share = share
        self.clock = clock
        self.pending: dict[str, dict[tuple[int, int], _Pending]] = {}
        self.followed: dict[str, list[tuple[int, int]]] = {}
        self.next_at: dict[str, float] = {}  # drafter → when its budget lets it draft again

    def score(self, seqs: Sequence[Seq]) -> None:
        """Score the pending drafts whose rows now hold enough tokens; drop those whose row started over."""
        if not any(self.pending.values()):
            return
        by_key = {s.key: s for s in seqs}
        for drafter, pending in self.pending.items():
            for key in [k for k in pending if k in by_key]:
                p, seq = pending[key], by_key[key]
                if seq.epoch != p.epoch:
                    del pending[key]
                    continue
                matched = matched_prefix(p.tokens, seq.tokens[p.start :])
                if matched is not None:
                    del pending[key]
                    self.on_score(drafter, len(p.tokens), matched)

    def draft(
        self, drafters: Sequence[Drafter], rows: Sequence[tuple[Seq, int]], locks: dict[str, threading.Lock]
    ) -> None:
        """One shadow pass: each drafter whose budget allows drafts for the rows it follows (kept while
        they last, topped up from this call's rows) that have no draft waiting for its score. `rows` pairs
        each row's sequence with the most tokens the engine lets it draft. A drafter that raises (or
        answers the wrong shape) drafts nothing in this pass; the others still do."""
        alive = {seq.key: (seq, max_k) for seq, max_k in rows}
        share = self.share / max(1, len(drafters))
        for drafter in drafters:
            pending = self.pending.setdefault(drafter.name, {})
            for key in [k for k in pending if k not in alive]:
                del pending[key]  # the row finished: its draft can never be scored
            t0 = self.clock()
            if t0 < self.next_at.get(drafter.name, 0.0):
                continue
            followed = [k for k in self.followed.get(drafter.name, []) if k in alive]
            followed += [k for k in alive if k not in followed][: max(0, self.rows - len(followed))]
            self.followed[drafter.name] = followed
            todo = [alive[k] for k in followed if k not in pending]
            ks = [min(max_k, drafter.max_k) for _, max_k in todo]
            todo = [row for row, k in zip(todo, ks, strict=True) if k > 0]
            ks = [k for k in ks if k > 0]
            if not todo:
                continue
            try:
                with locks[drafter.name]:
                    drafts = drafter.draft([seq for seq, _ in todo], ks)
                kept = [[int(t) for t in d[:k]] for d, k in zip(drafts, ks, strict=True)]
            except Exception as exc:
                self.on_error(drafter.name, exc)
            else:
                for (seq, _), tokens in zip(todo, kept, strict=True):
                    if tokens:
                        pending[seq.key] = _Pending(seq.epoch, len(seq.tokens), tokens)
                    else:
                        # Nothing to propose (n-gram found no match): live, this row would verify one
                        # token without a draft. Scored at once as a row without a draft, so that the
                        # drafts over the rows give its proposal rate.
                        self.on_score(drafter.name, 0, 0)
            end = self.clock()
            self.next_at[drafter.name] = end + (end - t0) / share
