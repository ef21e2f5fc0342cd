"""`specserve operator` and `specserve crd` argument handling (kopf itself is replaced by a recorder)."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from specserve_operator import cli, runner


@pytest.fixture()
def kopf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    async def record(**kwargs: Any) -> None:
        calls.append(kwargs)

    monkeypatch.setattr(kopf, "operator", record)
    return calls


def test_defaults_are_cluster_wide_with_peering_and_a_liveness_endpoint(
    kopf_calls: list[dict[str, Any]],
) -> None:
    assert cli.main(["operator"]) == 0
    [call] = kopf_calls
    assert call["clusterwide"] is True and call["namespaces"] == []
    assert call["standalone"] is None and call["peering_name"] is None
    assert 1 <= call["priority"] <= 32767
    assert call["liveness_endpoint"] == runner.DEFAULT_LIVENESS


def test_namespaces_priority_and_named_peering(kopf_calls: list[dict[str, Any]]) -> None:
    cli.main(
        ["operator", "-n", "a", "-n", "b", "--priority", "7", "--peering", "specserve", "--liveness", ""]
    )
    [call] = kopf_calls
    assert call["clusterwide"] is False and call["namespaces"] == ["a", "b"]
    assert (call["priority"], call["peering_name"], call["liveness_endpoint"]) == (7, "specserve", None)


def test_standalone_ignores_peering(kopf_calls: list[dict[str, Any]]) -> None:
    cli.main(["operator", "--standalone", "--peering", "specserve"])
    [call] = kopf_calls
    assert call["standalone"] is True and call["peering_name"] is None
