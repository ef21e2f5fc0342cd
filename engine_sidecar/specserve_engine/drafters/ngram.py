"""N-gram prompt lookup: continue the sequence with what followed the latest earlier occurrence of its
last n tokens (n from `max_n` down to `min_n`), like vLLM's `ngram` method. Each sequence keeps an index
from n-gram to the position after its latest occurrence, updated only with the new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve_engine.drafters.base import Drafter, Seq


@dataclass
class _Index:
    epoch: int
    tokens: list[int] = field(default_factory=list)
    # n-gram (as a tuple) -> index just after its latest occurrence that has a continuation
    after: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramDrafter(Drafter):
    def __init__(
        self, name: str, max_k: int, min_n: int = 1, max_n: int = 4, catch_up_tokens: int = 4096
    ) -> None:
        super().__init__(name, "ngram", max_k, catch_up_tokens)
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[tuple[int, int], _Index] = {}

    def draft(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        return [self._draft_one(s, k) for s, k in zip(seqs, ks, strict=True)]

    def _draft_one(self, seq: Seq, k: int) -> list[int]:
        idx = self._index.get(seq.key)
        if idx is None or idx.epoch != seq.epoch or len(idx.tokens) > len(seq.tokens):
            idx = self._index[seq.key] = _Index(seq.epoch)
        toks = idx.tokens
        # Index each n-gram ending just before a token we now know follows it.
        for t in seq.tokens[len(toks) : len(toks) + self.catch_up_tokens].tolist():
            end = len(toks)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    idx.after[tuple(toks[end - n : end])] = end
            toks.append(t)
        if k <= 0 or len(toks) < len(seq.tokens):  # nothing wanted, or still catching up
            return []
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            pos = idx.after.get(tuple(toks[len(toks) - n :]))
            if pos is not None:
                return toks[pos : pos + k]
        return []

    def forget(self, connection: int) -> None:
        for key in [k for k in self._index if k[0] == connection]:
            del self._index[key]
