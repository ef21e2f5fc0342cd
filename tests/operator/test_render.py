"""Rendering a resource into Kubernetes objects: pure functions, table-driven, no API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from specserve_engine.api import SidecarConfig
from specserve_engine.engine_args import SIDECAR_PROPOSER
from specserve_operator.api.models import METHODS_BY_PLACEMENT, METHODS_NEEDING_SOURCE, parse_spec
from specserve_operator.reconciler import render_options_from_env
from specserve_operator.render import children as render
from specserve_operator.render.sources import resolve_source

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml") if not p.name.startswith("local-fleet"))
OPTIONS = render.RenderOptions()


def _spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 2,
        "model": {"name": "llama", "source": "hf://org/llama", "tensorParallelSize": 2},
        "engine": {"image": "engine:1", "gpu": {"count": 2, "product": "NVIDIA-H200"}},
        "drafters": [{"name": "eagle3", "method": "eagle3", "source": "hf://org/eagle3"}],
    }
    spec.update(overrides)
    return spec


def _drafter(method: str, placement: str, name: str = "d") -> dict[str, Any]:
    drafter: dict[str, Any] = {"name": name, "method": method, "placement": placement}
    if method in METHODS_NEEDING_SOURCE:
        drafter["source"] = f"pvc://weights/{name}"
    return drafter


def _children(spec: dict[str, Any], monitoring: bool = True) -> dict[str, dict[str, Any]]:
    objs = render.build_children(
        "demo", "ns", parse_spec(spec), options=OPTIONS, service_monitor_available=monitoring
    )
    return {o["kind"]: o for o in objs}


def _containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def _gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def _speculative_config(deployment: dict[str, Any]) -> dict[str, Any] | None:
    args = _containers(deployment)["engine"]["args"]
    if "--speculative-config" not in args:
        return None
    return json.loads(args[args.index("--speculative-config") + 1])


PAIRS = [(p, m) for p, methods in METHODS_BY_PLACEMENT.items() for m in methods]


@pytest.mark.parametrize(("placement", "method"), PAIRS, ids=[f"{p}-{m}" for p, m in PAIRS])
def test_each_placement_and_method(placement: str, method: str) -> None:
    spec = _spec(drafters=[_drafter(method, placement)])
    objs = _children(spec)
    containers = _containers(objs["Deployment"])
    assert set(containers) == {"engine", "sidecar"}
    assert _gpus(containers["engine"]) == 2
    assert _gpus(containers["sidecar"]) == (1 if placement == "separateGpu" else 0)
    config = _speculative_config(objs["Deployment"])
    assert config is not None
    if placement == "colocated":
        assert config["method"] != "custom_class"
    else:
        assert (config["method"], config["model"], config["num_speculative_tokens"]) == (
            "custom_class",
            SIDECAR_PROPOSER,
            4,
        )
    sidecar_config = SidecarConfig.model_validate_json(objs["ConfigMap"]["data"][render.CONFIG_FILE])
    assert sidecar_config.drafters[0].placement == placement
    assert sidecar_config.engine_drafter == ("d" if placement == "colocated" else None)
    if method in METHODS_NEEDING_SOURCE:
        assert sidecar_config.drafters[0].source == "/models/pvc/weights/d"
        assert config.get("model", SIDECAR_PROPOSER) in ("/models/pvc/weights/d", SIDECAR_PROPOSER)


@pytest.mark.parametrize(
    ("gpu", "drafters", "engine_gpus", "sidecar_gpus", "affinity"),
    [
        ({"count": 1}, [_drafter("ngram", "colocated")], 1, 0, []),
        (
            {"count": 4, "product": "NVIDIA-H200"},
            [_drafter("eagle3", "colocated")],
            4,
            0,
            ["nvidia.com/gpu.product"],
        ),
        ({"count": 8}, [_drafter("draftModel", "separateGpu")], 8, 1, ["specserve.io/nvlink"]),
        (
            {"count": 4, "product": "NVIDIA-H100-80GB-HBM3"},
            [_drafter("selfSpeculative", "separateGpu", "a"), _drafter("ngram", "sidecar", "b")],
            4,
            1,
            ["nvidia.com/gpu.product", "specserve.io/nvlink"],
        ),
        ({"count": 2}, [_drafter("suffix", "sidecar")], 2, 0, []),
    ],
)
def test_gpu_counts_and_affinity(
    gpu: dict[str, Any],
    drafters: list[dict[str, Any]],
    engine_gpus: int,
    sidecar_gpus: int,
    affinity: list[str],
) -> None:
    spec = _spec(engine={"image": "engine:1", "gpu": gpu}, drafters=drafters)
    spec["model"]["tensorParallelSize"] = 1
    deployment = _children(spec)["Deployment"]
    containers = _containers(deployment)
    assert _gpus(containers["engine"]) == engine_gpus
    assert _gpus(containers["sidecar"]) == sidecar_gpus
    pod = deployment["spec"]["template"]["spec"]
    if not affinity:
        assert "affinity" not in pod
        return
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [e["key"] for e in terms[0]["matchExpressions"]] == affinity
    if "nvidia.com/gpu.product" in affinity:
        assert terms[0]["matchExpressions"][0]["values"] == [gpu["product"]]


def test_no_drafters_means_no_sidecar_and_no_speculation() -> None:
    objs = _children(_spec(drafters=[], speculation={"mode": "off"}))
    assert set(objs) == {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"}
    assert set(_containers(objs["Deployment"])) == {"engine"}
    assert _speculative_config(objs["Deployment"]) is None
    assert [p["name"] for p in objs["Service"]["spec"]["ports"]] == ["http"]


def test_sidecar_hosted_engine_drafter_is_the_one_with_the_largest_k() -> None:
    drafters = [
        {
            "name": "small",
            "method": "draftModel",
            "source": "hf://o/s",
            "placement": "separateGpu",
            "maxSpeculativeTokens": 3,
        },
        {"name": "ngram", "method": "ngram", "placement": "sidecar", "maxSpeculativeTokens": 7},
    ]
    spec = parse_spec(_spec(drafters=drafters))
    assert render.engine_drafter(spec).name == "ngram"
    assert (
        _speculative_config(_children(_spec(drafters=drafters))["Deployment"])["num_speculative_tokens"] == 7
    )


@pytest.mark.parametrize(
    ("mode", "pod_mode", "k"),
    [("auto", "on", 0), ("advise", "on", 0), ("on", "on", 4), ("off", "off", 0)],
)
def test_initial_policy_follows_mode_and_buckets(mode: str, pod_mode: str, k: int) -> None:
    """Where the controller decides (auto, advise) pods start plain in every bucket, the initial drafter
    named: the first interval measures the plain step the controller calibrates against. Mode on starts
    at the drafter's maximum K, as asked; mode off does not speculate."""
    spec = _spec(speculation={"mode": mode, "batchBuckets": [1, 8, 64]})
    config = SidecarConfig.model_validate_json(_children(spec)["ConfigMap"]["data"][render.CONFIG_FILE])
    assert config.bucket_bounds == [1, 8, 64]
    policy = config.initial_policy
    assert (policy.policy_version, policy.drafter, policy.mode) == (0, "eagle3", pod_mode)
    assert policy.k_by_bucket == {"1": k, "8": k, "64": k, "+Inf": k}


def _hash(spec: dict[str, Any]) -> str:
    return _children(spec)["Deployment"]["spec"]["template"]["metadata"]["annotations"][
        render.POD_HASH_ANNOTATION
    ]


@pytest.mark.parametrize(
    ("change", "rolls"),
    [
        (lambda s: s["engine"].update(image="engine:2"), True),
        (lambda s: s["drafters"].append({"name": "ngram", "method": "ngram"}), True),
        (lambda s: s["drafters"][0].update(maxSpeculativeTokens=6), True),
        (lambda s: s["model"].update(maxModelLen=4096), True),
        (lambda s: s.update(speculation={"batchBuckets": [1, 4, 16]}), True),
        (lambda s: s.update(speculation={"mode": "off"}), False),
        (lambda s: s.update(speculation={"cooldown": "10m", "minGain": 1.3}), False),
        (lambda s: s.update(replicas=7), False),
    ],
    ids=["image", "add-drafter", "max-k", "max-model-len", "buckets", "mode", "policy-knobs", "replicas"],
)
def test_pod_hash_changes_only_for_what_pods_cannot_change_live(change, rolls: bool) -> None:
    before = _spec()
    after = _spec()
    change(after)
    assert (_hash(before) != _hash(after)) is rolls


def test_model_sources_become_pod_paths_and_volumes() -> None:
    spec = _spec(
        model={"name": "m", "source": "pvc://store/llama/70b", "tensorParallelSize": 2},
        drafters=[
            {"name": "a", "method": "eagle3", "source": "hf://org/eagle"},
            {
                "name": "b",
                "method": "draftModel",
                "source": "s3://bucket/drafts/8b",
                "placement": "separateGpu",
            },
        ],
    )
    deployment = _children(spec)["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    engine = _containers(deployment)["engine"]
    assert engine["args"][0] == "/models/pvc/store/llama/70b"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-pvc-store"]["persistentVolumeClaim"] == {"claimName": "store", "readOnly": True}
    assert "model-cache" in volumes
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert {"/models/pvc/store", "/models/fetched", "/run/specserve"} <= mounts
    init = {c["name"]: c for c in pod["initContainers"]}
    assert "hf download org/eagle --local-dir /models/fetched/hf/org/eagle" in init["fetch-hf"]["command"][2]
    assert (
        "aws s3 sync s3://bucket/drafts/8b /models/fetched/s3/bucket/drafts/8b"
        in init["fetch-s3"]["command"][2]
    )


def test_pvc_only_needs_no_init_containers() -> None:
    spec = _spec(
        model={"name": "m", "source": "pvc://store/m"},
        engine={"image": "i"},
        drafters=[_drafter("ngram", "colocated")],
    )
    pod = _children(spec)["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod


@pytest.mark.parametrize("uri", ["ftp://x/y", "hf://", "pvc:/claim"])
def test_bad_source_uris(uri: str) -> None:
    with pytest.raises(ValueError, match=r"source|scheme"):
        resolve_source(uri)


def test_pod_security_probes_and_shared_runtime_dir() -> None:
    deployment = _children(_spec())["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    for container in pod["containers"] + pod.get("initContainers", []):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    containers = _containers(deployment)
    for name in ("engine", "sidecar"):
        assert {"name": "SPECSERVE_RUNTIME_DIR", "value": "/run/specserve"} in containers[name]["env"]
        assert "livenessProbe" in containers[name]
    # the engine alone decides the pod's readiness (test_engine_pod_hardening.py)
    assert "readinessProbe" in containers["engine"] and "readinessProbe" not in containers["sidecar"]
    assert containers["engine"]["startupProbe"]["httpGet"]["path"] == "/health"
    assert containers["sidecar"]["command"] == [
        "specserve-sidecar",
        "--config",
        "/etc/specserve/sidecar.json",
    ]
    config = SidecarConfig.model_validate_json(_children(_spec())["ConfigMap"]["data"][render.CONFIG_FILE])
    token_mount = next(m for m in containers["sidecar"]["volumeMounts"] if m["name"] == "control-token")
    assert config.token_file == f"{token_mount['mountPath']}/{render.TOKEN_KEY}"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_sidecar_gets_the_resources_shadow_share() -> None:
    def share(spec: dict) -> float:
        data = _children(spec)["ConfigMap"]["data"][render.CONFIG_FILE]
        return SidecarConfig.model_validate_json(data).shadow_share

    assert share(_spec()) == 0.05
    assert share(_spec(speculation={"shadowShare": 0})) == 0.0


def test_service_and_service_monitor() -> None:
    objs = _children(_spec())
    assert [(p["name"], p["port"]) for p in objs["Service"]["spec"]["ports"]] == [
        ("http", 8000),
        ("sidecar", 8081),
    ]
    assert objs["Service"]["spec"]["selector"] == objs["Deployment"]["spec"]["selector"]["matchLabels"]
    monitor = objs["ServiceMonitor"]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "sidecar"]
    service_labels = objs["Service"]["metadata"]["labels"]
    assert service_labels | monitor["spec"]["selector"]["matchLabels"] == service_labels
    assert "ServiceMonitor" not in _children(_spec(), monitoring=False)
    assert "ServiceMonitor" not in _children(_spec(monitoring={"serviceMonitor": False}))


def test_selector_string_matches_the_pod_labels() -> None:
    deployment = _children(_spec())["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for pair in render.label_selector_string("demo").split(","):
        key, value = pair.split("=")
        assert labels[key] == value


def test_secret_holds_the_token() -> None:
    token = render.new_control_token()
    assert len(token) >= 32 and token != render.new_control_token()
    secret = render.build_secret("demo", "ns", token)
    assert secret["stringData"] == {"token": token}
    assert secret["metadata"]["name"] == "demo-control-token"


def test_render_options_from_env() -> None:
    options = render_options_from_env(
        {"SPECSERVE_SERVICEMONITOR_LABELS": "release=kps, team=ml", "SPECSERVE_HF_TOKEN_SECRET": "hf"}
    )
    assert options.service_monitor_labels == {"release": "kps", "team": "ml"}
    assert options.hf_token_secret == "hf"
    with pytest.raises(ValueError, match="SPECSERVE_SERVICEMONITOR_LABELS"):
        render_options_from_env({"SPECSERVE_SERVICEMONITOR_LABELS": "oops"})


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_render_to_valid_kubernetes_objects(path: Path) -> None:
    resource = yaml.safe_load(path.read_text())
    spec = parse_spec(resource["spec"])
    name, namespace = resource["metadata"]["name"], resource["metadata"]["namespace"]
    # Examples without engine.image run the operator's default image (the chart's engines.image).
    options = render.RenderOptions(engine_image="ghcr.io/specserve/specserve-engine:0.1.0")
    objs = render.build_children(name, namespace, spec, options=options, service_monitor_available=True)
    if render.has_sidecar(spec):
        objs.append(render.build_secret(name, namespace, "t"))
    for obj in objs:
        assert obj["metadata"]["namespace"] == namespace
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, "1.32", strict=True)


def test_pods_run_the_controllers_active_drafter() -> None:
    two = _spec(drafters=[_drafter("eagle3", "colocated", "eagle3"), _drafter("ngram", "colocated", "ngram")])
    spec = parse_spec(two)
    running = render.with_active_drafter(spec, "ngram")
    assert render.engine_drafter(running).name == "ngram"
    assert running.initial_drafter.name == "ngram" and spec.initial_drafter.name == "eagle3"
    # No choice yet, or a drafter the spec no longer has: the spec's own default.
    assert render.with_active_drafter(spec, None) is spec
    assert render.engine_drafter(render.with_active_drafter(spec, "removed")).name == "eagle3"
