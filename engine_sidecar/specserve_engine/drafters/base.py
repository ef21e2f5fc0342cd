"""What every sidecar drafter is: given sequences (whole token arrays, identified by a key and an epoch),
return up to K draft tokens for each. Drafters keep per-sequence state (an index, a KV cache) keyed by
`Seq.key` and rebuild it whenever the epoch changes, so each step costs only the tokens that are new.

A sequence may bring many new tokens at once: a long prompt, or the tokens of a stretch of K = 0 steps
when speculation resumes. A drafter takes in at most `catch_up_tokens` of a sequence's new tokens per call
and drafts nothing for it until it has caught up, so one 32K-token row costs a bounded share of each call
and the other rows keep their drafts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Seq:
    key: tuple[int, int]  # (connection, engine row)
    epoch: int  # bumped whenever the row starts a new sequence
    tokens: np.ndarray  # int32, the whole sequence so far (prompt and output)


class Drafter(ABC):
    def __init__(self, name: str, method: str, max_k: int, catch_up_tokens: int) -> None:
        self.name = name
        self.method = method
        self.max_k = max_k
        self.catch_up_tokens = catch_up_tokens  # new tokens of one sequence taken in per call

    def load(self) -> None:  # noqa: B027 - light drafters have nothing to load
        """Heavy set-up (weights), run in a background thread before the drafter takes traffic."""

    @abstractmethod
    def draft(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens continuing seqs[i]."""

    @abstractmethod
    def forget(self, connection: int) -> None:
        """Drop the state of every sequence of a closed connection."""


class DrafterError(Exception):
    """A drafter could not be built or loaded (bad source, unsupported method)."""
