"""The engine container's command line: `vllm serve` arguments for a model and its drafter.

The operator renders pods from `build_engine_args`, the local fleet and the tests start engines with it,
so every engine runs with the same plugins (docs/engine-pod.md#what-runs-inside-vllm):

- `--scheduler-cls` = specserve's live-policy scheduler: it re-reads `policy.json` in the runtime dir and
  rebuilds vLLM's dynamic-SD table (K per batch size, 0 = off) between two steps, with no restart;
- `--worker-cls` = vLLM's worker whose model runner runs a K = 0 step as a plain step (no draft work,
  nothing verified) and gives each step's K to every drafter, the sidecar's proposer included
  (vllm_plugins/plain_step.py); only engines with a drafter;
- `--distributed-executor-backend` = vLLM's multiprocess executor that skips the per-step draft round
  trip to the worker after steps with K = 0 (plain_step.py); only engines with a drafter whose worker runs
  in its own process (vLLM's CPU backend, or tensor parallelism), where vLLM itself would pick that
  executor: a single-GPU engine keeps vLLM's in-process executor, where the call costs nothing;
- `--enable-logging-iteration-details` gives the stat-logger plugin the exact composition of each step
  (its batch size); `--disable-log-stats` stops vLLM's own per-interval log lines (its Prometheus
  metrics stay);
- `--additional-config {"specserve": {...}}` tells both plugins the engine's drafter name and where the
  runtime dir is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.policy_file import PodPolicy

# CRD method name -> vLLM's speculative method, for drafters that vLLM runs itself (placement colocated).
COLOCATED_METHODS: dict[str, str] = {
    "eagle3": "eagle3",
    "eagle": "eagle",
    "medusa": "medusa",
    "mtp": "mtp",
    "draftModel": "draft_model",
    "ngram": "ngram",
    "suffix": "suffix",
}
# EAGLE-style heads vLLM drafts in parallel (P-EAGLE: one forward pass for all K tokens) on request.
PARALLEL_DRAFTING_METHODS = frozenset({"eagle3", "eagle"})
# Methods that need a checkpoint (`source`); mtp reuses the target's own layers when none is given.
SOURCE_REQUIRED = frozenset({"eagle3", "eagle", "medusa", "draftModel"})
SIDECAR_PROPOSER = "specserve_engine.vllm_plugins.proposer.SidecarProposer"
LIVE_POLICY_SCHEDULER = "specserve_engine.vllm_plugins.live_policy.LivePolicyScheduler"
PLAIN_STEP_WORKER = "specserve_engine.vllm_plugins.plain_step.PlainStepWorker"
PLAIN_STEP_EXECUTOR = "specserve_engine.vllm_plugins.plain_step.PlainStepExecutor"
# Key of specserve's block inside vLLM's --additional-config; read back by the plugins.
ADDITIONAL_CONFIG_KEY = "specserve"
# n-gram prompt lookup window (vLLM defaults both ends to 5, which misses short repeats).
NGRAM_LOOKUP_MIN = 2
NGRAM_LOOKUP_MAX = 5


def speculative_config(
    drafter: SidecarDrafter | None, bucket_bounds: Sequence[int], max_num_seqs: int
) -> dict | None:
    """vLLM's --speculative-config for a drafter (None = no speculation).

    Every drafter gets K = maxSpeculativeTokens and an initial per-batch-size schedule (K everywhere), so
    the engine starts in dynamic-SD mode and the live-policy scheduler can change the table later.
    Colocated drafters run as their vLLM method; sidecar-hosted drafters (`sidecar`, `separateGpu`) all go
    through one `custom_class` proposer that asks the sidecar for drafts.
    """
    if drafter is None:
        return None
    if drafter.parallel_drafting and (
        drafter.method not in PARALLEL_DRAFTING_METHODS or drafter.placement != "colocated"
    ):
        raise ValueError(
            f"drafters[{drafter.name}].parallelDrafting: only for colocated "
            f"{', '.join(sorted(PARALLEL_DRAFTING_METHODS))} drafters"
        )
    k = drafter.max_speculative_tokens
    if max_num_seqs < 1:
        raise ValueError(f"maxNumSeqs: must be at least 1, got {max_num_seqs}")
    full_k = PodPolicy(
        policy_version=0,
        drafter=drafter.name,
        mode="on",
        k_by_bucket={label: k for label in bucket_labels(bucket_bounds)},
        bucket_bounds=tuple(bucket_bounds),
    )
    table = [list(r) for r in full_k.schedule(max_num_seqs)]
    if drafter.placement != "colocated":
        return {
            "method": "custom_class",
            "model": SIDECAR_PROPOSER,
            "num_speculative_tokens": k,
            "num_speculative_tokens_per_batch_size": table,
        }
    method = COLOCATED_METHODS.get(drafter.method)
    if method is None:
        raise ValueError(
            f"drafters[{drafter.name}].method: {drafter.method!r} cannot run colocated inside vLLM "
            f"(colocated methods: {', '.join(sorted(COLOCATED_METHODS))}); use placement sidecar"
        )
    if drafter.method in SOURCE_REQUIRED and not drafter.source:
        raise ValueError(f"drafters[{drafter.name}].source: method {drafter.method} needs a checkpoint path")
    config: dict = {
        "method": method,
        "num_speculative_tokens": k,
        "num_speculative_tokens_per_batch_size": table,
    }
    if drafter.parallel_drafting:
        config["parallel_drafting"] = True
    if drafter.source and method not in ("ngram", "suffix"):
        config["model"] = drafter.source
    if method == "ngram":
        config["prompt_lookup_min"] = min(NGRAM_LOOKUP_MIN, k)
        config["prompt_lookup_max"] = NGRAM_LOOKUP_MAX
    return config


def build_engine_args(
    *,
    model: str,
    served_model_name: str,
    port: int,
    max_model_len: int,
    tensor_parallel_size: int,
    drafter: SidecarDrafter | None,
    bucket_bounds: Sequence[int],
    max_num_seqs: int,
    runtime_dir: str,
    extra_args: Sequence[str] = (),
    host: str = "0.0.0.0",
    cpu_backend: bool = False,
) -> list[str]:
    """The argv after `vllm serve`: the model, the drafter's speculative config and specserve's plugins.

    For sidecar-hosted drafters pass the one with the largest maxSpeculativeTokens: vLLM sizes its
    buffers for that K at start-up, and every sidecar drafter then proposes up to its own maximum.
    `extra_args` come last, so a user's flags (the resource's engine.extraArgs) win.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"model.tensorParallelSize: must be at least 1, got {tensor_parallel_size}")
    if max_model_len < 1:
        raise ValueError(f"model.maxModelLen: must be at least 1, got {max_model_len}")
    args = stock_engine_args(
        model=model,
        served_model_name=served_model_name,
        port=port,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=max_num_seqs,
        host=host,
    )
    args += [
        "--scheduler-cls",
        LIVE_POLICY_SCHEDULER,
        "--enable-logging-iteration-details",
        "--disable-log-stats",
        "--additional-config",
        json.dumps({ADDITIONAL_CONFIG_KEY: plugin_config(drafter, bucket_bounds, runtime_dir)}),
    ]
    spec = speculative_config(drafter, bucket_bounds, max_num_seqs)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec), "--worker-cls", PLAIN_STEP_WORKER]
        if cpu_backend or tensor_parallel_size > 1:  # where vLLM runs its workers in their own processes
            args += ["--distributed-executor-backend", PLAIN_STEP_EXECUTOR]
    return args + list(extra_args)


def stock_engine_args(
    *,
    model: str,
    served_model_name: str,
    port: int,
    max_model_len: int,
    tensor_parallel_size: int,
    max_num_seqs: int,
    extra_args: Sequence[str] = (),
    host: str = "0.0.0.0",
) -> list[str]:
    """The argv after `vllm serve` of the engine specserve is measured against: the same model and engine
    flags, none of specserve's (no scheduler, worker, logging or speculative flags). Start it with
    STOCK_ENGINE_ENV so that no installed vLLM plugin loads either."""
    return [
        model,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--max-num-seqs",
        str(max_num_seqs),
        *extra_args,
    ]


# vLLM loads every installed plugin unless VLLM_PLUGINS lists the allowed ones; an empty list allows none,
# so an engine in this environment runs as one where specserve is not installed.
STOCK_ENGINE_ENV = {"VLLM_PLUGINS": ""}


def plugin_config(drafter: SidecarDrafter | None, bucket_bounds: Sequence[int], runtime_dir: str) -> dict:
    """What the specserve plugins inside vLLM need to know (the `specserve` block of --additional-config).

    `drafter` is the name of the colocated drafter vLLM runs; None where the sidecar hosts the drafters
    (the policy file names the one in force).
    """
    colocated = drafter is not None and drafter.placement == "colocated"
    return {
        "drafter": drafter.name if colocated else None,
        "runtimeDir": runtime_dir,
        "bucketBounds": list(bucket_bounds),
    }
