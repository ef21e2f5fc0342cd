"""Suffix decoding: draft from every sequence the sidecar has seen, not only the current one. A global
table maps each context (the last n tokens, n in min_n..max_n) to how often each token followed it; a
draft extends the sequence greedily with the most frequent continuation of its longest known context, and
stops where that continuation is rarer than `min_prob`. Repetition across requests (templated output,
shared system prompts) is what it exploits, which prompt lookup within one request cannot see."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from specserve_engine.drafters.base import Drafter, Seq


@dataclass
class _Cursor:
    epoch: int
    indexed: int  # tokens of the sequence already counted in the global table
    tail: list[int]  # the last max_n tokens counted


class SuffixDrafter(Drafter):
    def __init__(
        self,
        name: str,
        max_k: int,
        min_n: int = 2,
        max_n: int = 8,
        min_prob: float = 0.1,
        max_contexts: int = 2_000_000,
        catch_up_tokens: int = 2048,
    ) -> None:
        super().__init__(name, "suffix", max_k, catch_up_tokens)
        self.min_n = min_n
        self.max_n = max_n
        self.min_prob = min_prob
        self.max_contexts = max_contexts
        self._next: dict[tuple[int, ...], Counter[int]] = {}
        self._cursors: dict[tuple[int, int], _Cursor] = {}

    def draft(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        return [self._draft_one(s, k) for s, k in zip(seqs, ks, strict=True)]

    def _count(self, seq: Seq) -> list[int] | None:
        """Count the sequence's new tokens (at most catch_up_tokens of them); its last max_n tokens, or
        None while it is still catching up."""
        cur = self._cursors.get(seq.key)
        if cur is None or cur.epoch != seq.epoch or cur.indexed > len(seq.tokens):
            cur = self._cursors[seq.key] = _Cursor(seq.epoch, 0, [])
        tail = cur.tail
        new = seq.tokens[cur.indexed : cur.indexed + self.catch_up_tokens].tolist()
        for t in new:
            for n in range(self.min_n, min(self.max_n, len(tail)) + 1):
                ctx = tuple(tail[len(tail) - n :])
                counter = self._next.get(ctx)
                if counter is None:
                    if len(self._next) >= self.max_contexts:
                        self._next.clear()  # bounded memory, checked where it grows: start learning afresh
                    counter = self._next[ctx] = Counter()
                counter[t] += 1
            tail.append(t)
            if len(tail) > self.max_n:
                del tail[0]
        cur.indexed += len(new)
        return list(tail) if cur.indexed == len(seq.tokens) else None

    def _draft_one(self, seq: Seq, k: int) -> list[int]:
        context = self._count(seq)
        out: list[int] = []
        if context is None:
            return out
        while len(out) < k:
            nxt = self._predict(context)
            if nxt is None:
                break
            out.append(nxt)
            context.append(nxt)
        return out

    def _predict(self, context: list[int]) -> int | None:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            counter = self._next.get(tuple(context[len(context) - n :]))
            if counter:
                token, count = counter.most_common(1)[0]
                if count / counter.total() >= self.min_prob:
                    return token
                return None
        return None

    def forget(self, connection: int) -> None:
        for key in [k for k in self._cursors if k[0] == connection]:
            del self._cursors[key]
