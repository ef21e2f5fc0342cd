"""A SpeculativeServing resource → the Kubernetes objects that run it. Pure functions of plain data.

Children (all named after the resource, all in its namespace):
- Deployment `<name>`: the vLLM engine container and the specserve sidecar container per pod;
- ConfigMap `<name>-sidecar`: the sidecar's start-up JSON (engine_sidecar.api.SidecarConfig);
- Secret `<name>-control-token`: the bearer token of the sidecar's control API (made once, never rotated);
- Service `<name>`: the OpenAI port and the sidecar port (both also serve /metrics);
- PodDisruptionBudget `<name>`; ServiceMonitor `<name>` when the Prometheus Operator is installed.

A resource without drafters gets no sidecar (there is nothing to control): no ConfigMap, no Secret.
Owner references are added by the caller (kopf.adopt), so these functions need no API server.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from specserve_engine.api import PolicyRequest, SidecarConfig, SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.engine_args import build_engine_args
from specserve_engine.policy_file import RUNTIME_DIR_ENV
from specserve_operator.api.models import (
    DrafterSpec,
    EngineResources,
    SidecarResources,
    SpeculativeServingSpec,
)
from specserve_operator.render.sources import (
    ResolvedSource,
    fetch_init_containers,
    resolve_source,
    source_volumes,
)

ENGINE_PORT = 8000
SIDECAR_PORT = 8081
RUNTIME_DIR = "/run/specserve"
CONFIG_DIR = "/etc/specserve"
CONFIG_FILE = "sidecar.json"
TOKEN_DIR = "/var/run/secrets/specserve"
TOKEN_KEY = "token"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# Set by the cluster admin (or a NodeFeatureDiscovery rule) on nodes whose GPUs are all NVLink-connected.
NVLINK_LABEL = "specserve.io/nvlink"
SERVING_LABEL = "specserve.io/serving"
POD_HASH_ANNOTATION = "specserve.io/pod-hash"
RUN_AS_USER = 1000
# A model of tens of GB takes minutes to load; the startup probe allows up to 30 minutes.
STARTUP_PROBE_PERIOD_S = 10
STARTUP_PROBE_FAILURES = 180
# Root filesystems are read-only; /tmp (also HOME) is each container's one writable place. vLLM writes its
# compile cache (~/.cache/vllm), Triton's (~/.triton), torch inductor's and its IPC sockets there.
TMP_DIR = "/tmp"
ENGINE_TMP_SIZE = "16Gi"
SIDECAR_TMP_SIZE = "2Gi"


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide settings (from the operator's environment, see reconciler.render_options_from_env)."""

    s3_image: str = "amazon/aws-cli:2.22.35"
    # The engine image of resources that set no engine.image: the image the operator was installed with.
    engine_image: str | None = None
    hf_token_secret: str | None = None
    s3_credentials_secret: str | None = None
    service_monitor_labels: dict[str, str] = field(default_factory=dict)
    scrape_interval: str = "15s"


def names(name: str) -> dict[str, str]:
    return {
        "deployment": name,
        "service": name,
        "pdb": name,
        "service_monitor": name,
        "config_map": f"{name}-sidecar",
        "secret": f"{name}-control-token",
    }


def selector_labels(name: str) -> dict[str, str]:
    return {SERVING_LABEL: name, "app.kubernetes.io/component": "engine"}


def common_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "specserve-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "specserve-operator",
        **selector_labels(name),
    }


def label_selector_string(name: str) -> str:
    """The pods' selector as text: `status.selector`, read by the scale subresource (an HPA)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def new_control_token() -> str:
    return secrets.token_urlsafe(32)


def _metadata(name: str, namespace: str, object_name: str) -> dict[str, Any]:
    return {"name": object_name, "namespace": namespace, "labels": common_labels(name)}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}


def _serving_security() -> dict[str, Any]:
    """The engine's and the sidecar's: also a read-only root (they write only to their emptyDirs). The
    fetch init containers keep a writable root: the download tools write caches under HOME."""
    return {**_container_security(), "readOnlyRootFilesystem": True}


def has_sidecar(spec: SpeculativeServingSpec) -> bool:
    return bool(spec.drafters)


def with_active_drafter(spec: SpeculativeServingSpec, active: str | None) -> SpeculativeServingSpec:
    """The spec the pods are rendered from: the controller's choice (status.activeDrafter), where it still
    names one of the spec's drafters, replaces defaultDrafter as the drafter pods start with. Without
    this, the next reconcile would roll back a rollout the controller made to another engine method."""
    if active is None or active == spec.speculation.default_drafter:
        return spec
    if active not in {d.name for d in spec.drafters}:
        return spec
    speculation = spec.speculation.model_copy(update={"default_drafter": active})
    return spec.model_copy(update={"speculation": speculation})


def engine_drafter(spec: SpeculativeServingSpec) -> DrafterSpec | None:
    """The drafter vLLM is started with: the initial drafter if vLLM runs it (colocated); otherwise the
    sidecar-hosted drafter with the largest maxSpeculativeTokens (vLLM sizes its buffers for that K)."""
    initial = spec.initial_drafter
    if initial is None or initial.placement == "colocated":
        return initial
    hosted = [d for d in spec.drafters if d.placement != "colocated"]
    return max(hosted, key=lambda d: d.max_speculative_tokens)


def needs_separate_gpu(spec: SpeculativeServingSpec) -> bool:
    return any(d.placement == "separateGpu" for d in spec.drafters)


def sidecar_drafter(drafter: DrafterSpec) -> SidecarDrafter:
    return SidecarDrafter(
        name=drafter.name,
        method=drafter.method,
        source=resolve_source(drafter.source).path if drafter.source else None,
        maxSpeculativeTokens=drafter.max_speculative_tokens,
        placement=drafter.placement,
        parallelDrafting=drafter.parallel_drafting,
    )


def initial_policy(spec: SpeculativeServingSpec) -> PolicyRequest:
    """The policy each pod starts with (and a restarted sidecar returns to), before the controller's
    first decision reaches it. The one source of what pods start with: the controller's remembered state
    (tuner.core.ResourceState.initial) and the fleet simulator start from it too.

    mode on: the initial drafter at its maximum K in every bucket, as asked. mode off: no speculation.
    auto and advise: plain steps (K = 0) in every bucket, the initial drafter named, so that the first
    interval measures the plain step time the controller calibrates speculative steps against; it turns
    speculation on where that calibration says it pays (docs/policy.md, "Cold start")."""
    drafter = spec.initial_drafter
    if drafter is None:
        raise ValueError("drafters: a resource without drafters has no policy")
    mode = spec.speculation.mode
    k = drafter.max_speculative_tokens if mode == "on" else 0
    return PolicyRequest(
        policyVersion=0,
        drafter=drafter.name,
        mode="off" if mode == "off" else "on",
        kByBucket={label: k for label in bucket_labels(spec.speculation.batch_buckets)},
    )


def build_sidecar_config(spec: SpeculativeServingSpec) -> SidecarConfig:
    engine = engine_drafter(spec)
    return SidecarConfig(
        modelName=spec.model.name,
        modelPath=resolve_source(spec.model.source).path,
        drafters=[sidecar_drafter(d) for d in spec.drafters],
        engineDrafter=engine.name if engine is not None and engine.placement == "colocated" else None,
        bucketBounds=list(spec.speculation.batch_buckets),
        runtimeDir=RUNTIME_DIR,
        tokenFile=f"{TOKEN_DIR}/{TOKEN_KEY}",
        host="0.0.0.0",
        port=SIDECAR_PORT,
        engineUrl=f"http://127.0.0.1:{ENGINE_PORT}",
        warmupRequests=spec.speculation.warmup_requests,
        initialPolicy=initial_policy(spec),
        shadowShare=spec.speculation.shadow_share,
    )


def build_config_map(name: str, namespace: str, spec: SpeculativeServingSpec) -> dict[str, Any]:
    config = build_sidecar_config(spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(name, namespace, names(name)["config_map"]),
        "data": {
            CONFIG_FILE: json.dumps(config.model_dump(mode="json", by_alias=True), indent=2, sort_keys=True)
        },
    }


def build_secret(name: str, namespace: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(name, namespace, names(name)["secret"]),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def engine_args(spec: SpeculativeServingSpec) -> list[str]:
    drafter = engine_drafter(spec)
    return build_engine_args(
        model=resolve_source(spec.model.source).path,
        served_model_name=spec.model.name,
        port=ENGINE_PORT,
        max_model_len=spec.model.max_model_len,
        tensor_parallel_size=spec.model.tensor_parallel_size,
        drafter=sidecar_drafter(drafter) if drafter is not None else None,
        bucket_bounds=list(spec.speculation.batch_buckets),
        max_num_seqs=spec.engine.max_num_seqs,
        runtime_dir=RUNTIME_DIR,
        extra_args=list(spec.engine.extra_args),
    )


def _http_probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _node_affinity(spec: SpeculativeServingSpec) -> dict[str, Any] | None:
    requirements = []
    if spec.engine.gpu.product:
        requirements.append({"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [spec.engine.gpu.product]})
    if needs_separate_gpu(spec):
        requirements.append({"key": NVLINK_LABEL, "operator": "In", "values": ["true"]})
    if not requirements:
        return None
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": requirements}]
            }
        }
    }


def engine_image(spec: SpeculativeServingSpec, options: RenderOptions) -> str:
    """The resource's engine.image, else the operator's default; ValueError naming the field if neither."""
    image = spec.engine.image or options.engine_image
    if not image:
        raise ValueError(
            "spec.engine.image: unset, and the operator has no default engine image "
            "(set engines.image in the chart's values, or engine.image in the resource)"
        )
    return image


def _container_resources(resources: EngineResources | SidecarResources, gpus: int) -> dict[str, Any]:
    """The container's CPU and memory from the resource, plus `gpus` GPUs (none for a CPU engine)."""
    out: dict[str, Any] = {}
    for key, amounts in (("limits", resources.limits), ("requests", resources.requests)):
        values = amounts.model_dump(exclude_none=True)
        if gpus:
            values[GPU_RESOURCE] = str(gpus)
        if values:
            out[key] = values
    return out


def _sources(spec: SpeculativeServingSpec) -> list[ResolvedSource]:
    uris = [spec.model.source] + [d.source for d in spec.drafters if d.source]
    return [resolve_source(u) for u in uris]


def build_pod_spec(name: str, spec: SpeculativeServingSpec, options: RenderOptions) -> dict[str, Any]:
    sources = _sources(spec)
    model_volumes, model_mounts = source_volumes(sources)
    runtime_mount = {"name": "runtime", "mountPath": RUNTIME_DIR}
    runtime_env = {"name": RUNTIME_DIR_ENV, "value": RUNTIME_DIR}
    image = engine_image(spec, options)
    engine: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": ["vllm", "serve"],
        "args": engine_args(spec),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": [runtime_env, {"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_OFFLINE", "value": "1"}],
        "resources": _container_resources(spec.engine.resources, spec.engine.gpu.count),
        "volumeMounts": [
            runtime_mount,
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "engine-tmp", "mountPath": TMP_DIR},
            *model_mounts,
        ],
        "startupProbe": _http_probe("/health", ENGINE_PORT, STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES),
        "livenessProbe": _http_probe("/health", ENGINE_PORT, 10, 3),
        # The pod's readiness is the engine's alone: vLLM serves without drafts when the sidecar is down.
        "readinessProbe": _http_probe("/health", ENGINE_PORT, 5, 3),
        "securityContext": _serving_security(),
    }
    containers = [engine]
    volumes: list[dict[str, Any]] = [
        {"name": "runtime", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.engine.shm_size}},
        {"name": "engine-tmp", "emptyDir": {"sizeLimit": ENGINE_TMP_SIZE}},
        *model_volumes,
    ]
    if has_sidecar(spec):
        sidecar: dict[str, Any] = {
            "name": "sidecar",
            "image": image,
            "command": ["specserve-sidecar", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
            "ports": [{"name": "sidecar", "containerPort": SIDECAR_PORT, "protocol": "TCP"}],
            "env": [runtime_env, {"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_OFFLINE", "value": "1"}],
            "volumeMounts": [
                runtime_mount,
                {"name": "sidecar-config", "mountPath": CONFIG_DIR, "readOnly": True},
                {"name": "control-token", "mountPath": TOKEN_DIR, "readOnly": True},
                {"name": "sidecar-tmp", "mountPath": TMP_DIR},
                *model_mounts,
            ],
            "resources": _container_resources(spec.sidecar.resources, 1 if needs_separate_gpu(spec) else 0),
            # Restarted when hung; no readiness probe, so a sidecar down or warming never takes the pod
            # out of service (the engine then runs without drafts). It shows instead in the
            # SpecserveSidecarDown alert and the tuner's SidecarUnreachable Events (docs/runbook.md).
            "livenessProbe": _http_probe("/healthz", SIDECAR_PORT, 10, 3),
            "securityContext": _serving_security(),
        }
        containers.append(sidecar)
        volumes += [
            {"name": "sidecar-tmp", "emptyDir": {"sizeLimit": SIDECAR_TMP_SIZE}},
            {"name": "sidecar-config", "configMap": {"name": names(name)["config_map"]}},
            {"name": "control-token", "secret": {"secretName": names(name)["secret"], "defaultMode": 0o440}},
        ]
    pod: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": fetch_init_containers(
            sources,
            engine_image=image,
            s3_image=options.s3_image,
            hf_token_secret=options.hf_token_secret,
            s3_credentials_secret=options.s3_credentials_secret,
            security_context=_container_security(),
        ),
        "containers": containers,
        "volumes": volumes,
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        if spec.engine.gpu.count
        else [],
        # Let in-flight requests finish when a pod is replaced (vLLM drains on SIGTERM).
        "terminationGracePeriodSeconds": 120,
        "enableServiceLinks": False,
        # Nothing in the pod talks to the Kubernetes API.
        "automountServiceAccountToken": False,
    }
    for key in ("initContainers", "tolerations"):
        if not pod[key]:
            del pod[key]
    affinity = _node_affinity(spec)
    if affinity is not None:
        pod["affinity"] = affinity
    return pod


def pod_hash(pod_spec: dict[str, Any], sidecar_config: SidecarConfig | None) -> str:
    """A digest of everything a pod reads at start-up and cannot change live, so that any change to it
    rolls the pods. The initial policy is left out: mode and K change live through the sidecar."""
    config = None
    if sidecar_config is not None:
        config = sidecar_config.model_dump(mode="json", by_alias=True, exclude={"initial_policy"})
    blob = json.dumps({"pod": pod_spec, "sidecar": config}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_deployment(
    name: str, namespace: str, spec: SpeculativeServingSpec, options: RenderOptions
) -> dict[str, Any]:
    pod_spec = build_pod_spec(name, spec, options)
    digest = pod_hash(pod_spec, build_sidecar_config(spec) if has_sidecar(spec) else None)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, names(name)["deployment"]),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # Surge rollout: a new pod's engine is ready before an old one goes (docs/architecture.md).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": common_labels(name), "annotations": {POD_HASH_ANNOTATION: digest}},
                "spec": pod_spec,
            },
        },
    }


def build_service(name: str, namespace: str, spec: SpeculativeServingSpec) -> dict[str, Any]:
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if has_sidecar(spec):
        ports.append({"name": "sidecar", "port": SIDECAR_PORT, "targetPort": "sidecar", "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, names(name)["service"]),
        "spec": {"type": "ClusterIP", "selector": selector_labels(name), "ports": ports},
    }


def build_pod_disruption_budget(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, names(name)["pdb"]),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def build_service_monitor(
    name: str, namespace: str, spec: SpeculativeServingSpec, options: RenderOptions
) -> dict[str, Any]:
    endpoints = [{"port": "http", "path": "/metrics", "interval": options.scrape_interval}]
    if has_sidecar(spec):
        endpoints.append({"port": "sidecar", "path": "/metrics", "interval": options.scrape_interval})
    metadata = _metadata(name, namespace, names(name)["service_monitor"])
    metadata["labels"] = {**metadata["labels"], **options.service_monitor_labels}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": endpoints,
        },
    }


def build_children(
    name: str,
    namespace: str,
    spec: SpeculativeServingSpec,
    *,
    options: RenderOptions,
    service_monitor_available: bool,
) -> list[dict[str, Any]]:
    """Every child except the Secret (made once, with a fresh token, by the caller), in apply order."""
    children = []
    if has_sidecar(spec):
        children.append(build_config_map(name, namespace, spec))
    children += [
        build_deployment(name, namespace, spec, options),
        build_service(name, namespace, spec),
        build_pod_disruption_budget(name, namespace),
    ]
    if service_monitor_available and spec.monitoring.service_monitor:
        children.append(build_service_monitor(name, namespace, spec, options))
    return children
