"""The single source of metric names: the vLLM plugin, the sidecar, the operator, the dashboards and
the alert rules all read them from here; docs/metrics.md documents each one.

Names carry no `vllm:` prefix: vLLM unregisters every collector whose name starts with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram", "info"]


@dataclass(frozen=True)
class Metric:
    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name the metric exposes in the Prometheus text format."""
        if self.type == "counter":
            return (f"{self.name}_total",)
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


# Label names shared by several metrics.
MODEL = "model_name"
BUCKET = "bucket"
SPECULATING = "speculating"
DRAFTER = "drafter"
POSITION = "position"
K = "k"

# --- engine (vLLM stat-logger plugin), one observation per engine step -------------------------------
# Counters are declared without the `_total` suffix, as prometheus_client wants them.
# `drafter` names the drafter in force for speculative steps (empty for plain steps) and `k` the drafts'
# length the step verified ("0" for plain steps), so a pod that switched drafters or K inside a window
# still gives the step time of each drafter at each K.
ENGINE_STEPS = Metric(
    "specserve_engine_steps",
    "counter",
    (MODEL, BUCKET, SPECULATING, DRAFTER, K),
    "Engine steps by batch-size bucket (and drafter and K, for speculative steps).",
)
ENGINE_STEP_SECONDS = Metric(
    "specserve_engine_step_seconds",
    "counter",
    (MODEL, BUCKET, SPECULATING, DRAFTER, K),
    "Wall time of engine steps by batch-size bucket (and drafter and K, for speculative steps).",
)
ENGINE_GENERATED_TOKENS = Metric(
    "specserve_engine_generated_tokens",
    "counter",
    (MODEL, BUCKET, SPECULATING, DRAFTER, K),
    "Output tokens produced by engine steps by batch-size bucket (and drafter and K, for speculative steps).",
)
SPEC_DRAFTS = Metric(
    "specserve_spec_drafts", "counter", (MODEL, BUCKET, DRAFTER), "Requests whose drafts were verified."
)
SPEC_DRAFT_TOKENS = Metric(
    "specserve_spec_draft_tokens", "counter", (MODEL, BUCKET, DRAFTER), "Draft tokens verified."
)
SPEC_ACCEPTED_TOKENS = Metric(
    "specserve_spec_accepted_tokens",
    "counter",
    (MODEL, BUCKET, DRAFTER),
    "Draft tokens accepted (the bonus token excluded).",
)
SPEC_ACCEPTED_TOKENS_PER_POSITION = Metric(
    "specserve_spec_accepted_tokens_per_position",
    "counter",
    (MODEL, BUCKET, DRAFTER, POSITION),
    "Drafts whose token at this position (0-based) was accepted.",
)
SPEC_DRAFT_TOKENS_PER_POSITION = Metric(
    "specserve_spec_draft_tokens_per_position",
    "counter",
    (MODEL, BUCKET, DRAFTER, POSITION),
    "Drafts that proposed a token at this position (0-based): the denominator of per-position acceptance.",
)
# The sidecar proposer's engine steps (vllm_plugins/proposer.py): answered in time, missed (late or an
# error) or skipped (no connection to the sidecar).
PROPOSER_CALLS = Metric(
    "specserve_proposer_calls",
    "counter",
    (MODEL, "outcome"),
    "Engine steps that asked the sidecar for drafts, by outcome (answered, missed, skipped).",
)

# --- sidecar ----------------------------------------------------------------------------------------
SIDECAR_POLICY_INFO = Metric(
    "specserve_sidecar_policy_info",
    "gauge",
    (DRAFTER, "mode", "policy_version", "drafter_status"),
    "The policy in force (value 1); drafter_status is the status of its drafter (failed: it drafts nothing).",
)
SIDECAR_K = Metric("specserve_sidecar_k", "gauge", (BUCKET,), "Speculative tokens in force per bucket.")
SIDECAR_SWITCHES = Metric(
    "specserve_sidecar_switches", "counter", ("kind", "result"), "Policy changes applied or refused."
)
SIDECAR_DRAFT_SECONDS = Metric(
    "specserve_sidecar_draft_seconds",
    "histogram",
    (DRAFTER,),
    "Time the sidecar took to answer a draft call.",
)
SIDECAR_DRAFTER_ERRORS = Metric(
    "specserve_sidecar_drafter_errors",
    "counter",
    (DRAFTER,),
    "Draft calls on which the drafter raised (that step got no drafts).",
)
SIDECAR_SHADOW_PROPOSED = Metric(
    "specserve_sidecar_shadow_proposed",
    "counter",
    (DRAFTER, POSITION),
    "Shadow drafts (by a loaded drafter not in force, scored against the engine's next tokens) with a "
    "token at this position (0-based).",
)
SIDECAR_SHADOW_ACCEPTED = Metric(
    "specserve_sidecar_shadow_accepted",
    "counter",
    (DRAFTER, POSITION),
    "Shadow drafts whose tokens up to and including this position (0-based) all matched the engine's.",
)
SIDECAR_SHADOW_ROWS = Metric(
    "specserve_sidecar_shadow_rows",
    "counter",
    (DRAFTER,),
    "Rows a loaded drafter not in force shadow-drafted for and was scored on, those it had nothing to "
    "propose for included: shadow drafts at position 0 over these is its proposal rate.",
)

# --- operator ---------------------------------------------------------------------------------------
OPERATOR_DECISIONS = Metric(
    "specserve_operator_decisions",
    "counter",
    ("namespace", "name", "action"),
    "Policy decisions taken by the tuner.",
)
OPERATOR_TICK_SECONDS = Metric(
    "specserve_operator_tick_seconds", "histogram", (), "Duration of one tuner evaluation tick."
)
# What the tuner recommends (speculation.mode advise) or puts in force (auto), next to the sidecars'
# specserve_sidecar_k: the K per bucket, and its predicted goodput relative to no speculation.
OPERATOR_RECOMMENDED_K = Metric(
    "specserve_operator_recommended_k",
    "gauge",
    ("namespace", "name", "mode", DRAFTER, BUCKET),
    "K the tuner recommends per bucket (advise mode) or puts in force (auto).",
)
OPERATOR_PREDICTED_GAIN = Metric(
    "specserve_operator_predicted_gain",
    "gauge",
    ("namespace", "name", "mode", DRAFTER),
    "Predicted goodput of the recommended policy relative to no speculation.",
)

SPECSERVE_METRICS: tuple[Metric, ...] = (
    ENGINE_STEPS,
    ENGINE_STEP_SECONDS,
    ENGINE_GENERATED_TOKENS,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_TOKENS_PER_POSITION,
    SPEC_DRAFT_TOKENS_PER_POSITION,
    PROPOSER_CALLS,
    SIDECAR_POLICY_INFO,
    SIDECAR_K,
    SIDECAR_SWITCHES,
    SIDECAR_DRAFT_SECONDS,
    SIDECAR_DRAFTER_ERRORS,
    SIDECAR_SHADOW_PROPOSED,
    SIDECAR_SHADOW_ACCEPTED,
    SIDECAR_SHADOW_ROWS,
    OPERATOR_DECISIONS,
    OPERATOR_TICK_SECONDS,
    OPERATOR_RECOMMENDED_K,
    OPERATOR_PREDICTED_GAIN,
)

# --- series exported by others that specserve reads ------------------------------------------------
# vLLM's own counters: the fallback when the stat-logger plugin is absent (no buckets).
VLLM_SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_TPOT_SECONDS = "vllm:request_time_per_output_token_seconds"
VLLM_INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"

EXTERNAL_SERIES: tuple[str, ...] = (
    VLLM_SPEC_DRAFTS,
    VLLM_SPEC_DRAFT_TOKENS,
    VLLM_SPEC_ACCEPTED_TOKENS,
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
    f"{VLLM_TPOT_SECONDS}_bucket",
    f"{VLLM_TPOT_SECONDS}_sum",
    f"{VLLM_TPOT_SECONDS}_count",
    f"{VLLM_INTER_TOKEN_LATENCY_SECONDS}_bucket",
    VLLM_GENERATION_TOKENS,
    VLLM_KV_CACHE_USAGE,
    DCGM_GPU_UTIL,
    "up",
)

# --- recording rules (shipped with the chart; names read by the tuner and the dashboards) -----
RULE_MAL = "specserve:mal:rate5m"
RULE_ACCEPTANCE_RATE = "specserve:acceptance_rate:rate5m"
RULE_ACCEPTANCE_PER_POSITION = "specserve:acceptance_per_position:rate5m"
RULE_TOKENS_PER_ENGINE_SECOND = "specserve:tokens_per_engine_second:rate5m"
RULE_STEP_SECONDS = "specserve:step_seconds:rate5m"
RECORDING_RULES: tuple[str, ...] = (
    RULE_MAL,
    RULE_ACCEPTANCE_RATE,
    RULE_ACCEPTANCE_PER_POSITION,
    RULE_TOKENS_PER_ENGINE_SECOND,
    RULE_STEP_SECONDS,
)


def known_series() -> frozenset[str]:
    """Every series name a dashboard or alert may query."""
    own = {s for m in SPECSERVE_METRICS for s in m.series}
    return frozenset(own | set(EXTERNAL_SERIES) | set(RECORDING_RULES))


# The tuner's input validation (operator/specserve_operator/tuner/observations.py, build_snapshot).
OPERATOR_DROPPED_ROWS = Metric(
    "specserve_operator_dropped_rows",
    "counter",
    ("reason",),
    "Prometheus rows (or a bucket's folded counters) the tuner rejected as invalid, by reason.",
)
SPECSERVE_METRICS += (OPERATOR_DROPPED_ROWS,)
