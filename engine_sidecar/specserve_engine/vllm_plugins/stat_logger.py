"""vLLM stat-logger plugin (`vllm.stat_logger_plugins` entry point): the engine metrics of docs/metrics.md,
per engine step, bucketed by the number of requests the step scheduled.

vLLM calls `record()` in the API server once per engine-core message; a step's message carries its
`SchedulerIterationDetails` (needs --enable-logging-iteration-details, which engine_args sets) and the
spec-decoding stats of the drafts verified in that same step. Steps without iteration details (idle
messages, DP dummies) are not engine steps and are not counted.

Only decode steps count: a step that prefilled a prompt (whole or a chunk, `num_ctx_requests` > 0) is
left out of every counter here, drafts included. Its time is the prompt's, not the batch's decode: on
this repository's CPU engine the prefill step of a lone request took 18.6 ms against 3.8 ms for its
decode steps, and counted as a plain step it made plain decoding look five times slower than it was
at batch 1 while the pod speculated (every other step there drafts), and every drafter's gain with it
(docs/metrics.md). vLLM's own counters still count those steps' drafts.

`speculating` is "true" for a step that ran with speculation on: it verified at least one draft token,
or the policy in force gave its batch size a K > 0 (the K vLLM's scheduler scheduled, from the same table,
live_policy.lookup_for_policy) and the drafter proposed nothing (n-gram or suffix without a match). Such
a step still goes through the proposer and the speculative path, and it is where a drafter that does not
always propose loses: counted as plain, it hid that loss and the drafter's proposal rate (docs/policy.md,
"Drafters that do not always propose"). On the local fleet's prose traffic n-gram proposed in 69 % of
its steps at batch 1, and the rate read 1.03 instead of 0.69.

Drafts, and the step counters of speculative steps, are labelled with the colocated drafter's name (from
--additional-config) or, for sidecar-hosted drafters, the drafter named by the policy file at the time
of the step; plain steps carry an empty `drafter`. `k` is the longest draft the step verified (the K in
force: a drafter may propose fewer tokens for a row, never more), or for a speculative step without
drafts the K in force; "0" for plain steps.

It also registers the collector of the sidecar proposer's step outcomes (`specserve_proposer_calls_total`,
counted by the proposer in the worker processes, see proposer.py), read from the runtime dir at scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Counter
from vllm.v1.metrics.loggers import StatLoggerBase

from specserve_engine import metric_names
from specserve_engine.buckets import bucket_for
from specserve_engine.policy_file import PodPolicy, PolicyReader, policy_path
from specserve_engine.vllm_plugins.live_policy import lookup_for_policy
from specserve_engine.vllm_plugins.plugin_config import SpecservePluginConfig
from specserve_engine.vllm_plugins.proposer import ProposerCallsCollector

UNKNOWN_DRAFTER = "unknown"


@dataclass(frozen=True)
class StepObservation:
    """What one engine step contributes to the metrics (pure data; see `observe_step`)."""

    bucket: str
    batch: int  # requests the step scheduled
    speculating: bool  # drafts were verified
    prefill: bool  # a prompt (or a chunk of one) was prefilled: not a decode step
    seconds: float
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    draft_tokens_per_position: tuple[int, ...]

    @property
    def k(self) -> int:
        """The longest draft verified in the step: the positions any draft reached."""
        return sum(1 for drafted in self.draft_tokens_per_position if drafted)


def observe_step(
    scheduler_stats: Any, iteration_stats: Any, bucket_bounds: tuple[int, ...]
) -> StepObservation | None:
    """The step described by one `record()` call, or None when the call describes no engine step."""
    details = getattr(scheduler_stats, "iteration_details", None) if scheduler_stats is not None else None
    if details is None or details.is_dummy:
        return None
    batch = details.num_ctx_requests + details.num_generation_requests
    if batch == 0:
        return None
    spec = scheduler_stats.spec_decoding_stats
    draft_tokens = spec.num_draft_tokens if spec is not None else 0
    return StepObservation(
        bucket=bucket_for(batch, bucket_bounds),
        batch=batch,
        speculating=draft_tokens > 0,
        prefill=details.num_ctx_requests > 0,
        seconds=details.elapsed_ms / 1000.0,
        generated_tokens=iteration_stats.num_generation_tokens if iteration_stats is not None else 0,
        drafts=spec.num_drafts if spec is not None else 0,
        draft_tokens=draft_tokens,
        accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        accepted_per_position=tuple(spec.num_accepted_tokens_per_pos) if spec is not None else (),
        draft_tokens_per_position=tuple(spec.num_draft_tokens_per_pos) if spec is not None else (),
    )


def step_labels(step: StepObservation, k_in_force: int) -> tuple[bool, int]:
    """(speculating, k) of a decode step: speculative where drafts were verified or the policy in force
    gave its batch size a K > 0; k the longest draft verified, else the K in force (0 for a plain step)."""
    if step.speculating:
        return True, step.k
    return k_in_force > 0, k_in_force


class KInForce:
    """The K vLLM's scheduler schedules per batch size under the pod's policy: the scheduler's own table
    (live_policy.lookup_for_policy), rebuilt when the policy changes. Before the pod has a policy, the
    start-up K at every batch size (the table engine_args starts vLLM with); 0 where the engine was started
    without speculation."""

    def __init__(
        self, reader: PolicyReader, engine_drafter: str | None, max_num_seqs: int, max_k: int
    ) -> None:
        self._reader = reader
        self._engine_drafter = engine_drafter
        self._max_num_seqs = max_num_seqs
        self._max_k = max_k
        self._policy: PodPolicy | None = None
        self._table: list[int] = []

    def at(self, batch: int) -> int:
        if self._max_k == 0:
            return 0
        policy = self._reader.current()
        if policy is None:
            return self._max_k
        if policy is not self._policy:
            self._table = lookup_for_policy(
                policy.drafter,
                policy.mode,
                policy.schedule(self._max_num_seqs),
                self._engine_drafter,
                self._max_num_seqs,
                self._max_k,
            )
            self._policy = policy
        return self._table[min(batch, len(self._table) - 1)]


class _EngineCounters:
    """The plugin's Prometheus counters, registered once per process (vLLM may build a logger per engine)."""

    _instance: _EngineCounters | None = None

    def __init__(self) -> None:
        def counter(metric: metric_names.Metric) -> Counter:
            return Counter(metric.name, metric.help, list(metric.labels), registry=REGISTRY)

        self.steps = counter(metric_names.ENGINE_STEPS)
        self.step_seconds = counter(metric_names.ENGINE_STEP_SECONDS)
        self.generated_tokens = counter(metric_names.ENGINE_GENERATED_TOKENS)
        self.drafts = counter(metric_names.SPEC_DRAFTS)
        self.draft_tokens = counter(metric_names.SPEC_DRAFT_TOKENS)
        self.accepted_tokens = counter(metric_names.SPEC_ACCEPTED_TOKENS)
        self.accepted_per_position = counter(metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION)
        self.draft_tokens_per_position = counter(metric_names.SPEC_DRAFT_TOKENS_PER_POSITION)

    @classmethod
    def get(cls, runtime_dir: Path, model: str) -> _EngineCounters:
        if cls._instance is None:
            cls._instance = cls()
            REGISTRY.register(ProposerCallsCollector(runtime_dir, model))
        return cls._instance


class SpecserveStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self._plugin = SpecservePluginConfig.from_vllm_config(vllm_config)
        self._reader = self._plugin.policy_reader()
        self._model = str(vllm_config.model_config.served_model_name)
        self._counters = _EngineCounters.get(policy_path(self._plugin.runtime_dir).parent, self._model)
        spec_config = vllm_config.speculative_config
        self._k_in_force = KInForce(
            self._reader,
            self._plugin.drafter,
            vllm_config.scheduler_config.max_num_seqs,
            spec_config.num_speculative_tokens if spec_config is not None else 0,
        )

    def _drafter(self) -> str:
        if self._plugin.drafter is not None:
            return self._plugin.drafter
        policy = self._reader.current()
        return policy.drafter if policy is not None else UNKNOWN_DRAFTER

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        step = observe_step(scheduler_stats, iteration_stats, self._plugin.bucket_bounds)
        if step is None or step.prefill:
            return
        c = self._counters
        speculating, k = step_labels(step, self._k_in_force.at(step.batch))
        drafter = self._drafter() if speculating else ""
        engine_labels = (self._model, step.bucket, "true" if speculating else "false", drafter, str(k))
        c.steps.labels(*engine_labels).inc()
        c.step_seconds.labels(*engine_labels).inc(step.seconds)
        c.generated_tokens.labels(*engine_labels).inc(step.generated_tokens)
        if step.drafts == 0:
            return
        spec_labels = (self._model, step.bucket, drafter)
        c.drafts.labels(*spec_labels).inc(step.drafts)
        c.draft_tokens.labels(*spec_labels).inc(step.draft_tokens)
        c.accepted_tokens.labels(*spec_labels).inc(step.accepted_tokens)
        for position, (accepted, drafted) in enumerate(
            zip(step.accepted_per_position, step.draft_tokens_per_position, strict=True)
        ):
            if drafted:
                c.accepted_per_position.labels(*spec_labels, str(position)).inc(accepted)
                c.draft_tokens_per_position.labels(*spec_labels, str(position)).inc(drafted)

    def log_engine_initialized(self) -> None:
        """Nothing to log: the metrics are the output."""
