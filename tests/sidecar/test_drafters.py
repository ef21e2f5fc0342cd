"""The sidecar's drafters on plain token arrays: what they propose, that incremental state gives the same
drafts as recomputing from scratch, and that the torch Llama matches transformers' reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specserve_engine.api import SidecarDrafter
from specserve_engine.drafters import DrafterError, Seq, build_drafter
from specserve_engine.drafters.llama import TinyLlama
from specserve_engine.drafters.model import ModelDrafter
from specserve_engine.drafters.ngram import NgramDrafter
from specserve_engine.drafters.suffix import SuffixDrafter


def seq(tokens: list[int], key: tuple[int, int] = (0, 0), epoch: int = 1) -> Seq:
    return Seq(key, epoch, np.array(tokens, np.int32))


def test_ngram_continues_the_latest_earlier_occurrence() -> None:
    d = NgramDrafter("ngram", max_k=4, min_n=1, max_n=3)
    assert d.draft([seq([1, 2, 3, 4, 5, 9, 1, 2, 3])], [4]) == [[4, 5, 9, 1]]
    # The same sequence grown by one token: the index is extended, not rebuilt, and the draft follows.
    assert d.draft([seq([1, 2, 3, 4, 5, 9, 1, 2, 3, 4])], [2]) == [[5, 9]]
    assert d.draft([seq([7, 8])], [3]) == [[]]
    assert d.draft([seq([1, 2, 3, 1, 2])], [0]) == [[]]


def test_ngram_rebuilds_when_the_row_holds_a_new_sequence() -> None:
    d = NgramDrafter("ngram", max_k=4)
    assert d.draft([seq([5, 6, 7, 5, 6], epoch=1)], [2]) == [[7, 5]]
    assert d.draft([seq([1, 1, 2, 3, 1], epoch=2)], [2]) == [[2, 3]]


def test_suffix_learns_across_sequences() -> None:
    d = SuffixDrafter("suffix", max_k=4, min_n=2, max_n=4)
    template = [10, 11, 12, 13, 14, 15]
    d.draft([seq([1, 2, *template], key=(0, 0))], [0])  # a first request, counted
    # A second request that starts the template: drafted from the first, which it never saw itself.
    assert d.draft([seq([3, 10, 11], key=(0, 1))], [4]) == [[12, 13, 14, 15]]
    assert d.draft([seq([99, 98], key=(0, 2))], [4]) == [[]]


def test_suffix_stops_at_rare_continuations() -> None:
    d = SuffixDrafter("suffix", max_k=4, min_n=1, max_n=1, min_prob=0.6)
    d.draft([seq([1, 2, 1, 3, 1, 4], key=(0, 0))], [0])  # 1 is followed by 2, 3, 4: a third each
    assert d.draft([seq([1], key=(0, 1))], [3]) == [[]]


def test_torch_llama_matches_transformers(random_llama: Path) -> None:
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(random_llama).eval()
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    model = TinyLlama(random_llama)
    cache = model.new_cache()
    got = model.forward(ids[:10], cache, 0)  # a prefill chunk, then one token at a time
    assert torch.allclose(got, expected[9], atol=1e-4)
    for i in range(10, 24):
        got = model.forward(ids[i : i + 1], cache, i)
        assert torch.allclose(got, expected[i], atol=1e-4)


def _greedy(model: TinyLlama, tokens: list[int], k: int) -> list[int]:
    out: list[int] = []
    for _ in range(k):
        cache = model.new_cache()
        logits = model.forward(torch.tensor(tokens + out), cache, 0)
        out.append(int(logits.argmax()))
    return out


def test_model_drafter_incremental_equals_from_scratch(random_llama: Path) -> None:
    d = ModelDrafter("self", "selfSpeculative", max_k=3, path=str(random_llama), num_layers=2)
    d.load()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 320, 12).tolist()
    for _ in range(5):
        (draft,) = d.draft([seq(tokens)], [3])
        assert draft == _greedy(d.model, tokens, 3)
        tokens = [*tokens, draft[0] if rng.random() < 0.5 else int(rng.integers(0, 320)), 7]
    # K = 0 skips the work; the next draft call catches the cache up.
    assert d.draft([seq([*tokens, 1])], [0]) == [[]]
    assert d.draft([seq([*tokens, 1, 2])], [2]) == [_greedy(d.model, [*tokens, 1, 2], 2)]


def test_model_drafter_batches_sequences_of_different_k(random_llama: Path) -> None:
    d = ModelDrafter("draft", "draftModel", max_k=4, path=str(random_llama))
    d.load()
    assert d.model is not None
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 320, n).tolist() for n in (5, 17, 9, 30)]
    ks = [4, 1, 0, 3]
    for _ in range(3):
        drafts = d.draft([seq(p, key=(0, i)) for i, p in enumerate(prompts)], ks)
        assert drafts == [_greedy(d.model, p, k) if k else [] for p, k in zip(prompts, ks, strict=True)]
        prompts = [[*p, *rng.integers(0, 320, 2).tolist()] for p in prompts]


def test_self_speculation_keeps_only_the_first_layers(random_llama: Path) -> None:
    spec = SidecarDrafter.model_validate(
        {"name": "self", "method": "selfSpeculative", "maxSpeculativeTokens": 2, "placement": "sidecar"}
    )
    d = build_drafter(spec, str(random_llama))
    d.load()
    assert isinstance(d, ModelDrafter) and d.model is not None
    assert d.model.num_layers == 1  # a quarter of the four layers
    assert not any(".layers.1." in name for name in d.model.w)


def test_bad_drafter_entries_are_refused(tmp_path: Path) -> None:
    def spec(**kw: object) -> SidecarDrafter:
        base = {"name": "d", "method": "draftModel", "maxSpeculativeTokens": 2, "placement": "sidecar"}
        return SidecarDrafter.model_validate(base | kw)

    with pytest.raises(DrafterError, match="needs a source"):
        build_drafter(spec(), str(tmp_path))
    with pytest.raises(DrafterError, match="cannot be hosted"):
        build_drafter(spec(method="eagle3"), str(tmp_path))
    with pytest.raises(DrafterError, match=r"config\.json"):
        build_drafter(spec(source=str(tmp_path)), str(tmp_path)).load()
