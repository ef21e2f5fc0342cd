"""`specserve status` and the kubectl plugin against the real operator on kmock, and the renderings.

The controller's side of the view (recommended vs in-force K, pods' policy versions, decisions) is
checked where the controller runs against Prometheus: tests/tuner/test_operator_timer.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import yaml
from rich.console import Console

from specserve_operator.overview import decisions_from_events, render_plain, render_rich, summarize
from specserve_testing.kmock_emulator import NAMESPACE, RVEmulator

BIN = Path(sys.executable).parent
RESOURCE = {
    "apiVersion": "specserve.io/v1alpha1",
    "kind": "SpeculativeServing",
    "metadata": {"name": "llm", "namespace": NAMESPACE},
    "spec": {
        "model": {"name": "m", "source": "hf://org/m"},
        "engine": {"image": "engine:1"},
        "drafters": [{"name": "ngram", "method": "ngram"}],
    },
}
# A status as the controller writes it (tuner/report.py), with one pod behind on its policy.
STATUS = {
    "phase": "Ready",
    "readyReplicas": 2,
    "activeDrafter": "ngram",
    "kByBucket": {"1": 4, "2": 3, "+Inf": 0},
    "cliffBatchSize": 4,
    "policyVersion": 7,
    "fleet": {"mal": {"1": 2.5}, "meanAcceptedLength": 2.4, "acceptanceRate": 0.6},
    "pods": [
        {"name": "llm-a", "drafter": "ngram", "policyVersion": 7, "speculating": True, "mal": 2.4},
        {"name": "llm-b", "drafter": "ngram", "policyVersion": 6},
    ],
    "recommendation": {
        "mode": "advise",
        "drafter": "ngram",
        "kByBucket": {"1": 4, "2": 2, "+Inf": 0},
        "predictedGain": 1.37,
        "action": "setK",
        "reason": "bucket 2 k 3->2",
        "time": "2025-01-01T00:00:00Z",
    },
    "conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "2/2 ready"}],
}


async def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_status_of_a_deployed_resource_from_specserve_and_the_kubectl_plugin(
    kube_emulator: RVEmulator, operator_runner
) -> None:
    async with operator_runner():
        await kube_emulator.post(
            f"/apis/specserve.io/v1alpha1/namespaces/{NAMESPACE}/speculativeservings", json=RESOURCE
        )

        deadline = asyncio.get_running_loop().time() + 30
        while True:  # until the deploy handler's Deployed condition shows
            code, out, err = await _run(
                str(BIN / "specserve"), "status", "llm", "-n", NAMESPACE, "-o", "json"
            )
            assert code == 0, err
            shown = json.loads(out)
            if any(c["type"] == "Deployed" and c["status"] == "True" for c in shown["conditions"]):
                break
            assert asyncio.get_running_loop().time() < deadline, shown
            await asyncio.sleep(0.5)
        code, plain, _ = await _run(str(BIN / "kubectl-specserve"), "status", "-n", NAMESPACE)
        _, as_yaml, _ = await _run(str(BIN / "kubectl-specserve"), "status", "-n", NAMESPACE, "-o", "yaml")
        missing, _, err = await _run(str(BIN / "specserve"), "status", "nope", "-n", NAMESPACE)
    assert shown["name"] == "llm" and shown["namespace"] == NAMESPACE and shown["phase"] == "Deploying"
    assert shown["mode"] == "auto" and shown["drafter"] is None  # the controller has not decided yet
    assert code == 0 and plain.startswith(f"{NAMESPACE}/llm  phase Deploying  mode auto")
    assert "Deployed" in plain and "conditions:" in plain  # plain text: no terminal attached
    assert [s["name"] for s in yaml.safe_load(as_yaml)] == ["llm"]
    assert missing == 1 and "not found" in err


def test_summary_compares_in_force_with_recommended_and_pods_with_the_policy() -> None:
    events = [
        {
            "involvedObject": {"kind": "SpeculativeServing", "name": "llm", "namespace": NAMESPACE},
            "reason": reason,
            "message": message,
            "lastTimestamp": stamp,
        }
        for reason, message, stamp in (
            ("AdviseSetK", "recommend drafter ngram", "2025-01-01T00:00:02Z"),
            ("Deployed", "applied Deployment", "2025-01-01T00:00:00Z"),
            ("PolicyEnable", "enable: bucket 1 on", "2025-01-01T00:00:01Z"),
        )
    ] + [{"involvedObject": {"kind": "SpeculativeServing", "name": "other"}, "reason": "PolicySetK"}]
    decisions = decisions_from_events(events, "llm")
    assert [d["action"] for d in decisions] == ["PolicyEnable", "AdviseSetK"]
    s = summarize({**RESOURCE, "status": STATUS}, decisions)
    assert s["buckets"] == [
        {"bucket": "1", "k": 4, "recommendedK": 4, "mal": 2.5},
        {"bucket": "2", "k": 3, "recommendedK": 2, "mal": None},
        {"bucket": "+Inf", "k": 0, "recommendedK": 0, "mal": None},
    ]
    assert [(p["name"], p["matches"]) for p in s["pods"]] == [("llm-a", True), ("llm-b", False)]
    assert s["predictedGain"] == 1.37 and s["cliffBatchSize"] == 4 and s["drafter"] == "ngram"
    plain = render_plain([s])
    assert "predicted gain 1.37x  cliff at batch 4" in plain
    assert "llm-b  ngram    6       NO" in plain
    console = Console(record=True, width=160, force_terminal=True)
    render_rich([s], console)
    text = console.export_text()
    assert "RECOMMENDED" in text and "llm-b" in text and "PolicyEnable" in text


def test_without_events_the_last_decision_of_the_status_is_shown() -> None:
    status = {**STATUS, "lastDecision": {"time": "t", "action": "hold", "reason": "nothing new"}}
    s = summarize({**RESOURCE, "status": status})
    assert s["decisions"] == [{"time": "t", "action": "hold", "reason": "nothing new"}]
    assert render_plain([]) == "no SpeculativeServing found\n"
