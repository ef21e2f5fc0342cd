"""Model drafters: a small draft model (`draftModel`) or the target's own first layers
(`selfSpeculative`), both run by the sidecar's torch Llama with one KV cache per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve_engine.drafters.base import Drafter, Seq
from specserve_engine.drafters.llama import KVCache, LlamaShape, TinyLlama, read_config


@dataclass
class _State:
    epoch: int
    cache: KVCache


class ModelDrafter(Drafter):
    def __init__(
        self,
        name: str,
        method: str,
        max_k: int,
        path: str,
        num_layers: int | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(name, method, max_k)
        self.path = path
        self.num_layers = num_layers
        self.device = device
        self.model: TinyLlama | None = None
        self._states: dict[tuple[int, int], _State] = {}

    def load(self) -> None:
        layers = self.num_layers
        if layers is None and self.method == "selfSpeculative":
            layers = max(1, LlamaShape.from_config(read_config(self.path)).layers // 4)
        self.model = TinyLlama(self.path, num_layers=layers, device=self.device)

    def draft(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        return [self._draft_one(s, k) for s, k in zip(seqs, ks, strict=True)]

    def _draft_one(self, seq: Seq, k: int) -> list[int]:
        model = self.model
        assert model is not None, "draft() before load()"
        state = self._states.get(seq.key)
        if state is None or state.epoch != seq.epoch or state.cache.length > len(seq.tokens):
            state = self._states[seq.key] = _State(seq.epoch, model.new_cache())
        if k <= 0:
            return []  # the cache catches up on the next step that drafts
        cache = state.cache
        length = len(seq.tokens)
        if cache.length == length:  # nothing new: recompute the last token to get its logits
            cache.length -= 1
        new = torch.from_numpy(seq.tokens[cache.length :].astype("int64")).to(model.device)
        logits = model.forward(new, cache, cache.length)
        cache.length = length
        out = [int(logits.argmax())]
        while len(out) < k:
            logits = model.forward(torch.tensor([out[-1]], device=model.device), cache, length + len(out) - 1)
            out.append(int(logits.argmax()))
        return out

    def forget(self, connection: int) -> None:
        for key in [k for k in self._states if k[0] == connection]:
            del self._states[key]
