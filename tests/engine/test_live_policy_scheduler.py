"""LivePolicyScheduler (vllm_plugins/live_policy.py) as vLLM's engine core builds it, from the config of an
engine specserve starts, but without running a model: the scheduler vLLM would pick (synchronous or
asynchronous) keeps its behaviour, and the policy file sets the K the step drafts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specserve_engine.buckets import bucket_labels
from specserve_engine.launch import EngineSpec
from specserve_engine.policy_file import PodPolicy
from specserve_engine.vllm_plugins.live_policy import AsyncLivePolicyScheduler, LivePolicyScheduler
from specserve_testing.engines import MAX_K, NGRAM, TARGET, apply_policy, in_process_engine_args

pytestmark = pytest.mark.engine

BUCKETS = (1, 2, 4, 8)
BLOCK = 16


def _scheduler(runtime_dir: Path, async_scheduling: bool) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = EngineSpec(
        model=str(TARGET),
        served_model_name="t",
        runtime_dir=str(runtime_dir),
        drafter=NGRAM,
        bucket_bounds=BUCKETS,
        max_num_seqs=8,
        dtype="float32",
    )
    config = in_process_engine_args(spec).create_engine_config()
    # vLLM schedules asynchronously on GPUs and never on its CPU backend; the GPU case is set by hand.
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.num_gpu_blocks = 64  # what the engine core sets after profiling memory
    config.cache_config.enable_prefix_caching = False  # requests made here carry no block hashes
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


def _request(i: int) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(f"r{i}", list(range(1, 20)), SamplingParams(max_tokens=8), None)


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
