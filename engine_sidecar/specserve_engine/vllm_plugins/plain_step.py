"""Plain steps: a K = 0 step of a speculative engine costs what a step of an engine without a drafter
costs (docs/engine-pod.md#off-costs-nothing).

vLLM 0.32 runs its speculative path on every step of an engine started with a speculative config, even
where the dynamic-SD table says K = 0: draft-token metadata, the rejection sampler instead of the plain
sampler, and the drafter (EAGLE's and the draft model's KV-sync forward, the n-gram scan, the sidecar's
socket round trip). None of the scheduler, custom-proposer or plugin hooks can skip that: the model runner
decides it from `speculative_config is not None`. `PlainStepWorker` (passed as `--worker-cls` by
engine_args.py) is vLLM's worker for the platform whose model runner is `PlainStepRunner`:

- a step that verifies no drafts and proposes none (K = 0 for its batch) runs as if the engine had no
  speculative config: plain sampler, no draft metadata, no drafter call;
- a step that proposes none but verifies drafts (the step speculation turns off) skips the drafter;
- the sidecar's proposer gets the step's K and the rows' request ids (row identity without hashing);
- suffix decoding drafts only K tokens, and catches up on the tokens of the steps it skipped; Medusa's
  heads run once and are cut to K (vLLM's proposer insists on its maximum);
- drafters with their own KV cache (EAGLE, EAGLE-3, MTP, draft model) missed the tokens of a skipped
  step, and their cache for those positions is stale: the requests that were in a skipped step get no
  drafts from them until they finish (correct output, no drafting from stale state); requests admitted
  later draft normally, and a step of stale requests alone runs plain (its drafts would all be dropped).

After every step of a speculative engine, vLLM's engine core asks the worker for the drafts it proposed:
where the worker runs in its own process (the CPU backend always, GPUs with tensor parallelism) that is a
round trip through shared memory, about a tenth of a small batch's step on this CPU. `PlainStepExecutor`
(passed as `--distributed-executor-backend` there) is vLLM's multiprocess executor that answers "none"
itself when no step since the last answer proposed any (every step with K = 0): the scheduler has already
cleared the requests' drafts when it scheduled them, so "none" is what the worker would have said.

The runner is vLLM's own class with a few methods wrapped, swapped in after vLLM built it, so every other
behaviour is vLLM's. `check_runner` refuses (the engine does not start) a vLLM whose runner does not have
the methods and arguments these wrappers rely on; tests/engine/test_plain_step.py checks that K = 0 steps
are plain and that greedy output is unchanged on the pinned vLLM.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from specserve_engine.vllm_plugins.proposer import SidecarProposer

log = logging.getLogger(__name__)

# The runner methods wrapped here and the arguments they read, as vLLM 0.32 defines them.
RUNNER_CONTRACT: dict[str, tuple[str, ...]] = {
    "execute_model": ("scheduler_output", "intermediate_tensors"),
    "sample_tokens": ("grammar_output",),
    "propose_draft_token_ids": ("scheduler_output", "sampled_token_ids"),
    "take_draft_token_ids": (),
}
RUNNER_ATTRIBUTES = ("speculative_config", "drafter", "input_batch", "num_spec_tokens")


class UnsupportedRunner(RuntimeError):
    """vLLM's model runner is not the one plain steps were written against."""


def check_runner(runner_class: type) -> None:
    """Raise UnsupportedRunner unless `runner_class` is vLLM's V1 runner with the methods and arguments the
    plain-step wrappers use (an upgrade that changes them must fail at start-up, not misbehave)."""
    if not issubclass(runner_class, GPUModelRunner):
        raise UnsupportedRunner(
            f"{runner_class.__qualname__} is not vLLM's V1 model runner (plain steps wrap GPUModelRunner; "
            "set VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    for name, params in RUNNER_CONTRACT.items():
        method = getattr(runner_class, name, None)
        if method is None:
            raise UnsupportedRunner(f"vLLM's model runner has no {name}()")
        have = list(inspect.signature(method).parameters)[1:]
        if list(params) != have[: len(params)]:
            raise UnsupportedRunner(f"{name}{tuple(have)}: expected the arguments to start with {params}")


def is_plain_step(
    num_spec_tokens_to_schedule: int,
    scheduled_spec_decode_tokens: dict,
    scheduled_req_ids: Iterable[str],
    stale: set[str],
) -> bool:
    """A step with nothing to verify and nothing to propose: K = 0, or every request in it stale (its
    drafts would all be dropped, so the drafter would run for none)."""
    if any(scheduled_spec_decode_tokens.values()):
        return False
    return num_spec_tokens_to_schedule == 0 or (bool(stale) and all(r in stale for r in scheduled_req_ids))


def drop_stale(drafts: DraftTokenIds, stale: set[str]) -> DraftTokenIds:
    """The drafts with those of stale requests emptied."""
    return DraftTokenIds(
        drafts.req_ids,
        [[] if r in stale else d for r, d in zip(drafts.req_ids, drafts.draft_token_ids, strict=True)],
    )


class PlainStepRunner:
    """Mixed in front of vLLM's model runner class (see the module docstring); state set by `adopt`."""

    _spec_config: Any
    _plain_now: bool
    _stale: set[str]  # requests a stateful drafter missed tokens of
    _suffix_seen: dict[str, int]  # tokens of each request the suffix cache holds
    plain_steps: int
    spec_steps: int

    def adopt(self: Any) -> None:
        self._spec_config = self.speculative_config
        self._plain_now = False
        self._stale = set()
        self._suffix_seen = {}
        self.plain_steps = 0
        self.spec_steps = 0

    def _stateful_drafter(self: Any) -> bool:
        return bool(self._spec_config.uses_draft_kv_cache())

    def execute_model(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        for req_id in scheduler_output.finished_req_ids:
            self._stale.discard(req_id)
            self._suffix_seen.pop(req_id, None)
        self._plain_now = scheduler_output.total_num_scheduled_tokens > 0 and is_plain_step(
            scheduler_output.num_spec_tokens_to_schedule,
            scheduler_output.scheduled_spec_decode_tokens,
            scheduler_output.num_scheduled_tokens,
            self._stale,
        )
        if not self._plain_now:
            return super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        self.speculative_config = None  # the model runner's one switch for its speculative path
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        finally:
            self.speculative_config = self._spec_config

    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        if not self._plain_now:
            self.spec_steps += 1
            return super().sample_tokens(grammar_output)  # type: ignore[misc]
        self._plain_now = False
        self.plain_steps += 1
        if self._stateful_drafter():
            self._stale.update(self.input_batch.req_ids)
        self.speculative_config = None
        try:
            return super().sample_tokens(grammar_output)  # type: ignore[misc]
        finally:
            self.speculative_config = self._spec_config

    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        k = scheduler_output.num_spec_tokens_to_schedule
        batch = self.input_batch
        if k == 0:  # drafts verified in this step, none wanted for the next
            if self._stateful_drafter():
                self._stale.update(batch.req_ids)
            return [[] for _ in range(batch.num_reqs)]
        drafter = self.drafter
        if isinstance(drafter, SidecarProposer):
            return drafter.propose_rows(
                k, sampled_token_ids, batch.req_ids, batch.num_tokens_no_spec, batch.token_ids_cpu
            )
        method = self._spec_config.method
        if method not in ("suffix", "medusa"):
            return super().propose_draft_token_ids(  # type: ignore[misc]
                scheduler_output, sampled_token_ids, *args, **kwargs
            )
        if method == "suffix":
            sampled_token_ids = self._suffix_catch_up(sampled_token_ids)
        # Both proposers assert the step's K equals their own: theirs follows the step's for the call.
        drafter.num_speculative_tokens = k
        try:
            drafts = super().propose_draft_token_ids(  # type: ignore[misc]
                scheduler_output, sampled_token_ids, *args, **kwargs
            )
        finally:
            drafter.num_speculative_tokens = self.num_spec_tokens
        return drafts[:, :k] if method == "medusa" else drafts

    def _suffix_catch_up(self: Any, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Each row's output tokens the suffix cache has not seen (those of the steps it skipped and this
        one's), in place of this step's sampled tokens, which is what vLLM's suffix proposer appends."""
        batch = self.input_batch
        out: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill: the proposer skips it
                out.append(sampled)
                continue
            req_id = batch.req_ids[i]
            length = int(batch.num_tokens_no_spec[i])
            # New to the proposer: it starts the request from its prompt, the rest is output to append.
            seen = self._suffix_seen.get(req_id, int(batch.num_prompt_tokens[i]))
            self._suffix_seen[req_id] = length
            out.append(batch.token_ids_cpu[i, seen:length].tolist())
        if len(self._suffix_seen) > batch.num_reqs:  # requests that left the batch restart from their prompt
            self._suffix_seen = {r: self._suffix_seen[r] for r in batch.req_ids if r in self._suffix_seen}
        return out

    def take_draft_token_ids(self: Any) -> DraftTokenIds | None:
        drafts = super().take_draft_token_ids()  # type: ignore[misc]
        if drafts is None or not self._stale:
            return drafts
        return drop_stale(drafts, self._stale)


def adopt_runner(runner: Any) -> Any:
    """`runner` turned into a PlainStepRunner of its own class (same object, same state)."""
    base = type(runner)
    check_runner(base)
    missing = [a for a in RUNNER_ATTRIBUTES if not hasattr(runner, a)]
    if missing:
        raise UnsupportedRunner(f"vLLM's model runner lacks {', '.join(missing)}")
    runner.__class__ = type(f"PlainStep{base.__name__}", (PlainStepRunner, base), {})
    runner.adopt()
    return runner


def _platform_worker() -> type:
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class PlainStepWorker(_platform_worker()):  # type: ignore[misc]
    """vLLM's worker for this platform, with a PlainStepRunner model runner."""

    def init_device(self) -> None:
        super().init_device()
        if self.vllm_config.speculative_config is not None:
            self.model_runner = adopt_runner(self.model_runner)
            log.info("specserve: K = 0 steps run as plain steps (%s)", type(self.model_runner).__name__)


class PlainStepExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor without the draft round trip after steps that proposed nothing."""

    # Whether a step since the last take_draft_token_ids may have proposed drafts. With a batch queue the
    # engine core takes drafts after the next step went out, so one flag for every step since the last
    # take, not just the latest, keeps this exact there too.
    _may_have_drafts = False

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if scheduler_output.num_spec_tokens_to_schedule > 0:
            self._may_have_drafts = True
        return super().execute_model(scheduler_output, non_block)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self._may_have_drafts:
            return None  # what the worker answers after steps that proposed none
        self._may_have_drafts = False
        return super().take_draft_token_ids()
