"""Defaults that let a minimal resource run: the operator's engine image, CPU engines (gpu.count 0) and
models baked into the engine image (image://)."""

from __future__ import annotations

import pytest

from specserve_operator import reconciler
from specserve_operator.api.models import parse_spec
from specserve_operator.render import children as render

MINIMAL = {
    "model": {"name": "m", "source": "hf://org/m"},
    "drafters": [{"name": "ngram", "method": "ngram"}],
    "speculation": {"mode": "auto"},
}


def _containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def test_a_minimal_resource_renders_a_runnable_pod_with_the_operators_image() -> None:
    options = reconciler.render_options_from_env({"SPECSERVE_ENGINE_IMAGE": "registry/engine:1.2"})
    children = render.build_children(
        "m", "ns", parse_spec(MINIMAL), options=options, service_monitor_available=False
    )
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    containers = _containers(deployment)
    assert {c["image"] for c in containers.values()} == {"registry/engine:1.2"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == "registry/engine:1.2"  # hf:// is fetched by the engine image
    assert containers["engine"]["resources"]["limits"] == {render.GPU_RESOURCE: "1"}
    args = containers["engine"]["args"]
    assert '"method": "ngram"' in args[args.index("--speculative-config") + 1]
    assert {c["kind"] for c in children} == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}


def test_the_resources_own_image_wins_over_the_operators() -> None:
    spec = parse_spec({**MINIMAL, "engine": {"image": "mine:2"}})
    pod = render.build_pod_spec("m", spec, render.RenderOptions(engine_image="default:1"))
    assert {c["image"] for c in pod["containers"]} == {"mine:2"}


def test_without_any_image_rendering_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.engine\.image"):
        render.build_pod_spec("m", parse_spec(MINIMAL), render.RenderOptions())


def test_a_cpu_engine_requests_no_gpu_and_tolerates_no_gpu_taint() -> None:
    spec = parse_spec({**MINIMAL, "engine": {"gpu": {"count": 0}}})
    pod = render.build_pod_spec("m", spec, render.RenderOptions(engine_image="cpu:1"))
    assert all(render.GPU_RESOURCE not in str(c.get("resources")) for c in pod["containers"])
    assert "tolerations" not in pod and "affinity" not in pod


def test_models_baked_into_the_image_need_no_volume_and_no_fetch() -> None:
    spec = parse_spec(
        {
            "model": {"name": "tiny", "source": "image://tiny-target"},
            "engine": {"gpu": {"count": 0}},
            "drafters": [{"name": "eagle3", "method": "eagle3", "source": "image://tiny-eagle3"}],
        }
    )
    pod = render.build_pod_spec("m", spec, render.RenderOptions(engine_image="cpu:1"))
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert engine["args"][0] == "/models/image/tiny-target"
    assert "/models/image/tiny-eagle3" in engine["args"][engine["args"].index("--speculative-config") + 1]
    assert "initContainers" not in pod
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v or v["name"] == "model-cache"]
    assert not [
        m for c in pod["containers"] for m in c["volumeMounts"] if m["mountPath"].startswith("/models")
    ]
