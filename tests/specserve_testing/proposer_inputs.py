"""What the engine hands the sidecar proposer, for the in-process draft-socket and proposer tests: the
input batch arrays and a DraftClient with test-sized settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specserve_engine.vllm_plugins.proposer import DraftClient

MAX_LEN = 64
# Tokens that repeat in each prompt, so an ngram drafter has something to continue.
REPEAT = [3, 4, 5, 6, 7, 8, 9, 10]


class Batch:
    """What the engine's model runner hands the sidecar proposer: the input batch's token arrays and the
    request id of each row."""

    def __init__(self, rows: int = 4) -> None:
        self.tokens = np.zeros((rows, MAX_LEN), np.int32)
        self.lengths = np.zeros(rows, np.int32)
        self.req_ids = [""] * rows
        self._requests = 0

    def set(self, row: int, tokens: list[int]) -> None:
        """A new request takes the row."""
        self._requests += 1
        self.req_ids[row] = f"req-{self._requests}"
        self._write(row, tokens)

    def extend(self, row: int, tokens: list[int]) -> None:
        """The row's request gains tokens."""
        n = int(self.lengths[row])
        self._write(row, [*self.tokens[row, :n].tolist(), *tokens])

    def _write(self, row: int, tokens: list[int]) -> None:
        self.tokens[row, : len(tokens)] = tokens
        self.lengths[row] = len(tokens)

    def sampled(self, rows: int) -> list[list[int]]:
        return [[int(self.tokens[i, self.lengths[i] - 1])] if self.lengths[i] else [] for i in range(rows)]

    def propose(self, client: DraftClient, rows: int, k: int | None = None) -> list[list[int]]:
        k = client.max_k if k is None else k
        return client.propose(k, self.sampled(rows), self.req_ids[:rows], self.lengths, self.tokens)


def client_for(path: Path, **kw: object) -> DraftClient:
    args: dict = {"max_k": 4, "max_model_len": MAX_LEN, "vocab_size": 320, "deadline_s": 0.5, "retry_s": 0.2}
    return DraftClient(path, **(args | kw))
