"""Pure status helpers: conditions merged by type with transition times, and the phase."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from specserve_operator import status

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)


def test_new_condition_is_stamped() -> None:
    merged = status.merge_conditions(
        None, [status.condition("Deployed", True, "Applied", "ok", generation=3)], T0
    )
    assert merged == [
        {
            "type": "Deployed",
            "status": "True",
            "reason": "Applied",
            "message": "ok",
            "observedGeneration": 3,
            "lastTransitionTime": "2026-01-01T12:00:00Z",
        }
    ]


def test_transition_time_moves_only_when_status_changes() -> None:
    first = status.merge_conditions(None, [status.condition("Ready", False, "RollingOut", "0/2")], T0)
    same = status.merge_conditions(first, [status.condition("Ready", False, "RollingOut", "1/2")], T1)
    assert same[0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert same[0]["message"] == "1/2"
    flipped = status.merge_conditions(same, [status.condition("Ready", True, "AllReplicasReady", "2/2")], T1)
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_other_types_are_kept_and_order_is_stable() -> None:
    old = status.merge_conditions(None, [status.condition("MetricsAvailable", True, "Scraped")], T0)
    merged = status.merge_conditions(old, [status.condition("Deployed", True, "Applied")], T1)
    assert [c["type"] for c in merged] == ["Deployed", "MetricsAvailable"]
    assert status.is_true(merged, "MetricsAvailable") and not status.is_true(merged, "Invalid")
    assert status.get_condition(merged, "Deployed")["reason"] == "Applied"


def test_condition_status_must_be_a_kubernetes_value() -> None:
    assert status.condition("X", "Unknown", "NoData")["status"] == "Unknown"
    with pytest.raises(ValueError, match="True, False or Unknown"):
        status.condition("X", "yes", "Bad")


@pytest.mark.parametrize(
    ("desired", "observed", "phase", "ready"),
    [
        (3, None, "Deploying", "False"),
        (3, {"replicas": 3, "updatedReplicas": 1, "readyReplicas": 3}, "Deploying", "False"),
        (3, {"replicas": 3, "updatedReplicas": 3, "readyReplicas": 3}, "Ready", "True"),
        (3, {"replicas": 3, "updatedReplicas": 3, "readyReplicas": 1}, "Degraded", "False"),
        (3, {"replicas": 3, "updatedReplicas": 3, "readyReplicas": 0}, "Deploying", "False"),
        (0, {}, "Ready", "True"),
    ],
)
def test_phase_and_ready_from_the_deployment(
    desired: int, observed: dict | None, phase: str, ready: str
) -> None:
    assert status.deployment_phase(desired, observed) == phase
    [condition] = status.deployment_conditions(desired, observed, generation=2)
    assert (condition["type"], condition["status"], condition["observedGeneration"]) == ("Ready", ready, 2)
