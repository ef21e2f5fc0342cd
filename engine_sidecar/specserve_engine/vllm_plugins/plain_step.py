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
- drafters with their own KV cache (EAGLE, EAGLE-3, MTP, draft model) miss the positions of a skipped
  step. Those fed the target's hidden states (EAGLE, EAGLE-3, MTP) catch up after a short K = 0 stretch:
  its plain steps keep the hidden states of the positions they ran (CATCH_UP_TOKENS at most, all
  requests together), and the first step that proposes again first runs the drafter's own KV-filling
  pass (vLLM's K = 0 pass) over them; the step that turns speculation off runs that pass over the
  positions it verified. The requests of a longer stretch, and every request of a draft-model drafter
  (its pass needs more than tokens and hidden states), are stale: they get no drafts until they finish
  (correct output, no drafting from stale state); requests admitted later draft normally, and a step of
  stale requests alone runs plain (its drafts would all be dropped).

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

import dataclasses
import inspect
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
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
# What the catch-up (PlainStepRunner._keep_skipped, _catch_up) reads and calls, as vLLM 0.32 defines it.
CATCH_UP_PROPOSE_ARGS = (
    "num_speculative_tokens",
    "target_token_ids",
    "target_positions",
    "target_hidden_states",
    "next_token_ids",
    "token_indices_to_sample",
    "common_attn_metadata",
    "sampling_metadata",
)
CATCH_UP_METADATA_FIELDS = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "block_table_tensor",
    "slot_mapping",
    "causal",
)
CATCH_UP_STATE_FIELDS = ("scheduler_output", "hidden_states", "aux_hidden_states")
# Positions of skipped steps whose hidden states a runner keeps for a drafter to catch up on, all requests
# together (an 8B EAGLE-3's three layers in bf16: 24 KiB a position, 48 MiB in all); a K = 0 stretch
# longer than that leaves its requests stale. Capped at the engine's tokens per step, the most one drafter
# pass takes.
CATCH_UP_TOKENS = 2048


class SkippedStep(NamedTuple):
    """What one plain step ran, kept for a hidden-state drafter to catch up on: its requests (the input
    batch's order), each one's first position, the positions scheduled per request, their number, and the
    target's hidden states for all of them (the requests' rows one after another). In eager mode these are
    the step's own outputs, kept as they are: a plain step stays as cheap as a stock engine's."""

    req_ids: list[str]
    firsts: np.ndarray
    scheduled: dict[str, int]
    tokens: int
    hidden: list[torch.Tensor]  # EAGLE-3: the target's three layers', joined when caught up; else one


@dataclasses.dataclass
class Skipped:
    """One request's positions from the kept steps: contiguous from `start`, their hidden states in order."""

    start: int
    count: int = 0
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.count


def skipped_by_request(steps: Iterable[SkippedStep]) -> tuple[dict[str, Skipped], set[str]]:
    """The kept steps' positions per request, and the requests whose kept positions have a gap (a
    preempted request computed again)."""
    out: dict[str, Skipped] = {}
    broken: set[str] = set()
    for step in steps:
        offset = 0
        for req_id, first in zip(step.req_ids, step.firsts.tolist(), strict=True):
            count = step.scheduled.get(req_id, 0)
            rows, offset = slice(offset, offset + count), offset + count
            if count == 0:
                continue
            entry = out.setdefault(req_id, Skipped(first))
            if entry.end != first:
                broken.add(req_id)
            entry.hidden.append(torch.cat([h[rows] for h in step.hidden], dim=-1))
            entry.count += count
    return {r: e for r, e in out.items() if r not in broken}, broken


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


def check_catch_up(proposer_class: type) -> None:
    """Raise UnsupportedRunner unless the drafter's pass, vLLM's attention metadata and the runner's step
    state have what the catch-up uses (an upgrade that changes them must fail at start-up)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState

    params = inspect.signature(proposer_class.propose).parameters
    missing = [f"{proposer_class.__name__}.propose({a})" for a in CATCH_UP_PROPOSE_ARGS if a not in params]
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    missing += [f"CommonAttentionMetadata.{f}" for f in CATCH_UP_METADATA_FIELDS if f not in fields]
    missing += [f"ExecuteModelState.{f}" for f in CATCH_UP_STATE_FIELDS if f not in ExecuteModelState._fields]
    if missing:
        raise UnsupportedRunner(f"the drafter catch-up needs {', '.join(missing)}")


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
    _skipped: list[SkippedStep]  # plain steps a hidden-state drafter will catch up on
    _skipped_tokens: int
    _catch_up_cap: int
    _keeping: bool  # whether this K = 0 stretch is still short enough to catch up on
    _catches_up: bool  # whether the drafter has a KV cache it fills from what a plain step can keep
    _suffix_seen: dict[str, int]  # tokens of each request the suffix cache holds
    plain_steps: int
    spec_steps: int

    def adopt(self: Any) -> None:
        self._spec_config = self.speculative_config
        self._plain_now = False
        self._stale = set()
        self._skipped = []
        self._skipped_tokens = 0
        self._catch_up_cap = min(CATCH_UP_TOKENS, self.scheduler_config.max_num_batched_tokens)
        self._keeping = True
        # The drafter's KV-filling pass takes the target's tokens, positions and hidden states: EAGLE,
        # EAGLE-3, MTP; not the draft model (extra input slots), not M-RoPE positions.
        drafter = self.drafter
        self._catches_up = bool(
            self._stateful_drafter()
            and getattr(drafter, "pass_hidden_states_to_model", False)
            and not getattr(drafter, "needs_extra_input_slots", True)
            and not self.uses_mrope
        )
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
            self._keeping = True  # a new K = 0 stretch may be caught up on
            return super().sample_tokens(grammar_output)  # type: ignore[misc]
        self._plain_now = False
        self.plain_steps += 1
        if self._stateful_drafter():
            if self._keeping and self._catches_up:
                self._keep_skipped()  # before vLLM's sampling consumes the step's state
            else:
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
            if self._catches_up:
                # vLLM's K = 0 pass: the drafter's cache takes the positions this step verified.
                return super().propose_draft_token_ids(  # type: ignore[misc]
                    scheduler_output, sampled_token_ids, *args, **kwargs
                )
            if self._stateful_drafter():
                self._stale.update(batch.req_ids)
            return [[] for _ in range(batch.num_reqs)]
        if self._skipped:
            bound = inspect.signature(super().propose_draft_token_ids).bind(  # type: ignore[misc]
                scheduler_output, sampled_token_ids, *args, **kwargs
            )
            self._catch_up(bound.arguments["common_attn_metadata"], bound.arguments["sampling_metadata"])
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

    def _keep_skipped(self: Any) -> None:
        """Keep what this plain step ran for the drafter to catch up on (references to the step's hidden
        states and a copy of its requests' positions; the per-request work waits for the catch-up). A
        stretch of plain steps longer than CATCH_UP_TOKENS positions is not caught up on: its requests
        become stale and nothing more is kept until speculation resumes (a version that kept the latest
        positions through a long stretch measured 0.96-0.97 of a stock engine at batch 1 and 4)."""
        state = self.execute_model_state
        out = state.scheduler_output
        n = out.total_num_scheduled_tokens
        hidden = state.aux_hidden_states or [state.hidden_states]
        if not self.model_config.enforce_eager:  # replayed graphs write the same buffers every step
            hidden = [h[:n].clone() for h in hidden]
        batch = self.input_batch
        k = batch.num_reqs
        self._skipped.append(
            SkippedStep(
                batch.req_ids[:k],
                batch.num_computed_tokens_cpu[:k].copy(),
                out.num_scheduled_tokens,
                n,
                hidden,
            )
        )
        self._skipped_tokens += n
        if self._skipped_tokens > self._catch_up_cap:  # a long stretch: it stays off, stale and cheap
            self._stale.update(r for step in self._skipped for r in step.req_ids if r in self.requests)
            self._skipped, self._skipped_tokens, self._keeping = [], 0, False

    def _catch_up(self: Any, cad: Any, sampling_metadata: Any) -> None:
        """Run the drafter's KV-filling pass over the kept positions of the requests in this step, before
        it drafts for them: for each, the tokens at those positions and the target's hidden states there,
        the token after the last (this step's first) as the pass's next token. Requests kept but not in
        this step, or whose positions no longer follow on, become stale."""
        batch = self.input_batch
        skipped, broken = skipped_by_request(self._skipped)
        self._skipped, self._skipped_tokens = [], 0
        self._stale.update(r for r in broken if r in self.requests)
        rows: list[int] = []
        entries: list[Skipped] = []
        for i, req_id in enumerate(batch.req_ids):
            entry = skipped.pop(req_id, None)
            if entry is None or req_id in self._stale:
                continue
            if entry.end == int(batch.num_computed_tokens_cpu[i]):
                rows.append(i)
                entries.append(entry)
            else:
                self._stale.add(req_id)
        self._stale.update(r for r in skipped if r in self.requests)  # kept, unfinished, not in this step
        if not entries:
            return
        pairs = list(zip(rows, entries, strict=True))
        tokens = [torch.from_numpy(batch.token_ids_cpu[i, e.start : e.end]) for i, e in pairs]
        positions = torch.cat([torch.arange(e.start, e.end) for e in entries])
        counts = torch.tensor([e.count for e in entries])
        query_start = torch.zeros(len(entries) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(counts, 0)
        block_table = cad.block_table_tensor[torch.tensor(rows, device=cad.block_table_tensor.device)]
        block_size = self.drafter.block_size
        request = torch.repeat_interleave(torch.arange(len(entries)), counts).to(block_table.device)
        on_device = positions.to(block_table.device)
        slots = block_table[request, on_device // block_size] * block_size + on_device % block_size
        seq_lens = torch.tensor([e.end for e in entries], dtype=torch.int32)
        ours = {
            "query_start_loc": query_start.to(cad.query_start_loc.device),
            "query_start_loc_cpu": query_start,
            "seq_lens": seq_lens.to(cad.seq_lens.device),
            "num_reqs": len(entries),
            "num_actual_tokens": int(counts.sum()),
            "max_query_len": int(counts.max()),
            "max_seq_len": int(seq_lens.max()),
            "block_table_tensor": block_table,
            "slot_mapping": slots.to(torch.int64),
            "causal": True,
        }
        # Every other per-request field is optional (None where a backend does not need it).
        unset = {f.name: None for f in dataclasses.fields(cad) if f.name not in ours and f.default is None}
        device = self.input_ids.gpu.device
        self.drafter.propose(
            num_speculative_tokens=0,
            target_token_ids=torch.cat(tokens).to(device=device, dtype=self.input_ids.gpu.dtype),
            target_positions=positions.to(device=device, dtype=self.positions.dtype),
            target_hidden_states=torch.cat([h for e in entries for h in e.hidden]),
            next_token_ids=torch.tensor(
                [int(batch.token_ids_cpu[i, e.end]) for i, e in pairs],
                device=device,
                dtype=self.input_ids.gpu.dtype,
            ),
            token_indices_to_sample=None,
            common_attn_metadata=dataclasses.replace(cad, **ours, **unset),
            sampling_metadata=sampling_metadata,
        )

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
    if runner._catches_up:
        check_catch_up(type(runner.drafter))
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
