"""End to end on a real cluster (e.g. kind): apply the CRD, run the operator, apply examples, check the
children and the rejections. Runs only where KUBECONFIG is set; the pods need GPUs to run, so only the
objects are checked, not the pods.

    kind create cluster && KUBECONFIG=~/.kube/config .venv/bin/pytest tests/e2e -m e2e
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
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

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: set KUBECONFIG"),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl"),
]

REPO = Path(__file__).resolve().parents[2]


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
