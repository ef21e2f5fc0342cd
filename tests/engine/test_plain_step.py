"""K = 0 steps are plain steps (vllm_plugins/plain_step.py, docs/engine-pod.md#off-costs-nothing), on real
vLLM engines run in this process, so the test can look at the model runner: a K = 0 step makes no drafter
call and runs vLLM's plain sampler; greedy output stays that of an engine without a drafter whatever the
policy does; a drafter with its own KV cache does not draft for requests whose tokens it skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.launch import EngineSpec
from specserve_engine.policy_file import PodPolicy, write_policy
from specserve_engine.vllm_plugins.plain_step import (
    PlainStepExecutor,
    PlainStepRunner,
    UnsupportedRunner,
    check_runner,
)
from specserve_testing.engines import HEADS, MAX_K, NGRAM, TARGET, in_process_engine_args, prompts

pytestmark = pytest.mark.engine

BUCKETS = (1, 2, 4, 8, 16, 32)
TOKENS = 24


def test_the_pinned_runner_has_what_plain_steps_wrap() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    check_runner(CPUModelRunner)

    class Renamed(CPUModelRunner):
        def sample_tokens(self, grammar: Any) -> Any:  # an upgrade that renames an argument
            return super().sample_tokens(grammar)

    with pytest.raises(UnsupportedRunner, match="sample_tokens"):
        check_runner(Renamed)
    with pytest.raises(UnsupportedRunner, match="V1 model runner"):
        check_runner(object)


class InProcessEngine:
    """An LLMEngine with the argv a pod's engine gets, its engine core in this process and its worker too
    (vLLM's in-process executor), or in its own process with specserve's executor (`worker_process`)."""

    def __init__(
        self, drafter: SidecarDrafter | None, runtime_dir: Path, worker_process: bool = False
    ) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        self.drafter = drafter
        self.runtime_dir = runtime_dir
        spec = EngineSpec(
            model=str(TARGET),
            served_model_name="t",
            runtime_dir=str(runtime_dir),
            drafter=drafter,
            bucket_bounds=BUCKETS,
            dtype="float32",
        )
        os.environ.update(spec.environment())
        drop: tuple[str, ...] = () if worker_process else ("--distributed-executor-backend",)
        if drafter is None:  # a stock engine: none of specserve's flags
            drop += ("--scheduler-cls", "--additional-config")
        self.engine = LLMEngine.from_engine_args(in_process_engine_args(spec, drop))
        self.executor: Any = self.engine.engine_core.engine_core.model_executor
        self.runner: Any = None if worker_process else self.executor.driver_worker.worker.model_runner
        self._ids = 0

    def policy(self, version: int, k: int) -> None:
        assert self.drafter is not None
        write_policy(
            PodPolicy(version, self.drafter.name, "on", {b: k for b in bucket_labels(BUCKETS)}, BUCKETS),
            self.runtime_dir,
        )

    def add(self, texts: list[str]) -> list[str]:
        from vllm import SamplingParams

        ids = []
        for text in texts:
            self._ids += 1
            ids.append(f"r{self._ids}")
            params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            self.engine.add_request(ids[-1], text, params)
        return ids

    def run(self, steps: int | None = None) -> dict[str, str]:
        done: dict[str, str] = {}
        while self.engine.has_unfinished_requests() and (steps is None or steps > 0):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].text
            steps = None if steps is None else steps - 1
        return done

    def complete(self, texts: list[str]) -> list[str]:
        ids = self.add(texts)
        done = self.run()
        return [done[i] for i in ids]


@pytest.fixture(scope="module", autouse=True)
def in_process_engines() -> Iterator[None]:
    saved = dict(os.environ)  # the engines' variables (launch.EngineSpec) stay with this module
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [p for pair in zip(prompts("code"), prompts("prose"), strict=False) for p in pair][:6]


@pytest.fixture(scope="module")
def reference(texts: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    stock = InProcessEngine(None, tmp_path_factory.mktemp("stock"))
    return stock.complete(texts)


def _count_calls(obj: Any, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


# The EAGLE-3 engine first: vLLM scans every loaded module for Triton kernels when it starts one, and
# trips over an object the n-gram drafter's numba brings in (separate processes in a pod never share one).
def test_a_stateful_drafter_skips_requests_it_missed_tokens_of(
    texts: list[str], reference: list[str], tmp_path: Path
) -> None:
    engine = InProcessEngine(HEADS["tiny-eagle3"], tmp_path)
    runner = engine.runner
    drafted: dict[str, int] = {}
    take = runner.take_draft_token_ids

    def recorded() -> Any:
        drafts = take()
        for req_id, d in zip(drafts.req_ids, drafts.draft_token_ids, strict=True) if drafts else ():
            drafted[req_id] = drafted.get(req_id, 0) + len(d)
        return drafts

    runner.take_draft_token_ids = recorded
    engine.policy(1, 0)
    stale = engine.add(texts[:3])
    engine.run(steps=4)  # the old requests run K = 0 steps: EAGLE's cache misses their tokens
    engine.policy(2, MAX_K)
    # Speculation on, stale requests alone: their drafts would be dropped, so their steps run plain.
    proposals = _count_calls(runner.drafter, "propose")
    plain_steps, spec_steps = runner.plain_steps, runner.spec_steps
    done = engine.run(steps=4)
    assert (proposals, runner.spec_steps) == ([], spec_steps) and runner.plain_steps == plain_steps + 4
    fresh = engine.add(texts[3:])
    done |= engine.run()
    assert [done[i] for i in stale + fresh] == reference

    def drafts_of(request: str) -> int:  # the engine core knows a request by its id and a suffix
        return sum(n for req_id, n in drafted.items() if req_id.startswith(f"{request}-"))

    assert [drafts_of(i) for i in stale] == [0] * len(stale)  # never drafted from a stale cache
    assert all(drafts_of(i) > 0 for i in fresh) and proposals  # with fresh requests in it, it drafts


def test_k0_steps_are_plain_and_output_is_unchanged(
    texts: list[str], reference: list[str], tmp_path: Path
) -> None:
    engine = InProcessEngine(NGRAM, tmp_path)
    runner = engine.runner
    assert isinstance(runner, PlainStepRunner)
    proposals = _count_calls(runner.drafter, "propose")
    rejection_samples = _count_calls(runner, "rejection_sampler")
    engine.policy(1, 0)
    assert engine.complete(texts) == reference
    assert (proposals, rejection_samples, runner.spec_steps) == ([], [], 0)
    assert runner.plain_steps >= TOKENS
    # On, then off and on again while the same requests run: output stays the stock engine's.
    engine.policy(2, MAX_K)
    ids = engine.add(texts)
    done = engine.run(steps=6)
    engine.policy(3, 0)
    done |= engine.run(steps=6)
    engine.policy(4, MAX_K)
    done |= engine.run()
    assert [done[i] for i in ids] == reference
    assert proposals and runner.spec_steps and runner.plain_steps > TOKENS


def test_k0_steps_make_no_draft_round_trip_to_the_worker(
    texts: list[str], reference: list[str], tmp_path: Path
) -> None:
    engine = InProcessEngine(NGRAM, tmp_path, worker_process=True)
    executor = engine.executor
    assert isinstance(executor, PlainStepExecutor)
    round_trips: list[str] = []
    rpc = executor.collective_rpc

    def counted(method: Any, *args: Any, **kwargs: Any) -> Any:
        round_trips.append(method)
        return rpc(method, *args, **kwargs)

    executor.collective_rpc = counted
    engine.policy(1, 0)
    assert engine.complete(texts) == reference
    assert "take_draft_token_ids" not in round_trips
    assert round_trips.count("execute_model") >= TOKENS
    engine.policy(2, MAX_K)
    round_trips.clear()
    assert engine.complete(texts) == reference
    steps = round_trips.count("execute_model")
    # Drafts are fetched after the steps that proposed some: every step but the last ones.
    assert steps - 2 <= round_trips.count("take_draft_token_ids") <= steps
