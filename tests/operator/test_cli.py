"""`specserve operator` and `specserve crd` argument handling (kopf itself is replaced by a recorder)."""

from __future__ import annotations

import urllib.request
from typing import Any

import kopf
import prometheus_client
import pytest

from specserve_engine import metric_names
from specserve_engine.launch import free_port
from specserve_operator import cli, runner


@pytest.fixture()
def kopf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(prometheus_client, "start_http_server", lambda port: calls.append({"metrics": port}))

    async def record(**kwargs: Any) -> None:
        calls.append(kwargs)

    monkeypatch.setattr(kopf, "operator", record)
    return calls


def test_defaults_are_cluster_wide_with_peering_and_a_liveness_endpoint(
    kopf_calls: list[dict[str, Any]],
) -> None:
    assert cli.main(["operator"]) == 0
    metrics, call = kopf_calls
    assert metrics == {"metrics": runner.DEFAULT_METRICS_PORT}
    assert call["clusterwide"] is True and call["namespaces"] == []
    assert call["standalone"] is None and call["peering_name"] is None
    assert 1 <= call["priority"] <= 32767
    assert call["liveness_endpoint"] == runner.DEFAULT_LIVENESS


def test_namespaces_priority_and_named_peering(kopf_calls: list[dict[str, Any]]) -> None:
    cli.main(
        [
            "operator",
            "-n",
            "a",
            "-n",
            "b",
            "--priority",
            "7",
            "--peering",
            "specserve",
            "--liveness",
            "",
            "--metrics-port",
            "0",
        ]
    )
    [call] = kopf_calls
    assert call["clusterwide"] is False and call["namespaces"] == ["a", "b"]
    assert (call["priority"], call["peering_name"], call["liveness_endpoint"]) == (7, "specserve", None)


def test_standalone_ignores_peering(kopf_calls: list[dict[str, Any]]) -> None:
    cli.main(["operator", "--standalone", "--peering", "specserve", "--metrics-port", "0"])
    [call] = kopf_calls
    assert call["standalone"] is True and call["peering_name"] is None


def test_the_operator_serves_its_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_kopf(**kwargs: Any) -> None:
        return None

    monkeypatch.setattr(kopf, "operator", no_kopf)
    port = free_port()
    assert cli.main(["operator", "--metrics-port", str(port)]) == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for metric in (metric_names.OPERATOR_DECISIONS, metric_names.OPERATOR_TICK_SECONDS):
        assert f"# HELP {metric.name}" in text
