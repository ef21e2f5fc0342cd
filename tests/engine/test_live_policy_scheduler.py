"""LivePolicyScheduler (vllm_plugins/live_policy.py) as vLLM's engine core builds it, from the config of an
engine specserve starts, but without running a model: the scheduler vLLM would pick (synchronous or
asynchronous) keeps its behaviour, and the policy file sets the K the step drafts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.launch import EngineSpec
from specserve_engine.policy_file import PodPolicy
from specserve_engine.vllm_plugins.live_policy import AsyncLivePolicyScheduler, LivePolicyScheduler
from specserve_testing.engines import HEADS, MAX_K, NGRAM, apply_policy, in_process_engine_args, target_of

pytestmark = pytest.mark.engine

BUCKETS = (1, 2, 4, 8)
BLOCK = 16


def _scheduler(
    runtime_dir: Path, async_scheduling: bool, drafter: SidecarDrafter = NGRAM, prefix_caching: bool = False
) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = EngineSpec(
        model=str(target_of(drafter)),
        served_model_name="t",
        runtime_dir=str(runtime_dir),
        drafter=drafter,
        bucket_bounds=BUCKETS,
        max_num_seqs=8,
        dtype="float32",
    )
    config = in_process_engine_args(spec).create_engine_config()
    # vLLM schedules asynchronously on GPUs and never on its CPU backend; the GPU case is set by hand.
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.num_gpu_blocks = 64  # what the engine core sets after profiling memory
    config.cache_config.enable_prefix_caching = prefix_caching  # then requests need block hashes (_request)
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], attention)]
    )
    scheduler_class = config.scheduler_config.get_scheduler_cls()
    return scheduler_class(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def _request(i: int, prompt: list[int] | None = None, max_tokens: int = 8) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        f"r{i}",
        prompt or list(range(1, 20)),
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_scheduler_vllm_would_pick_with_the_live_table(tmp_path: Path, async_scheduling: bool) -> None:
    scheduler = _scheduler(tmp_path, async_scheduling)
    assert isinstance(scheduler, LivePolicyScheduler)
    assert isinstance(scheduler, AsyncLivePolicyScheduler) is async_scheduling
    request = _request(0)
    scheduler.add_request(request)
    first = scheduler.schedule()
    # An asynchronous scheduler reserves the token being sampled, so it can schedule the next step now.
    assert request.num_output_placeholders == (1 if async_scheduling else 0)
    assert first.num_spec_tokens_to_schedule == MAX_K  # the start-up table: K everywhere

    def k_after(policy: PodPolicy) -> int:
        apply_policy(policy, tmp_path)
        scheduler.add_request(_request(policy.policy_version))
        return scheduler.schedule().num_spec_tokens_to_schedule

    labels = bucket_labels(BUCKETS)
    assert k_after(PodPolicy(1, NGRAM.name, "on", dict.fromkeys(labels, 0), BUCKETS)) == 0
    assert k_after(PodPolicy(2, NGRAM.name, "on", dict.fromkeys(labels, 2), BUCKETS)) == 2
    assert k_after(PodPolicy(3, NGRAM.name, "off", dict.fromkeys(labels, 2), BUCKETS)) == 0


# A drafter whose KV shares the target's blocks, and a prompt of three full blocks and a part. vLLM hits two
# of them for an EAGLE drafter (it recomputes the last block hit, whose hidden states the drafter needs).
EAGLE3 = HEADS["tiny-eagle3"]
SHARED_PROMPT = list(range(100, 100 + 3 * BLOCK + 5))
EAGLE_HIT = 2 * BLOCK


def _policy(version: int, k: int, drafter: SidecarDrafter = EAGLE3) -> PodPolicy:
    return PodPolicy(version, drafter.name, "on", dict.fromkeys(bucket_labels(BUCKETS), k), BUCKETS)


def _step(scheduler: Any, drafts: dict[str, list[int]] | None = None) -> Any:
    """One scheduled step and its output, every request sampling token 7 (and its drafts, if given)."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
        ),
    )
    if drafts:
        scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))
    return output


def _hit_tokens(output: Any, req_id: str) -> int:
    """The prefix-cache hit a newly scheduled request was admitted with."""
    return next(r.num_computed_tokens for r in output.scheduled_new_reqs if r.req_id == req_id)


@pytest.mark.parametrize("first_finished", [True, False])
def test_a_drafting_request_does_not_hit_blocks_filled_in_plain_steps(
    tmp_path: Path, first_finished: bool
) -> None:
    """Blocks a plain step filled hold no drafter KV: a request that will draft recomputes them (once) rather
    than draft from them; blocks filled while drafting are hit as usual. Whether the plain request has
    finished (its blocks freed, still cached) or still runs."""
    scheduler = _scheduler(tmp_path, async_scheduling=False, drafter=EAGLE3, prefix_caching=True)
    apply_policy(_policy(1, 0), tmp_path)
    scheduler.add_request(_request(0, SHARED_PROMPT, max_tokens=1 if first_finished else 8))
    assert _step(scheduler).num_spec_tokens_to_schedule == 0  # the prompt is prefilled plain

    apply_policy(_policy(2, 2), tmp_path)
    scheduler.add_request(_request(1, SHARED_PROMPT, max_tokens=1))
    output = _step(scheduler)
    assert output.num_spec_tokens_to_schedule == 2
    assert _hit_tokens(output, "r1") == 0  # without the guard: EAGLE_HIT, the plain-filled blocks

    scheduler.add_request(_request(2, SHARED_PROMPT, max_tokens=1))
    assert _hit_tokens(_step(scheduler), "r2") == EAGLE_HIT  # r1's blocks, filled while drafting


def test_blocks_filled_while_drafting_are_hit(tmp_path: Path) -> None:
    """The control: the same requests on a pod that drafted throughout keep their hits."""
    scheduler = _scheduler(tmp_path, async_scheduling=False, drafter=EAGLE3, prefix_caching=True)
    apply_policy(_policy(1, 2), tmp_path)
    scheduler.add_request(_request(0, SHARED_PROMPT, max_tokens=1))
    _step(scheduler)
    scheduler.add_request(_request(1, SHARED_PROMPT, max_tokens=1))
    assert _hit_tokens(_step(scheduler), "r1") == EAGLE_HIT


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_hit_plain_filled_blocks_while_off_never_drafts(
    tmp_path: Path, async_scheduling: bool
) -> None:
    """While the pod decodes plainly, a request takes its whole hit (as a stock engine would); speculation
    then resuming drafts for the requests whose drafter KV is whole, not for it."""
    scheduler = _scheduler(tmp_path, async_scheduling, drafter=EAGLE3, prefix_caching=True)
    apply_policy(_policy(1, 0), tmp_path)
    scheduler.add_request(_request(0, SHARED_PROMPT, max_tokens=1))
    _step(scheduler)
    scheduler.add_request(_request(1, SHARED_PROMPT))
    assert _hit_tokens(_step(scheduler), "r1") == EAGLE_HIT

    apply_policy(_policy(2, 2), tmp_path)
    scheduler.add_request(_request(2, list(range(300, 310))))  # shares nothing
    _step(scheduler)  # r2's prefill, r1's decode: both draft from here on where allowed
    for _ in range(3):
        output = _step(scheduler, drafts={"r1": [5, 6], "r2": [5, 6]})
        assert output.num_spec_tokens_to_schedule == 2
        assert "r1" not in output.scheduled_spec_decode_tokens
    assert "r2" in output.scheduled_spec_decode_tokens


def test_engines_without_drafter_kv_keep_every_hit(tmp_path: Path) -> None:
    """n-gram keeps no KV: a prompt first prefilled plain is hit by a drafting request."""
    scheduler = _scheduler(tmp_path, async_scheduling=False, drafter=NGRAM, prefix_caching=True)
    apply_policy(_policy(1, 0, NGRAM), tmp_path)
    scheduler.add_request(_request(0, SHARED_PROMPT, max_tokens=1))
    _step(scheduler)
    apply_policy(_policy(2, 2, NGRAM), tmp_path)
    scheduler.add_request(_request(1, SHARED_PROMPT, max_tokens=1))
    assert _hit_tokens(_step(scheduler), "r1") == 3 * BLOCK
