"""Engine pods that survive a busy node and take only safe input (docs/engine-pod.md): CPU and memory
requests, a bounded /dev/shm, no service-account token, read-only roots with a writable /tmp where vLLM
writes (checked against vLLM's own defaults), readiness from the engine alone; and engine.extraArgs that
cannot set the operator's own flags (checked against vLLM's own parser and the CRD's CEL rule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import celpy
import pytest

from specserve_operator.api import crd
from specserve_operator.api.models import OWNED_ENGINE_FLAGS, owned_engine_flag, parse_spec
from specserve_operator.render import children as render
from specserve_operator.render.sources import CACHE_VOLUME


def _pod(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "llama", "source": "pvc://weights/llama", "tensorParallelSize": 2},
        "engine": {"image": "engine:1", "gpu": {"count": 2}},
        "drafters": [
            {"name": "ngram", "method": "ngram", "placement": "sidecar"},
            {
                "name": "draft",
                "method": "draftModel",
                "source": "pvc://weights/d",
                "placement": "separateGpu",
            },
        ],
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    deployment = render.build_deployment("demo", "ns", parse_spec(spec), render.RenderOptions())
    return deployment["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"]}


def _volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["volumes"]}


def _mount(container: dict[str, Any], path: str) -> dict[str, Any]:
    return next(m for m in container["volumeMounts"] if m["mountPath"] == path)


def test_every_serving_container_requests_cpu_and_memory_by_default() -> None:
    containers = _containers(_pod())
    assert containers["engine"]["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "2"},
        "limits": {"nvidia.com/gpu": "2"},  # no CPU limit (throttling costs latency), no OOM kill
    }
    assert containers["sidecar"]["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "1"},  # its separateGpu drafter
        "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"},
    }


def test_resources_and_shm_size_come_from_the_resource() -> None:
    pod = _pod(
        engine={
            "resources": {"requests": {"cpu": "16", "memory": "200Gi"}, "limits": {"memory": "300Gi"}},
            "shmSize": "32Gi",
        },
        sidecar={"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "2Gi"}}},
    )
    containers = _containers(pod)
    assert containers["engine"]["resources"] == {
        "requests": {"cpu": "16", "memory": "200Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "300Gi", "nvidia.com/gpu": "2"},
    }
    assert containers["sidecar"]["resources"] == {
        "requests": {"cpu": "1", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": "1"},
    }
    assert _volumes(pod)["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}


def test_a_cpu_engine_gets_cpu_and_memory_but_no_gpu() -> None:
    pod = _pod(engine={"gpu": {"count": 0}}, model={"tensorParallelSize": 1})
    assert _containers(pod)["engine"]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}


def test_every_memory_backed_or_scratch_volume_is_bounded() -> None:
    pod = _pod()
    for volume in pod["volumes"]:
        # (the hf:// and s3:// download cache holds whole models: sized by the node, not bounded here)
        if "emptyDir" in volume and volume["name"] != CACHE_VOLUME:
            assert volume["emptyDir"].get("sizeLimit"), volume
    assert _volumes(pod)["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_no_service_account_token_and_read_only_roots_with_a_writable_tmp() -> None:
    pod = _pod()
    assert pod["automountServiceAccountToken"] is False
    volumes = _volumes(pod)
    for name, container in _containers(pod).items():
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        tmp = _mount(container, render.TMP_DIR)
        assert "emptyDir" in volumes[tmp["name"]] and not tmp.get("readOnly"), name
        # HOME is /tmp: vLLM's, Triton's, torch's and Hugging Face's caches land in the writable volume
        assert {"name": "HOME", "value": render.TMP_DIR} in container["env"], name
        # every other writable mount is a volume of the pod's own (emptyDir), never the root filesystem
        for mount in container["volumeMounts"]:
            if not mount.get("readOnly"):
                volume = volumes[mount["name"]]
                assert "emptyDir" in volume or "configMap" in volume or "secret" in volume, mount


def test_the_pods_readiness_is_the_engines_alone() -> None:
    containers = _containers(_pod())
    assert containers["engine"]["readinessProbe"]["httpGet"] == {
        "path": "/health",
        "port": render.ENGINE_PORT,
    }
    sidecar = containers["sidecar"]
    # a sidecar down or warming leaves the pod serving; a hung one is restarted
    assert "readinessProbe" not in sidecar and "startupProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": render.SIDECAR_PORT}


def test_every_flag_the_operator_renders_is_an_owned_one() -> None:
    """OWNED_ENGINE_FLAGS covers what build_engine_args sets, so extraArgs cannot override any of it."""
    model = {"name": "m", "source": "pvc://w/m"}
    without = parse_spec({"model": model, "speculation": {"mode": "off"}})
    with_drafter = parse_spec({"model": model, "drafters": [{"name": "n", "method": "ngram"}]})
    args = render.engine_args(without) + render.engine_args(with_drafter)
    flags = {a for a in args if a.startswith("-")}
    assert flags and all(owned_engine_flag(f) == f for f in flags), flags - set(OWNED_ENGINE_FLAGS)


def _spellings(flag: str) -> list[str]:
    """Ways vLLM's parser takes a flag: as is, with a value, a JSON field, underscores, abbreviations."""
    out = [flag, f"{flag}=1", f"{flag}.key"]
    if flag.startswith("--"):
        out.append("--" + flag[2:].replace("-", "_"))
        out += [flag[:n] for n in range(3, len(flag))]
    return out


ALLOWED = [
    "--enable-prefix-caching",
    "--gpu-memory-utilization=0.92",
    "--max-num-batched-tokens",
    "8192",
    "--model-impl",
    "--disable-log-requests",
    "--api-server-count",
    "--enable-log-outputs",
    "--kv-cache-dtype=fp8",
    "-O3",
    "-pp",
    "-1",
    "--tokenizer=/models/pvc/weights/tok",
]


def _extra_args_rule() -> celpy.Runner:
    item = crd.open_api_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"][
        "items"
    ]
    (rule,) = item["x-kubernetes-validations"]
    env = celpy.Environment()
    return env.program(env.compile(rule["rule"]))


def test_the_crd_rule_and_the_models_reject_the_same_engine_flags() -> None:
    rule = _extra_args_rule()
    rejected = [s for f in OWNED_ENGINE_FLAGS for s in _spellings(f)]
    for arg in rejected + ALLOWED:
        by_model = owned_engine_flag(arg) is not None
        by_crd = not bool(rule.evaluate({"self": celpy.json_to_cel(arg)}))
        assert by_model == by_crd == (arg in rejected), arg


def test_owned_flags_are_exactly_vllms_options_for_them() -> None:
    """Against the installed vLLM's `vllm serve` parser: every spelling of an option the operator sets
    (aliases such as -sc, negations such as --no-...) is rejected, and no other option is."""
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
    owned_actions = [a for a in parser._actions if set(a.option_strings) & set(OWNED_ENGINE_FLAGS)]
    owned = {o for a in owned_actions for o in a.option_strings}
    assert owned == set(OWNED_ENGINE_FLAGS)
    wrongly = [
        o for a in parser._actions for o in a.option_strings if o not in owned and owned_engine_flag(o)
    ]
    assert not wrongly, f"legitimate vLLM options rejected: {wrongly}"


def test_vllm_writes_its_caches_under_the_writable_tmp() -> None:
    """With HOME=/tmp (as rendered), every default cache and socket directory of vLLM and the libraries it
    compiles with lies under /tmp, the container's writable emptyDir (the root is read-only)."""
    pytest.importorskip("vllm")
    code = """
import json, tempfile
import huggingface_hub.constants as hf
import vllm.envs as envs
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from triton import knobs
print(json.dumps({
    "vllm cache": envs.VLLM_CACHE_ROOT, "vllm config": envs.VLLM_CONFIG_ROOT,
    "vllm assets": envs.VLLM_ASSETS_CACHE, "vllm rpc sockets": envs.VLLM_RPC_BASE_PATH,
    "tempfile": tempfile.gettempdir(), "torch inductor": default_cache_dir(),
    "triton": knobs.cache.dir, "hugging face": hf.HF_HOME,
}))
"""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": render.TMP_DIR}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=300
    )
    paths = json.loads(result.stdout.strip().splitlines()[-1])
    outside = {
        k: v for k, v in paths.items() if not (v == render.TMP_DIR or v.startswith(render.TMP_DIR + "/"))
    }
    assert not outside, outside
