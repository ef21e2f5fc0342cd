"""End to end on a real cluster (e.g. kind): apply the CRD, run the operator, apply examples, check the
children and the rejections. Runs only where KUBECONFIG is set. The GPU examples' pods cannot run on a
laptop, so for them only the objects are checked; where the CPU engine image (the Dockerfile's
engine-cpu target, SPECSERVE_E2E_ENGINE_IMAGE) is on the nodes, the laptop example's pods run too and
serve a completion (docs/quickstart-kind.md).

    kind create cluster && KUBECONFIG=~/.kube/config .venv/bin/pytest tests/e2e -m e2e
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from specserve_operator import runner
from specserve_operator.api import crd
from specserve_operator.render import children as render

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: set KUBECONFIG"),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl"),
]

REPO = Path(__file__).resolve().parents[2]
ENGINE_CPU_IMAGE = os.environ.get("SPECSERVE_E2E_ENGINE_IMAGE", "specserve-engine-cpu:0.1.0")
# A CPU engine loads the tiny models in a minute or two; a busy laptop may take longer.
POD_READY_TIMEOUT_S = 900


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, check=check, timeout=120
    )


def get(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    result = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def wait_for(check, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"not within {timeout}s")


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    kubectl("apply", "--server-side", "-f", str(REPO / "crds" / crd.CRD_FILE_NAME))
    kubectl("wait", "--for=condition=Established", f"crd/{crd.CRD_NAME}", "--timeout=60s")
    name = f"specserve-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(namespace: str) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(
            runner.run_operator(namespaces=[namespace], standalone=True, stop_flag=stop)
        ),
        daemon=True,
    )
    thread.start()
    yield
    stop.set()
    thread.join(30)


def apply_example(file: str, namespace: str) -> dict[str, Any]:
    resource = yaml.safe_load((REPO / "examples" / file).read_text())
    resource["metadata"]["namespace"] = namespace
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(resource))
    return resource


def test_example_gets_its_children(namespace: str, operator: None) -> None:
    resource = apply_example("llama-70b-eagle3-h200.yaml", namespace)
    name = resource["metadata"]["name"]

    def deployed() -> dict[str, Any] | None:
        serving = get("speculativeserving", name, namespace)
        conditions = ((serving or {}).get("status") or {}).get("conditions") or []
        return serving if any(c["type"] == "Deployed" and c["status"] == "True" for c in conditions) else None

    serving = wait_for(deployed)
    uid = serving["metadata"]["uid"]
    for kind, child in [
        ("deployment", name),
        ("service", name),
        ("poddisruptionbudget", name),
        ("configmap", f"{name}-sidecar"),
        ("secret", f"{name}-control-token"),
    ]:
        obj = get(kind, child, namespace)
        assert obj is not None, f"{kind}/{child} missing"
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [uid]
    # the scale subresource works, so an HPA could drive it
    kubectl("scale", "speculativeserving", name, "-n", namespace, "--replicas=1")
    wait_for(lambda: (get("deployment", name, namespace) or {}).get("spec", {}).get("replicas") == 1)


def test_the_api_server_rejects_what_the_models_reject(namespace: str) -> None:
    resource = yaml.safe_load((REPO / "examples" / "llama-70b-eagle3-h200.yaml").read_text())
    resource["metadata"] = {"name": "bad", "namespace": namespace}
    resource["spec"]["drafters"][0]["placement"] = "separateGpu"
    result = kubectl("apply", "-f", "-", stdin=yaml.safe_dump(resource), check=False)
    assert result.returncode != 0
    assert "placement" in result.stderr


def image_on_nodes(image: str) -> bool:
    """Whether some node holds the image (`kind load docker-image` lists it under its full reference)."""
    wanted = {image, f"docker.io/library/{image}"}
    nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return any(
        wanted & set(entry.get("names", []))
        for node in nodes
        for entry in (node.get("status") or {}).get("images", [])
    )


def in_pod(namespace: str, name: str, code: str) -> str:
    """Run Python in the pod's sidecar container (the engine image has it) and return its output."""
    return kubectl(
        "exec", f"deploy/{name}", "-n", namespace, "-c", "sidecar", "--", "python3", "-c", code
    ).stdout


def test_the_cpu_engine_pods_run_and_serve_completions(namespace: str, operator: None) -> None:
    if not image_on_nodes(ENGINE_CPU_IMAGE):
        pytest.skip(f"{ENGINE_CPU_IMAGE} is on no node (docs/quickstart-kind.md builds and loads it)")
    resource = yaml.safe_load((REPO / "examples" / "kind-cpu.yaml").read_text())
    resource["metadata"]["namespace"] = namespace
    resource["spec"]["engine"]["image"] = ENGINE_CPU_IMAGE
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(resource))
    name = resource["metadata"]["name"]

    def ready() -> dict[str, Any] | None:
        serving = get("speculativeserving", name, namespace) or {}
        status = serving.get("status") or {}
        return serving if status.get("phase") == "Ready" and status.get("readyReplicas") == 1 else None

    wait_for(ready, timeout=POD_READY_TIMEOUT_S)
    completion = json.loads(
        in_pod(
            namespace,
            name,
            "import json, urllib.request as u; body = json.dumps({'model': 'tiny-target', "
            "'prompt': 'def add(a, b):', 'max_tokens': 16, 'temperature': 0}).encode(); "
            f"r = u.Request('http://127.0.0.1:{render.ENGINE_PORT}/v1/completions', body, "
            "{'Content-Type': 'application/json'}); print(u.urlopen(r, timeout=60).read().decode())",
        )
    )
    assert completion["choices"][0]["text"].strip()
    state = json.loads(
        in_pod(
            namespace,
            name,
            f"import urllib.request as u; t = open('{render.TOKEN_DIR}/{render.TOKEN_KEY}').read().strip(); "
            f"r = u.Request('http://127.0.0.1:{render.SIDECAR_PORT}/v1/state', "
            "headers={'Authorization': 'Bearer ' + t}); "
            "print(u.urlopen(r, timeout=10).read().decode())",
        )
    )
    assert state["drafter"] == "tiny-draft" and state["warm"]
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "specserve"), "status", name, "-n", namespace, "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(shown.stdout)["phase"] == "Ready"
