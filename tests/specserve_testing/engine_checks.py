"""Checks every suite of real engines runs (vLLM's own drafters, the speculator heads): greedy output
unchanged by speculation, MAL per domain from the plugin's metrics, K and on/off changed live through
the policy file, and the stat-logger plugin's counters equal to the scheduler's per-step record."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

from specserve_engine import metric_names
from specserve_engine.buckets import DEFAULT_BUCKETS, bucket_for
from specserve_engine.policy_file import PodPolicy
from specserve_testing.engines import DOMAINS, RunningEngine, complete_many, prompts, scrape

MAX_TOKENS = 40


def sample_sum(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def drafter_policy(engine: RunningEngine, version: int, mode: str = "on", **k_by_bucket: int) -> PodPolicy:
    return PodPolicy(
        policy_version=version, drafter=engine.drafter.name, mode=mode, k_by_bucket=dict(k_by_bucket)
    )


def all_buckets(k: int) -> dict[str, int]:
    return {str(b): k for b in DEFAULT_BUCKETS} | {"+Inf": k}


async def assert_greedy_identical(reference: RunningEngine, engines: list[RunningEngine]) -> None:
    """Eight code and eight prose prompts, sent to every engine at once: the same text everywhere."""
    batch = prompts("code")[:8] + prompts("prose")[:8]
    outputs = await asyncio.gather(*(complete_many(e, batch, MAX_TOKENS) for e in [reference, *engines]))
    expected = outputs[0]
    assert all(text for text in expected)
    for engine, texts in zip(engines, outputs[1:], strict=True):
        mismatches = [i for i, (a, b) in enumerate(zip(expected, texts, strict=True)) if a != b]
        assert not mismatches, f"{engine.name}: outputs differ from no speculation for prompts {mismatches}"


async def mal_by_domain(engine: RunningEngine) -> dict[str, float]:
    """1 + accepted / drafts per domain, from the plugin's counters, one request at a time (bucket 1)."""
    mal = {}
    drafter = engine.drafter.name
    for domain in DOMAINS:
        before = await scrape(engine)
        for prompt in prompts(domain)[:6]:
            await complete_many(engine, [prompt], MAX_TOKENS)
        await asyncio.sleep(0.5)
        after = await scrape(engine)

        def delta(name: str, after: dict = after, before: dict = before) -> float:
            return sample_sum(after, f"{name}_total", drafter=drafter) - sample_sum(
                before, f"{name}_total", drafter=drafter
            )

        drafts = delta(metric_names.SPEC_DRAFTS.name)
        mal[domain] = 1 + delta(metric_names.SPEC_ACCEPTED_TOKENS.name) / drafts if drafts else 1.0
    return mal


async def assert_k_and_on_off_change_live(reference: RunningEngine, engines: list[RunningEngine]) -> None:
    """K = 2 everywhere, then off, then back to the maximum, each from the next request on, with the
    reference's text every time (read from the scheduler's per-step trace)."""
    batch = prompts("code")[:4]
    expected = await complete_many(reference, batch, MAX_TOKENS)
    for engine in engines:
        engine.set_policy(drafter_policy(engine, 1, **all_buckets(2)))
        start = len(engine.trace())
        assert await complete_many(engine, batch, MAX_TOKENS) == expected
        drafted = [n for step in engine.trace()[start:] for n in step["drafted"]]
        assert drafted and max(drafted) == 2, f"{engine.name}: draft lengths {Counter(drafted)}"

        engine.set_policy(drafter_policy(engine, 2, mode="off", **all_buckets(2)))
        start = len(engine.trace())
        assert await complete_many(engine, batch, MAX_TOKENS) == expected
        assert not any(step["drafted"] for step in engine.trace()[start:]), f"{engine.name} drafted while off"

        engine.reset_policy()
        start = len(engine.trace())
        assert await complete_many(engine, batch, MAX_TOKENS) == expected
        drafted = [n for step in engine.trace()[start:] for n in step["drafted"]]
        assert max(drafted) == engine.drafter.max_speculative_tokens


async def _settled(engine: RunningEngine, n_steps: int, timeout_s: float = 10.0) -> dict:
    """The metrics once the stat logger has recorded every step the scheduler traced."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await scrape(engine)
        if sample_sum(samples, f"{metric_names.ENGINE_STEPS.name}_total", model_name=engine.name) >= n_steps:
            return samples
        if time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.2)


async def assert_counters_equal_the_step_record(
    engines: list[RunningEngine], *, some_steps_without_drafts: bool = False
) -> None:
    """A workload over several buckets on every engine; each engine's per-bucket counters must equal
    what its scheduler traced for its decode steps, step by step, and with the prefill steps' drafts
    vLLM's own unbucketed draft counter. `some_steps_without_drafts`: the workload must also have made
    decode steps under a K in force in which the drafter proposed nothing (n-gram, suffix), which count
    as speculative steps."""

    async def workload(engine: RunningEngine) -> None:
        await complete_many(engine, prompts("code")[:1], MAX_TOKENS)
        await complete_many(engine, prompts("code")[:5] + prompts("prose")[:5], MAX_TOKENS)
        await complete_many(engine, prompts("prose")[5:8], 24)

    befores = await asyncio.gather(*(scrape(e) for e in engines))
    starts = [len(e.trace()) for e in engines]
    without_drafts = 0
    await asyncio.gather(*(workload(e) for e in engines))
    for engine, before, start in zip(engines, befores, starts, strict=True):
        steps = engine.trace()[start:]
        total_before = sample_sum(before, f"{metric_names.ENGINE_STEPS.name}_total", model_name=engine.name)
        decode_steps = [step for step in steps if not step["prefill"]]
        after = await _settled(engine, int(total_before) + len(decode_steps))
        _check_exact(engine, steps, before, after)
        without_drafts += sum(1 for step in decode_steps if step["k"] > 0 and not step["drafted"])
    assert without_drafts > 0 or not some_steps_without_drafts, "no step went without drafts under a K"


def _check_exact(engine: RunningEngine, steps: list[dict], before: dict, after: dict) -> None:
    expect: dict[tuple, float] = defaultdict(float)
    # Steps that prefilled a prompt are not decode steps: no counter of the plugin's counts them (their
    # drafts are in vLLM's own total only).
    prefill_drafts = sum(len(step["drafted"]) for step in steps if step["prefill"])
    assert any(step["prefill"] for step in steps) and any(not step["prefill"] for step in steps)
    for step in (step for step in steps if not step["prefill"]):
        bucket = bucket_for(step["batch"], DEFAULT_BUCKETS)
        # Speculative: drafts verified, or a K scheduled (a drafter without a match proposes nothing).
        speculating = "true" if any(step["drafted"]) or step["k"] > 0 else "false"
        expect[(metric_names.ENGINE_STEPS.name, bucket, speculating)] += 1
        expect[(metric_names.ENGINE_GENERATED_TOKENS.name, bucket, speculating)] += step["generated"]
        if step["drafted"]:
            expect[(metric_names.SPEC_DRAFTS.name, bucket)] += len(step["drafted"])
            expect[(metric_names.SPEC_DRAFT_TOKENS.name, bucket)] += sum(step["drafted"])
            expect[(metric_names.SPEC_ACCEPTED_TOKENS.name, bucket)] += sum(step["accepted"])
            for drafted, accepted in zip(step["drafted"], step["accepted"], strict=True):
                for pos in range(drafted):
                    expect[(metric_names.SPEC_DRAFT_TOKENS_PER_POSITION.name, bucket, str(pos))] += 1
                    expect[(metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION.name, bucket, str(pos))] += (
                        pos < accepted
                    )
    assert any(k[0] == metric_names.SPEC_DRAFTS.name for k in expect), (
        f"{engine.name}: the workload produced no drafts"
    )
    assert len({k[1] for k in expect}) >= 2, "the workload should cover several buckets"

    def delta(name: str, **labels: str) -> float:
        series = f"{name}_total"
        return sample_sum(after, series, model_name=engine.name, **labels) - sample_sum(
            before, series, model_name=engine.name, **labels
        )

    buckets = [str(b) for b in DEFAULT_BUCKETS] + ["+Inf"]
    drafter = engine.drafter.name
    for bucket in buckets:
        for speculating in ("true", "false"):
            # Speculative steps carry the drafter in force, plain steps none.
            step_drafter = drafter if speculating == "true" else ""
            for metric in (metric_names.ENGINE_STEPS, metric_names.ENGINE_GENERATED_TOKENS):
                got = delta(metric.name, bucket=bucket, speculating=speculating, drafter=step_drafter)
                assert got == expect[(metric.name, bucket, speculating)], (metric.name, bucket, speculating)
            seconds = delta(metric_names.ENGINE_STEP_SECONDS.name, bucket=bucket, speculating=speculating)
            assert (seconds > 0) == (expect[(metric_names.ENGINE_STEPS.name, bucket, speculating)] > 0)
        for metric in (
            metric_names.SPEC_DRAFTS,
            metric_names.SPEC_DRAFT_TOKENS,
            metric_names.SPEC_ACCEPTED_TOKENS,
        ):
            assert delta(metric.name, bucket=bucket, drafter=drafter) == expect[(metric.name, bucket)], (
                engine.name,
                metric.name,
                bucket,
            )
        for pos in range(engine.drafter.max_speculative_tokens):
            for metric in (
                metric_names.SPEC_DRAFT_TOKENS_PER_POSITION,
                metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION,
            ):
                got = delta(metric.name, bucket=bucket, drafter=drafter, position=str(pos))
                assert got == expect[(metric.name, bucket, str(pos))], (engine.name, metric.name, bucket, pos)
    # And the totals agree with vLLM's own (unbucketed) counters.
    vllm_drafts = sample_sum(after, metric_names.VLLM_SPEC_DRAFTS, model_name=engine.name) - sample_sum(
        before, metric_names.VLLM_SPEC_DRAFTS, model_name=engine.name
    )
    bucketed = sum(v for k, v in expect.items() if k[0] == metric_names.SPEC_DRAFTS.name)
    assert vllm_drafts == bucketed + prefill_drafts
