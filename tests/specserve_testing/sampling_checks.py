"""Lossless under sampling, on real engines: samples from an engine must follow the target model's own
distribution at the drafted positions (docs/engine-pod.md, "Lossless under sampling").

Each run sends a few prompts with n samples per request (fixed seeds, EOS ignored, token ids returned),
`MAX_TOKENS` tokens each: the first comes from the prefill, which no drafter touches; the other 8 are
verified drafts whenever the drafter proposes (two verification rounds at K = 4 if all are accepted).
The reference is exact rather than sampled: the target's checkpoint run through Hugging Face
transformers (an implementation independent of vLLM) gives the distribution of every drafted token given
the tokens before it, and `sampling_probs` applies the request's temperature, top-k and top-p. The
tested positions of all samples pool into one uniformity test of their randomized PIT values
(sampling_stats). The control is the engine without speculation, checked the same way: it must pass,
which also shows that the reference matches vLLM's sampling.

Prompts (`prompts_for`): model drafters get two code-like and two prose-like prompts. The lookup drafters
(n-gram and suffix, colocated) propose only where the text repeats, which sampled prose and the first
lines of a function do not (about 0.03 drafts per tested token there), so they get `LOOKUP_PROMPTS`: the
last lines of a function in the training data's code template (scripts/train_tiny_models.py), then the
same function from its start up to its operator. The target writes that template, so the lookup finds
the earlier lines from the first tested token on (about one draft per tested token), and the operator and
attribute it samples on the way keep some tested positions spread out.

Sample size (power calculation, sampling_stats.observations_needed): the suite runs `CHECKS_IN_SUITE`
= 30 checks (the control, the seven colocated drafters and the sidecar's draft model and self-speculation,
x 3 settings) at a family-wise false-alarm rate of 1 % (Bonferroni), so each check is a chi-square test
with 9 degrees of freedom at α = 0.01 / 30 = 3.3e-4 (critical value 30.7). Detecting a total variation of
2 % on the binned PIT distribution with power 0.9 needs noncentrality 37.6, so N = 37.6 / (4 · 0.02²) =
23,509 tested tokens: 3,000 samples of 8 tested positions (4 prompts x 3 requests x n = 250) give 24,000
(both prompt sets have 4 prompts).
The seeds are fixed, so a run repeats exactly.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch

from specserve_engine import metric_names
from specserve_engine.api import SidecarDrafter
from specserve_testing.engine_checks import sample_sum
from specserve_testing.engines import TARGET, RunningEngine, prompts, scrape
from specserve_testing.sampling_stats import (
    SETTINGS,
    SamplingSetting,
    UniformityResult,
    observations_needed,
    randomized_pit,
    sampling_probs,
    uniformity_test,
)

MAX_TOKENS = 9  # 1 from the prefill + 8 tested: two verification rounds at K = 4
TESTED_PER_SAMPLE = MAX_TOKENS - 1
# The control, the seven colocated drafters and the two model drafters the sidecar hosts, at every setting.
CHECKS_IN_SUITE = 10 * len(SETTINGS)
FAMILY_FALSE_ALARM = 0.01
ALPHA = FAMILY_FALSE_ALARM / CHECKS_IN_SUITE
DETECTABLE_TV = 0.02
POWER = 0.9
OBSERVATIONS = observations_needed(DETECTABLE_TV, ALPHA, POWER)
# Two code-like and two prose-like prompts: every drafter proposes on code, and prose has the spread-out
# distributions on which a wrong temperature shows most.
PROMPTS = (*prompts("code")[:2], *prompts("prose")[:2])
LOOKUP_METHODS = frozenset({"ngram", "suffix"})
LOOKUP_OPS = ("+", "-", "*", "+")  # the template's operators, one per prompt


def repeating_code_prompt(prompt: str, op: str) -> str:
    """The last lines of a code prompt's function (`def verb_noun(self, other):` / `noun = self.noun` /
    ...), then the function from its start up to `noun = noun`, where the target samples the operator next.

    Not the whole function twice: at about 48 tokens, the prefills of a full batch fit one step's token
    budget (engines.BATCH_ARGS). A seeded request whose prefill vLLM splits over steps crashes the CPU
    worker ("CPU Generator does not use offset")."""
    signature, first_line = prompt.splitlines()
    other = signature.partition("(self, ")[2].removesuffix("):")
    noun = first_line.split(" = ")[0].strip()
    head = f"{prompt}\n    if {other} is None:\n        return {noun}\n    {noun} = {noun}"
    return f"    {noun} = {noun} {op} {other}\n    self.{noun} = {noun}\n    return {noun}\n\n{head}"


LOOKUP_PROMPTS = tuple(
    repeating_code_prompt(p, op) for p, op in zip(prompts("code")[:4], LOOKUP_OPS, strict=True)
)
assert len(LOOKUP_PROMPTS) == len(PROMPTS), "REQUESTS_PER_PROMPT holds for both prompt sets"
SAMPLES_PER_REQUEST = 250
REQUESTS_PER_PROMPT = math.ceil(OBSERVATIONS / TESTED_PER_SAMPLE / SAMPLES_PER_REQUEST / len(PROMPTS))
SEED = 20_240_601


@dataclass(frozen=True)
class SamplingRun:
    """One engine (or sidecar drafter) at one setting."""

    label: str
    setting: SamplingSetting
    result: UniformityResult
    samples: int
    draft_tokens: float  # vLLM's counters over the run
    accepted_tokens: float

    @property
    def drafts_per_tested_token(self) -> float:
        return self.draft_tokens / (self.samples * TESTED_PER_SAMPLE)

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def as_dict(self) -> dict:
        acceptance = self.acceptance
        return {
            **self.result.as_dict(),
            "samples": self.samples,
            "drafts_per_tested_token": round(self.drafts_per_tested_token, 3),
            "acceptance": None if acceptance is None else round(acceptance, 3),
        }

    def row(self) -> str:
        acceptance = "-" if self.acceptance is None else f"{self.acceptance:.2f}"
        r = self.result
        return (
            f"{self.label:<24} {self.setting.name:<28} p={r.p_value:<9.3g} TV={r.total_variation:.4f} "
            f"N={r.observations} drafts/token={self.drafts_per_tested_token:.2f} acceptance={acceptance}"
        )


class TargetReference:
    """A target's next-token logits from its checkpoint, through Hugging Face transformers (float32)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def continuation_logits(
        self, prompt: torch.Tensor, continuations: torch.Tensor, chunk: int = 512
    ) -> torch.Tensor:
        """[L] prompt ids and [N, M] continuations -> [N, M, vocab]: the logits after the prompt and each
        continuation up to each of its tokens. The prompt runs once and its keys and values are reused, as
        an engine's prefix cache does: the tests' prompts (13-48 tokens) are longer than what they sample
        (8); this cut the reference's time 3-7 fold (the logits equal the whole sequences' within 1e-5)."""
        prefix = self.model(input_ids=prompt[None], use_cache=True).past_key_values
        out = []
        for c in continuations.split(chunk):
            cache = copy.deepcopy(prefix)
            cache.batch_repeat_interleave(len(c))
            out.append(self.model(input_ids=c, past_key_values=cache).logits)
        return torch.cat(out)


def prompts_for(drafter: SidecarDrafter | None) -> tuple[str, ...]:
    """The prompts a check sends to an engine with this drafter (None: no speculation)."""
    lookup = drafter is not None and drafter.placement == "colocated" and drafter.method in LOOKUP_METHODS
    return LOOKUP_PROMPTS if lookup else PROMPTS


@functools.cache
def target_reference(path: Path) -> TargetReference:
    return TargetReference(path)


async def _sample(
    session: aiohttp.ClientSession, engine: RunningEngine, prompt: str, setting: SamplingSetting, seed: int
) -> tuple[list[int], list[list[int]]]:
    body = {
        "model": engine.name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "n": SAMPLES_PER_REQUEST,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
        **setting.request_fields(),
    }
    async with session.post(f"{engine.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["choices"][0]["prompt_token_ids"], [c["token_ids"] for c in data["choices"]]


def tested_pits(
    reference: TargetReference,
    prompt_ids: list[int],
    samples: list[list[int]],
    setting: SamplingSetting,
    generator: torch.Generator,
) -> torch.Tensor:
    """The PIT values of every sample's tested positions (all but the first), each under the target's
    distribution given the prompt and the sample's tokens before it."""
    tokens = torch.tensor(samples)
    assert tokens.shape[1] == MAX_TOKENS, "every sample has exactly MAX_TOKENS tokens (EOS ignored)"
    # The logits that give tokens 1.. : after the prompt and each sample's tokens before them.
    unique, index = tokens[:, :-1].unique(dim=0, return_inverse=True)
    logits = reference.continuation_logits(torch.tensor(prompt_ids), unique)[index]
    probs = sampling_probs(logits.reshape(-1, logits.shape[-1]), setting)
    return randomized_pit(probs, tokens[:, 1:].reshape(-1), generator)


async def sampling_run(
    engine: RunningEngine, setting: SamplingSetting, label: str, target: Path = TARGET
) -> SamplingRun:
    """Sample the engine at `setting` with its drafter's prompts (`prompts_for`) and test its drafted
    positions against `target`'s distribution (the model the engine serves)."""
    reference = target_reference(target)
    before = await scrape(engine)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        jobs = [
            _sample(
                session, engine, prompt, setting, SEED + (p * REQUESTS_PER_PROMPT + r) * SAMPLES_PER_REQUEST
            )
            for p, prompt in enumerate(prompts_for(engine.drafter))
            for r in range(REQUESTS_PER_PROMPT)
        ]
        responses = await asyncio.gather(*jobs)
    after = await scrape(engine)
    generator = torch.Generator().manual_seed(SEED)  # one stream for the run: every value its own draw
    pits = torch.cat(
        await asyncio.to_thread(
            lambda: [tested_pits(reference, ids, samples, setting, generator) for ids, samples in responses]
        )
    )

    def delta(name: str) -> float:
        return sample_sum(after, name, model_name=engine.name) - sample_sum(
            before, name, model_name=engine.name
        )

    return SamplingRun(
        label=label,
        setting=setting,
        result=uniformity_test(pits),
        samples=sum(len(samples) for _, samples in responses),
        draft_tokens=delta(metric_names.VLLM_SPEC_DRAFT_TOKENS),
        accepted_tokens=delta(metric_names.VLLM_SPEC_ACCEPTED_TOKENS),
    )


def assert_lossless(runs: list[SamplingRun], speculating: bool = True) -> None:
    """Every run passes the test at α; where the engine speculates, its drafter proposed for at least
    half the tested tokens (else a pass would say little)."""
    print("\n" + "\n".join(run.row() for run in runs))
    failed = [run.row() for run in runs if run.result.p_value < ALPHA]
    assert not failed, f"sampled output differs from the target's distribution (α = {ALPHA:.1e}): {failed}"
    assert all(run.result.observations >= OBSERVATIONS for run in runs)
    if speculating:
        idle = [run.row() for run in runs if run.drafts_per_tested_token < 0.5]
        assert not idle, f"the drafter proposed too little for the test to mean much: {idle}"
    else:
        assert all(run.draft_tokens == 0 for run in runs)
