"""K = 0 steps are plain steps (vllm_plugins/plain_step.py, docs/engine-pod.md#off-costs-nothing), on real
vLLM engines run in this process, so the test can look at the model runner: a K = 0 step makes no drafter
call and runs vLLM's plain sampler; greedy output stays that of an engine without a drafter whatever the
policy does; a drafter fed the target's hidden states catches up on the tokens it skipped, and one that
cannot does not draft for those requests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.launch import EngineSpec
from specserve_engine.policy_file import PodPolicy
from specserve_engine.vllm_plugins import plain_step
from specserve_engine.vllm_plugins.plain_step import (
    PlainStepExecutor,
    PlainStepRunner,
    UnsupportedRunner,
    check_catch_up,
    check_runner,
)
from specserve_testing.engines import (
    HEADS,
    MAX_K,
    NGRAM,
    apply_policy,
    in_process_engine_args,
    prompts,
    target_of,
)

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


def test_the_pinned_drafters_have_what_the_catch_up_uses() -> None:
    from vllm.v1.spec_decode.eagle import EagleProposer

    check_catch_up(EagleProposer)

    class Renamed(EagleProposer):
        def propose(self, num_speculative_tokens: int, target_ids: Any, **kwargs: Any) -> Any:
            return super().propose(num_speculative_tokens, target_ids, **kwargs)

    with pytest.raises(UnsupportedRunner, match="target_token_ids"):
        check_catch_up(Renamed)


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
            model=str(target_of(drafter)),
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
        self.tokens: dict[str, list[int]] = {}  # each finished request's prompt and output tokens
        self.executor: Any = self.engine.engine_core.engine_core.model_executor
        self.runner: Any = None if worker_process else self.executor.driver_worker.worker.model_runner
        self._ids = 0

    def policy(self, version: int, k: int) -> None:
        assert self.drafter is not None
        apply_policy(
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
                    self.tokens[out.request_id] = [*out.prompt_token_ids, *out.outputs[0].token_ids]
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


def _record_calls(obj: Any, name: str) -> list[dict[str, Any]]:
    """The keyword arguments of every call of `obj.name` from now on."""
    calls: list[dict[str, Any]] = []
    original = getattr(obj, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(*args, **kwargs)

    setattr(obj, name, recorded)
    return calls


class RecordedDrafts:
    """Every draft a runner hands the engine core: per request (by the id the test gave it) and position of
    its first token, the tokens."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.by_request: dict[str, dict[int, tuple[int, ...]]] = {}
        take = runner.take_draft_token_ids

        def recorded() -> Any:
            drafts = take()
            batch = runner.input_batch
            for req_id, d in zip(drafts.req_ids, drafts.draft_token_ids, strict=True) if drafts else ():
                if d:  # the engine core knows a request by the test's id and a suffix
                    position = int(batch.num_tokens_no_spec[batch.req_id_to_index[req_id]])
                    self.by_request.setdefault(req_id.rsplit("-", 1)[0], {})[position] = tuple(d)
            return drafts

        runner.take_draft_token_ids = recorded

    def count(self, request: str) -> int:
        return sum(len(d) for d in self.by_request.get(request, {}).values())

    def mean_accepted(self, tokens: dict[str, list[int]], requests: list[str] | None = None) -> float:
        """Draft tokens that match the request's final tokens (greedy: what verification accepted), per
        draft; of `requests` only, if given."""
        accepted = drafted = 0
        for request, by_position in self.by_request.items():
            if requests is not None and request not in requests:
                continue
            final = tokens[request]
            for position, draft in by_position.items():
                drafted += 1
                for i, token in enumerate(draft):
                    if position + i >= len(final) or final[position + i] != token:
                        break
                    accepted += 1
        return accepted / max(drafted, 1)


# The EAGLE-3 engines first: vLLM scans every loaded module for Triton kernels when it starts one, and
# trips over an object the n-gram drafter's numba brings in (separate processes in a pod never share one).
@pytest.mark.parametrize("head", ["tiny-eagle3", "tiny-mtp"])  # the target's layers' states; its last
def test_a_hidden_state_drafter_catches_up_on_the_steps_it_skipped(
    head: str, texts: list[str], reference: list[str], tmp_path: Path
) -> None:
    """EAGLE-3 and MTP miss the positions of K = 0 steps: of requests that were drafting when speculation
    turned off, and the prompts of requests admitted while it was off. When speculation resumes they
    first fill their cache from the target's hidden states kept for those positions, so they draft for
    those requests again, as well as an engine that never stopped speculating (EAGLE-3 from a cache left
    stale accepts about a quarter fewer tokens per draft here)."""
    always = InProcessEngine(HEADS[head], tmp_path / "always")
    always.policy(1, MAX_K)
    always_drafts = RecordedDrafts(always.runner)
    expected = always.complete(texts)
    if head == "tiny-eagle3":  # MTP serves its own target (its greedy identity: test_colocated_heads.py)
        assert expected == reference

    engine = InProcessEngine(HEADS[head], tmp_path / "resumed")
    runner = engine.runner
    drafts = RecordedDrafts(runner)
    engine.policy(1, MAX_K)
    drafting = engine.add(texts[:3])
    engine.run(steps=3)  # prefill and two speculative steps
    passes = _record_calls(runner.drafter, "propose")
    engine.policy(2, 0)  # the next step verifies its drafts and proposes none; then plain steps
    admitted = engine.add(texts[3:])  # prefilled in a plain step
    engine.run(steps=5)
    # The step that verified the last drafts ran the drafter's K = 0 pass over them; plain steps, nothing.
    assert [p["num_speculative_tokens"] for p in passes] == [0] and runner.plain_steps >= 3
    kept, gaps = plain_step.skipped_by_request(runner._skipped)
    assert set(kept) == set(runner.input_batch.req_ids) and not gaps and not runner._stale
    engine.policy(3, MAX_K)
    engine.run(steps=1)
    # The catch-up pass over the kept positions, then drafting.
    assert [p["num_speculative_tokens"] for p in passes] == [0, 0, MAX_K]
    done = engine.run()
    assert [done[i] for i in drafting + admitted] == expected
    assert not runner._stale and not runner._skipped
    for request in drafting + admitted:  # each engine numbers its requests r1, r2, ...
        assert drafts.count(request) > 0, f"{request} drafted nothing after resuming"
    # Accepted draft tokens per draft over the six requests: a cache with stale positions drafts worse.
    ours, theirs = drafts.mean_accepted(engine.tokens), always_drafts.mean_accepted(always.tokens)
    assert ours >= 0.9 * theirs, (ours, theirs)


def test_a_request_whose_skipped_positions_do_not_fit_gets_no_drafts(
    texts: list[str], reference: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plain_step, "CATCH_UP_TOKENS", 0)  # nothing kept: every skipped request is stale
    engine = InProcessEngine(HEADS["tiny-eagle3"], tmp_path)
    runner = engine.runner
    drafts = RecordedDrafts(runner)
    engine.policy(1, 0)
    stale = engine.add(texts[:3])
    engine.run(steps=4)  # the old requests run K = 0 steps: EAGLE's cache misses their tokens
    assert not runner._keeping and not runner._skipped  # a stretch too long: nothing more is kept
    engine.policy(2, MAX_K)
    # Speculation on, stale requests alone: their drafts would be dropped, so their steps run plain.
    proposals = _record_calls(runner.drafter, "propose")
    plain_steps, spec_steps = runner.plain_steps, runner.spec_steps
    done = engine.run(steps=4)
    assert (proposals, runner.spec_steps) == ([], spec_steps) and runner.plain_steps == plain_steps + 4
    fresh = engine.add(texts[3:])
    done |= engine.run()
    assert [done[i] for i in stale + fresh] == reference
    assert [drafts.count(i) for i in stale] == [0] * len(stale)  # never drafted from a stale cache
    assert all(drafts.count(i) > 0 for i in fresh) and proposals  # with fresh requests in it, it drafts


def test_a_prefix_hit_on_blocks_filled_plain_is_recomputed_or_never_drafted(tmp_path: Path) -> None:
    """A long shared prefix first prefilled while speculation was off holds the target's KV but not
    EAGLE-3's (vllm_plugins/plain_filled_blocks.py). Once speculation is on, a request sharing it
    recomputes those blocks rather than draft from them, and drafts as well as on an engine that was
    always on; one admitted while off takes the whole hit and never drafts. Output stays exact."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_of(HEADS["tiny-eagle3"])))
    shared = ""
    for text in [*prompts("code"), *prompts("prose")]:  # past three 128-token blocks, the CPU block size
        if len(tokenizer(shared).input_ids) > 3 * 128 + 8:
            break
        shared += text + "\n"
    asks = [shared + p for p in prompts("code")[:2]]

    always = InProcessEngine(HEADS["tiny-eagle3"], tmp_path / "always")
    always.policy(1, MAX_K)
    always_drafts = RecordedDrafts(always.runner)
    always.complete([shared])
    expected = always.complete(asks)

    engine = InProcessEngine(HEADS["tiny-eagle3"], tmp_path / "resumed")
    scheduler = engine.engine.engine_core.engine_core.scheduler
    hits = _record_hits(scheduler)
    verified = _record_verified(scheduler)
    drafts = RecordedDrafts(engine.runner)
    engine.policy(1, 0)
    engine.complete([shared])  # the prefix's blocks filled in plain steps
    off = engine.add(asks[:1])
    engine.run(steps=2)
    engine.policy(2, MAX_K)
    on = engine.add(asks[1:])
    done = engine.run()
    assert [done[i] for i in off + on] == expected
    assert hits[off[0]] >= 2 * 128 and hits[on[0]] == 0  # the whole hit while off; recomputed once on
    # It holds the plain-filled blocks: whatever the drafter proposes for it, nothing is verified.
    assert off[0] not in verified and verified[on[0]] > 0
    ours = drafts.mean_accepted(engine.tokens, on)
    theirs = always_drafts.mean_accepted(always.tokens, ["r3"])  # always's asks were r2 and r3
    assert ours >= 0.9 * theirs, (ours, theirs)


def test_k0_steps_are_plain_and_output_is_unchanged(
    texts: list[str], reference: list[str], tmp_path: Path
) -> None:
    engine = InProcessEngine(NGRAM, tmp_path)
    runner = engine.runner
    assert isinstance(runner, PlainStepRunner)
    proposals = _record_calls(runner.drafter, "propose")
    rejection_samples = _record_calls(runner, "rejection_sampler")
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


def _record_verified(scheduler: Any) -> dict[str, int]:
    """Draft tokens the scheduler sent to be verified, per request (by the id the test gave it)."""
    verified: dict[str, int] = {}
    schedule = scheduler.schedule

    def recorded(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        for req_id, draft in output.scheduled_spec_decode_tokens.items():
            request = req_id.rsplit("-", 1)[0]
            verified[request] = verified.get(request, 0) + len(draft)
        return output

    scheduler.schedule = recorded
    return verified


def _record_hits(scheduler: Any) -> dict[str, int]:
    """The prefix-cache hit each request was admitted with (by the id the test gave it)."""
    hits: dict[str, int] = {}
    lookup = scheduler._get_local_prefix_cache_hit

    def recorded(request: Any) -> Any:
        hit = lookup(request)
        hits[request.request_id.rsplit("-", 1)[0]] = hit[1]
        return hit

    scheduler._get_local_prefix_cache_hit = recorded
    return hits
