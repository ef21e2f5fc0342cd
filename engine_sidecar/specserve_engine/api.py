"""The sidecar control API's wire models (docs/sidecar.md#control-api): the operator's only way into a pod.

The operator imports these models and `specserve_engine.client`; both sides validate with them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve_engine.buckets import INF

PodMode = Literal["on", "off"]
# available: configured and buildable, loaded (and warmed) when a policy first names it. failed: it could
# not be built or loaded, or raised on too many draft calls in a row (`error` says which); it drafts
# nothing until a new policy names it and it warms up again.
DrafterStatus = Literal["loaded", "loading", "failed", "available"]
# colocated: vLLM's own drafter inside the engine; sidecar: hosted by the sidecar on the engine's devices;
# separateGpu: hosted by the sidecar on a GPU of its own, NVLink-connected to the target's.
Placement = Literal["colocated", "sidecar", "separateGpu"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PolicyRequest(_Wire):
    """Body of `PUT /v1/policy`: the whole policy, versioned; applying the same version twice is a no-op."""

    policy_version: int = Field(alias="policyVersion", ge=0)
    drafter: str = Field(min_length=1, max_length=63)
    mode: PodMode = "on"
    k_by_bucket: dict[str, int] = Field(alias="kByBucket", default_factory=dict)

    def k_for_bucket(self, bucket: str) -> int:
        return 0 if self.mode == "off" else self.k_by_bucket.get(bucket, 0)


class DrafterState(_Wire):
    name: str
    method: str
    placement: Placement
    max_speculative_tokens: int = Field(alias="maxSpeculativeTokens")
    status: DrafterStatus
    error: str | None = None


class SidecarState(_Wire):
    """Body of `GET /v1/state` and of every successful `PUT /v1/policy`."""

    policy_version: int = Field(alias="policyVersion")
    drafter: str
    mode: PodMode
    k_by_bucket: dict[str, int] = Field(alias="kByBucket")
    drafters: list[DrafterState]
    pending_drafter: str | None = Field(alias="pendingDrafter", default=None)
    warm: bool
    engine_reachable: bool = Field(alias="engineReachable")


class ApiError(_Wire):
    """Body of every 4xx: `field` names what was wrong where one field was."""

    error: str
    field: str | None = None


def validate_k_table(k_by_bucket: dict[str, int], bucket_bounds: list[int], max_k: int) -> str | None:
    """Why a K table cannot be applied, or None when it can."""
    allowed = {str(b) for b in bucket_bounds} | {INF}
    for bucket, k in k_by_bucket.items():
        if bucket not in allowed:
            return f"kByBucket: unknown bucket {bucket!r} (allowed: {sorted(allowed, key=_bucket_order)})"
        if not 0 <= k <= max_k:
            return f"kByBucket[{bucket}]: K={k} is outside 0..{max_k} (the drafter's maxSpeculativeTokens)"
    return None


def _bucket_order(label: str) -> float:
    return float("inf") if label == INF else float(label)


class SidecarDrafter(_Wire):
    """One drafter as the sidecar sees it (rendered by the operator from the resource)."""

    name: str
    method: str
    source: str | None = None  # a local path in the pod (the operator resolves hf://, pvc://, ... to it)
    max_speculative_tokens: int = Field(alias="maxSpeculativeTokens", ge=1, le=16)
    placement: Placement
    # selfSpeculative only: how many of the target's first decoder layers draft (default: a quarter).
    layers: int | None = Field(default=None, ge=1)
    # Colocated eagle3/eagle only: vLLM's parallel drafting (P-EAGLE). Left out of the JSON when off, so
    # configs (and the pod hash) of every other drafter stay as they were.
    parallel_drafting: bool = Field(default=False, alias="parallelDrafting", exclude_if=lambda on: not on)


class SidecarConfig(_Wire):
    """The sidecar's start-up configuration: one JSON file, written by the operator (a ConfigMap) or by
    the local fleet."""

    model_name: str = Field(alias="modelName")
    model_path: str = Field(alias="modelPath")
    drafters: list[SidecarDrafter]
    engine_drafter: str | None = Field(alias="engineDrafter", default=None)  # the colocated one vLLM runs
    bucket_bounds: list[int] = Field(alias="bucketBounds")
    runtime_dir: str = Field(alias="runtimeDir")  # shared with the engine container (emptyDir)
    token_file: str | None = Field(alias="tokenFile", default=None)
    host: str = "0.0.0.0"
    port: int = 8081
    engine_url: str = Field(alias="engineUrl", default="http://127.0.0.1:8000")
    warmup_requests: int = Field(alias="warmupRequests", default=50, ge=0)
    initial_policy: PolicyRequest = Field(alias="initialPolicy")
    # Share of each engine connection's wall time the loaded drafters not in force may spend drafting in
    # the shadow (shadow.py); 0 turns shadow drafting off.
    shadow_share: float = Field(alias="shadowShare", default=0.05, ge=0.0, le=0.5, allow_inf_nan=False)
