"""Which cached KV blocks lack the drafter's KV: kept by the live-policy scheduler, used at prefix-cache hits.

A drafter with its own KV cache inside vLLM (EAGLE, EAGLE-3, MTP, a colocated draft model) shares the
target's blocks: each block holds the target's KV and the drafter's for the same positions. A plain step
(K = 0) skips the drafter's pass, so the blocks it fills hold the target's KV only. A later request whose
prompt hits those blocks in the prefix cache would draft from whatever the drafter's half of them holds:
the output stays exact (every draft is verified), its acceptance does not.

`PlainFilledBlocks` records, for each request that ran a plain step, the first position it computed in
one (one dict check per row per plain step: nothing else is done in the step). When such a request frees
its blocks (it finished or was preempted), its hashed blocks from that position on are remembered by block
id and hash; the blocks of running requests are read from the KV cache manager when a hit needs them. A
hit is then judged where the scheduler admits a request (`LivePolicyScheduler._get_local_prefix_cache_hit`):

- if the request's first step will draft, the hit is cut at its first plain-filled block and those blocks
  leave the prefix cache, so the request recomputes them with the drafter and caches clean blocks in their
  place (one recomputation per plain-filled prefix);
- if it will not draft (the pod is off, or the batch sits in a K = 0 bucket), the request keeps the whole
  hit, as a stock engine would, and never drafts: its drafts are withheld until it finishes.

The record is conservative: a request's blocks after its first plain step count as plain-filled even where
the runner caught the drafter up on them (plain_step.py), which costs a recomputation, never a stale draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

BlocksOf = Callable[[str], Sequence[Sequence[Any]]]  # request id -> its KV blocks, per KV cache group


class PlainFilledBlocks:
    def __init__(self) -> None:
        self.plain_from: dict[str, int] = {}  # request id -> first position it computed in a plain step
        self.withheld: set[str] = set()  # requests that never draft: they hold plain-filled blocks from a hit
        self._freed: dict[int, object] = {}  # block id -> its hash when a plain request freed it

    def note_plain_step(self, num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Any]) -> None:
        """After a plain step is scheduled (vLLM has advanced each request's computed tokens by its share)."""
        for req_id, scheduled in num_scheduled_tokens.items():
            if req_id not in self.plain_from:
                self.plain_from[req_id] = requests[req_id].num_computed_tokens - scheduled

    def release(self, req_id: str, blocks: Sequence[Sequence[Any]], block_sizes: Sequence[int]) -> None:
        """Before a request's blocks are freed: remember its cached plain-filled ones."""
        start = self.forget_request(req_id)
        if start is None:
            return
        for group, size in zip(blocks, block_sizes, strict=True):
            for block in group[start // size :]:
                if block.block_hash is not None:
                    self._freed[block.block_id] = block.block_hash

    def forget_request(self, req_id: str) -> int | None:
        """Drop what is known of a request; returns the first position it computed in a plain step."""
        self.withheld.discard(req_id)
        return self.plain_from.pop(req_id, None)

    def in_hit(
        self, hit: Sequence[Sequence[Any]], blocks_of: BlocksOf, block_sizes: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(index in its group, block id) of every plain-filled block of a prefix hit."""
        if not any(hit):
            return []
        live = {
            block.block_id
            for req_id, start in self.plain_from.items()
            for group, size in zip(blocks_of(req_id), block_sizes, strict=True)
            for block in group[start // size :]
        }
        return [
            (index, block.block_id)
            for group in hit
            for index, block in enumerate(group)
            if block.block_id in live or self._freed.get(block.block_id, _ABSENT) == block.block_hash
        ]

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """Blocks that left the prefix cache: their next content is judged afresh."""
        for block_id in block_ids:
            self._freed.pop(block_id, None)


_ABSENT = object()  # never equal to a block's hash
