"""The status a tick writes (pure): activeDrafter, kByBucket, cliffBatchSize, fleet and per-pod MAL,
lastDecision, recommendation, and the conditions MetricsAvailable, SpeculationHealthy, PoliciesApplied and
GpuKnown.

In advise mode what is in force (activeDrafter, kByBucket, policyVersion) stays as it was: the decision
goes to `recommendation` only, and PoliciesApplied says why nothing was pushed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from specserve_operator import status as resource_status
from specserve_operator.tuner import core
from specserve_operator.tuner.loop import ResourceTick

METRICS_AVAILABLE = "MetricsAvailable"
SPECULATION_HEALTHY = "SpeculationHealthy"
POLICIES_APPLIED = "PoliciesApplied"
GPU_KNOWN = "GpuKnown"


def _round(x: float | None, digits: int = 3) -> float | None:
    # Observations are validated (observations.build_snapshot); a non-finite number would still make the
    # whole patch invalid JSON for the API server, so none is ever written.
    return None if x is None or not math.isfinite(x) else round(x, digits)


def status_patch(
    tick: ResourceTick, view: core.ResourceView, old_status: Mapping[str, Any] | None, now: datetime | None
) -> dict[str, Any]:
    """The status fields to merge-patch after one tick. Where metrics were unavailable only the
    condition changes: the policy in force stays, and so does what status says about it."""
    old = old_status or {}
    if tick.metrics_error is not None:
        cond = resource_status.condition(
            METRICS_AVAILABLE, False, tick.metrics_error.reason, str(tick.metrics_error)[:1000]
        )
        return {"conditions": resource_status.merge_conditions(old.get("conditions"), [cond], now)}
    d = tick.decision
    assert d is not None
    conditions = []
    if d.action == "noData":
        reason = core.METRICS_MISSING if core.METRICS_MISSING in d.warnings else core.PARTIAL_DATA
        conditions.append(resource_status.condition(METRICS_AVAILABLE, False, reason, d.reason[:1000]))
    elif core.INVALID_METRICS in d.warnings:
        message = d.warnings[core.INVALID_METRICS][:1000]
        conditions.append(resource_status.condition(METRICS_AVAILABLE, False, core.INVALID_METRICS, message))
    else:
        conditions.append(
            resource_status.condition(METRICS_AVAILABLE, True, "Read", f"{len(view.pods)} pods")
        )
    floor = view.spec.speculation.mal_floor
    if core.DRAFTER_ERRORS in d.warnings:
        conditions.append(
            resource_status.condition(
                SPECULATION_HEALTHY, False, core.DRAFTER_ERRORS, d.warnings[core.DRAFTER_ERRORS][:1000]
            )
        )
    elif d.mean_accepted_length is None:
        conditions.append(
            resource_status.condition(SPECULATION_HEALTHY, "Unknown", "NoDrafts", "no drafts in the window")
        )
    elif d.mean_accepted_length >= floor:
        conditions.append(
            resource_status.condition(
                SPECULATION_HEALTHY, True, "MalAtOrAboveFloor", f"MAL {d.mean_accepted_length:.2f}"
            )
        )
    else:
        conditions.append(
            resource_status.condition(
                SPECULATION_HEALTHY,
                False,
                "MalBelowFloor",
                f"MAL {d.mean_accepted_length:.2f} < malFloor {floor:g}",
            )
        )
    if tick.advice:
        conditions.append(
            resource_status.condition(
                POLICIES_APPLIED,
                False,
                "AdviseOnly",
                "speculation.mode advise: the recommendation is not pushed (status.recommendation)",
            )
        )
    elif tick.unreachable:
        pods = "; ".join(f"{p}: {e}" for p, e in sorted(tick.unreachable.items()))
        conditions.append(
            resource_status.condition(POLICIES_APPLIED, False, "SidecarUnreachable", pods[:1000])
        )
    else:
        conditions.append(
            resource_status.condition(POLICIES_APPLIED, True, "Applied", f"policy version {d.policy_version}")
        )
    # GpuKnown appears with an unknown GPU, and stays (True) once the spec names a known one.
    if core.UNKNOWN_GPU in d.warnings:
        conditions.append(
            resource_status.condition(GPU_KNOWN, False, core.UNKNOWN_GPU, d.warnings[core.UNKNOWN_GPU][:1000])
        )
    elif any(c.get("type") == GPU_KNOWN for c in old.get("conditions") or ()):
        conditions.append(resource_status.condition(GPU_KNOWN, True, "InCostModel", view.gpu_product))
    bounds = view.spec.speculation.batch_buckets
    pods = []
    for name in view.pods:
        target = d.pods.get(name)
        batch = d.pod_batch.get(name)
        pods.append(
            {
                k: v
                for k, v in {
                    "name": name,
                    "drafter": d.pod_drafter.get(name)
                    or (target.drafter if target and not tick.advice else None),
                    "speculating": None
                    if name in tick.unreachable or target is None or tick.advice
                    else core.speculating(target, batch, bounds),
                    "batchSize": _round(batch, 2),
                    "mal": _round(d.pod_mal.get(name)),
                    "policyVersion": tick.reported_versions.get(name),
                }.items()
                if v is not None
            }
        )
    fleet = {
        "mal": {label: mal for label, mal in d.fleet_mal.items() if math.isfinite(mal)},
        "meanAcceptedLength": _round(d.mean_accepted_length),
        "acceptanceRate": _round(d.acceptance_rate),
        "gpuUtilization": _round(d.gpu_utilization),
    }
    mode = view.spec.speculation.mode
    recommendation = {
        "mode": mode,
        "drafter": d.drafter,
        "kByBucket": d.k_by_bucket,
        "cliffBatchSize": d.cliff,
        "predictedGain": _round(tick.predicted_gain),
        "action": d.action,
        "reason": d.reason[:1024],
        "time": resource_status.now_rfc3339(now),
    }
    patch: dict[str, Any] = {
        "fleet": {k: v for k, v in fleet.items() if v is not None},
        "pods": pods,
        "recommendation": {k: v for k, v in recommendation.items() if v is not None},
        "conditions": resource_status.merge_conditions(old.get("conditions"), conditions, now),
    }
    if not tick.advice:
        patch |= {
            "activeDrafter": d.drafter,
            "kByBucket": d.k_by_bucket,
            "cliffBatchSize": d.cliff,
            "policyVersion": d.policy_version,
        }
    if d.changed or d.action == "noData" or not old.get("lastDecision"):
        action = f"advise:{d.action}" if tick.advice else d.action
        patch["lastDecision"] = {
            "time": resource_status.now_rfc3339(now),
            "action": action,
            "reason": d.reason[:1024],
        }
    return patch
