"""What the specserve plugins inside vLLM know about their pod: the `specserve` block of vLLM's
--additional-config (written by engine_args.build_engine_args)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve_engine.buckets import DEFAULT_BUCKETS
from specserve_engine.engine_args import ADDITIONAL_CONFIG_KEY
from specserve_engine.policy_file import PolicyReader, policy_path


@dataclass(frozen=True)
class SpecservePluginConfig:
    drafter: str | None  # the colocated drafter vLLM runs; None where the sidecar hosts the drafters
    runtime_dir: str | None  # None: the SPECSERVE_RUNTIME_DIR environment variable, or its default
    bucket_bounds: tuple[int, ...]

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> SpecservePluginConfig:
        extra = getattr(vllm_config, "additional_config", None) or {}
        block = extra.get(ADDITIONAL_CONFIG_KEY, {}) if isinstance(extra, dict) else {}
        return cls(
            drafter=block.get("drafter"),
            runtime_dir=block.get("runtimeDir"),
            bucket_bounds=tuple(int(b) for b in block.get("bucketBounds", DEFAULT_BUCKETS)),
        )

    def policy_reader(self) -> PolicyReader:
        return PolicyReader(policy_path(self.runtime_dir))
