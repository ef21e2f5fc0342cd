"""Pure helpers for the resource's status: Kubernetes-style conditions and the phase.

Used by the deploy handlers (Deployed, Ready, Invalid) and by the tuner (MetricsAvailable,
SpeculationHealthy, ...): any condition type works the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

# Condition types written by the deploy handlers.
DEPLOYED = "Deployed"
READY = "Ready"
INVALID = "Invalid"
# True while a same-named object the resource does not own blocks one of its children (nothing is written).
CONFLICT = "Conflict"


def now_rfc3339(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: str, status: bool | str, reason: str, message: str = "", *, generation: int | None = None
) -> dict[str, Any]:
    """A condition without its transition time (merge_conditions stamps it)."""
    text = status if isinstance(status, str) else ("True" if status else "False")
    if text not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, not {text!r}")
    out: dict[str, Any] = {"type": type_, "status": text, "reason": reason, "message": message}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(
    old: Iterable[Mapping[str, Any]] | None, new: Iterable[Mapping[str, Any]], now: datetime | None = None
) -> list[dict[str, Any]]:
    """Old conditions updated by new ones, by type. `lastTransitionTime` moves only when a condition's
    status changes; reason, message and observedGeneration always take the new values. Types not in
    `new` are kept as they were; the result is sorted by type, so equal inputs give equal output."""
    stamp = now_rfc3339(now)
    merged: dict[str, dict[str, Any]] = {c["type"]: dict(c) for c in (old or [])}
    for cond in new:
        previous = merged.get(cond["type"])
        updated = dict(cond)
        if previous is not None and previous.get("status") == cond["status"]:
            updated["lastTransitionTime"] = previous.get("lastTransitionTime", stamp)
        else:
            updated["lastTransitionTime"] = stamp
        merged[cond["type"]] = updated
    return [merged[t] for t in sorted(merged)]


def get_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in (conditions or []) if c.get("type") == type_), None)


def is_true(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == "True"


def deployment_phase(desired_replicas: int, deployment_status: Mapping[str, Any] | None) -> str:
    """Phase from the Deployment's status: Deploying until every wanted pod is updated and ready, Ready
    then, Degraded when some but not all are ready after a rollout has finished."""
    status = deployment_status or {}
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    if desired_replicas == 0:
        return "Ready"
    if ready >= desired_replicas and updated >= desired_replicas:
        return "Ready"
    if updated >= desired_replicas and 0 < ready < desired_replicas:
        return "Degraded"
    return "Deploying"


def deployment_conditions(
    desired_replicas: int, deployment_status: Mapping[str, Any] | None, generation: int | None
) -> list[dict[str, Any]]:
    """Ready (and its reason) from the Deployment's status."""
    status = deployment_status or {}
    ready = int(status.get("readyReplicas") or 0)
    phase = deployment_phase(desired_replicas, status)
    if phase == "Ready":
        return [
            condition(
                READY, True, "AllReplicasReady", f"{ready}/{desired_replicas} ready", generation=generation
            )
        ]
    reason = "ReplicasUnavailable" if phase == "Degraded" else "RollingOut"
    return [condition(READY, False, reason, f"{ready}/{desired_replicas} ready", generation=generation)]
