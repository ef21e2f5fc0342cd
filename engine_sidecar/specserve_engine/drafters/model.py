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
        catch_up_tokens: int = 512,
    ) -> None:
        super().__init__(name, method, max_k, catch_up_tokens)
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
        """Catch each cache up with its new tokens (one forward per sequence), then draft the remaining
        K−1 tokens of all sequences together, one batched forward per position."""
        model = self.model
        assert model is not None, "draft() before load()"
        out: list[list[int]] = [[] for _ in seqs]
        caches: list[KVCache | None] = [None] * len(seqs)
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k <= 0:  # K = 0: nothing to do now; the cache catches up on the next step that drafts
                continue
            caught_up = self._catch_up(model, seq)
            if caught_up is not None:
                caches[i], logits = caught_up
                out[i].append(int(logits.argmax()))
        lengths = [len(s.tokens) for s in seqs]
        while True:
            rows = [i for i, k in enumerate(ks) if 0 < len(out[i]) < k]
            if not rows:
                return out
            tokens = torch.tensor([out[i][-1] for i in rows], device=model.device)
            positions = [lengths[i] + len(out[i]) - 1 for i in rows]
            logits = model.forward_batch(tokens, [caches[i] for i in rows], positions)  # type: ignore[misc]
            for r, i in enumerate(rows):
                out[i].append(int(logits[r].argmax()))

    def _catch_up(self, model: TinyLlama, seq: Seq) -> tuple[KVCache, torch.Tensor] | None:
        """Feed the sequence's new tokens (at most catch_up_tokens of them) into its cache; the logits after
        its last token, or None while it is still catching up."""
        state = self._states.get(seq.key)
        if state is None or state.epoch != seq.epoch or state.cache.length > len(seq.tokens):
            state = self._states[seq.key] = _State(seq.epoch, model.new_cache())
        cache = state.cache
        length = len(seq.tokens)
        if cache.length == length:  # nothing new: recompute the last token to get its logits
            cache.length -= 1
        end = min(length, cache.length + self.catch_up_tokens)
        new = torch.from_numpy(seq.tokens[cache.length : end].astype("int64")).to(model.device)
        logits = model.forward(new, cache, cache.length)
        cache.length = end  # speculative entries past here are overwritten next step
        return (cache, logits) if end == length else None

    def forget(self, connection: int) -> None:
        for key in [k for k in self._states if k[0] == connection]:
            del self._states[key]
