"""From a SpeculativeServing manifest to the processes of a local fleet: pure, no process started.

Each replica is what a pod would be: one `vllm serve` (B's EngineSpec) and one sidecar (SidecarConfig),
sharing a runtime dir (the pod's emptyDir). Model sources (hf://org/name, pvc://claim/path,
s3://bucket/path) resolve to a folder under the local models directory: everything after the scheme's
first segment, e.g. `pvc://models/tiny/target` → `MODELS_DIR/tiny/target`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from specserve_engine.api import SidecarConfig, SidecarDrafter
from specserve_engine.launch import EngineSpec
from specserve_operator.api.models import (
    DrafterSpec,
    SpeculativeServing,
    SpeculativeServingSpec,
    describe_error,
)
from specserve_operator.local.errors import LocalFleetError
from specserve_operator.render.children import engine_drafter, initial_policy

DEFAULT_NAMESPACE = "local"


def load_manifest(path: Path) -> SpeculativeServing:
    """Read and validate a manifest; errors name the file and the field."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise LocalFleetError(
            f"{path}: no such file", hint="pass a SpeculativeServing manifest, e.g. examples/local-fleet.yaml"
        ) from None
    except yaml.YAMLError as exc:
        raise LocalFleetError(f"{path}: not valid YAML: {exc}", hint="check the indentation") from None
    if not isinstance(raw, dict) or raw.get("kind") != "SpeculativeServing":
        kind = raw.get("kind") if isinstance(raw, dict) else None
        raise LocalFleetError(
            f"{path}: not a SpeculativeServing manifest (kind: {kind})",
            hint="the file must hold one resource with `kind: SpeculativeServing`",
        )
    spec = raw.get("spec")
    if not isinstance(spec, dict):
        raise LocalFleetError(f"{path}: spec: missing or not a mapping", hint="see examples/local-fleet.yaml")
    try:
        SpeculativeServingSpec.model_validate(spec)
        resource = SpeculativeServing.model_validate(raw)
    except ValidationError as exc:
        raise LocalFleetError(
            f"{path}: the manifest does not validate: {describe_error(exc)}",
            hint="fix the field named above; docs/crd-reference.md lists every field",
        ) from None
    if not resource.metadata.name:
        raise LocalFleetError(f"{path}: metadata.name: required", hint="give the resource a name")
    return resource


def resolve_source(source: str, models_dir: Path, what: str) -> Path:
    """The local folder a model source stands for (see the module docstring)."""
    _scheme, sep, rest = source.partition("://")
    parts = rest.split("/", 1) if sep else []
    if len(parts) != 2 or not parts[1]:
        raise LocalFleetError(f"{what}: {source!r} has no path after its first segment")
    path = models_dir / parts[1]
    if not path.exists():
        raise LocalFleetError(
            f"{what}: {source} resolves to {path}, which does not exist",
            hint=f"the local fleet looks for models under {models_dir} (option --models-dir); "
            "the tiny models come with the repository (scripts/train_tiny_models.py rebuilds them)",
        )
    return path


@dataclass(frozen=True)
class ReplicaPlan:
    name: str  # the pod's name
    index: int
    run_dir: Path  # logs and config of this replica
    engine: EngineSpec
    engine_port: int
    sidecar: SidecarConfig

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar.port}"

    @property
    def sidecar_config_path(self) -> Path:
        return self.run_dir / "sidecar.json"


@dataclass(frozen=True)
class FleetPlan:
    namespace: str
    name: str
    spec: SpeculativeServingSpec
    replicas: tuple[ReplicaPlan, ...]
    run_dir: Path  # everything of this run: logs, configs, Prometheus' data, the report
    token_file: Path
    model_path: Path
    # One stock vLLM per replica (no specserve flags, plugins or drafter) for the plain-decoding run, so
    # that the report compares specserve with vLLM as users start it; empty when that run is not asked for.
    stock_engines: tuple[EngineSpec, ...] = ()


def _sidecar_drafter(d: DrafterSpec, models_dir: Path, index: int) -> SidecarDrafter:
    source = str(resolve_source(d.source, models_dir, f"spec.drafters[{index}].source")) if d.source else None
    return SidecarDrafter(
        name=d.name,
        method=d.method,
        source=source,
        maxSpeculativeTokens=d.max_speculative_tokens,
        placement=d.placement,
    )


def plan_fleet(
    resource: SpeculativeServing,
    *,
    run_dir: Path,
    models_dir: Path,
    ports: list[int],
    replicas: int | None = None,
    kv_cache_gib: int = 1,
    cpu_cores: int | None = None,
    stock_ports: list[int] | None = None,
) -> FleetPlan:
    """Lay out every replica. `ports` supplies two free ports per replica (engine, sidecar);
    `stock_ports`, one per replica, adds a stock engine per replica for the plain-decoding run."""
    spec = resource.spec
    namespace = resource.metadata.namespace or DEFAULT_NAMESPACE
    count = spec.replicas if replicas is None else replicas
    if count < 1:
        raise LocalFleetError(
            "spec.replicas: the local fleet needs at least one replica", hint="set replicas: 1"
        )
    if len(ports) < 2 * count:
        raise ValueError(f"ports: need {2 * count} free ports, got {len(ports)}")
    if stock_ports is not None and len(stock_ports) < count:
        raise ValueError(f"stock_ports: need {count} free ports, got {len(stock_ports)}")
    if not spec.drafters:
        raise LocalFleetError(
            "spec.drafters: the local fleet needs at least one drafter (it compares speculation with none)",
            hint="add a drafter, e.g. {name: ngram, method: ngram, placement: sidecar}",
        )
    model_path = resolve_source(spec.model.source, models_dir, "spec.model.source")
    drafters = [_sidecar_drafter(d, models_dir, i) for i, d in enumerate(spec.drafters)]
    # The same choices the operator renders into a pod: which drafter vLLM starts with, the first policy.
    in_engine_spec = engine_drafter(spec)
    in_engine = next((d for d in drafters if in_engine_spec and d.name == in_engine_spec.name), None)
    colocated = in_engine.name if in_engine and in_engine.placement == "colocated" else None
    cores = cpu_cores or os.cpu_count() or 1
    token_file = run_dir / "sidecar-token"
    plans = []
    for i in range(count):
        pod = f"{resource.metadata.name}-{i}"
        pod_dir = run_dir / pod
        runtime_dir = pod_dir / "runtime"
        engine_port, sidecar_port = ports[2 * i], ports[2 * i + 1]
        engine = EngineSpec(
            model=str(model_path),
            served_model_name=spec.model.name,
            runtime_dir=str(runtime_dir),
            drafter=in_engine,
            port=engine_port,
            max_model_len=spec.model.max_model_len or 512,
            max_num_seqs=spec.engine.max_num_seqs,
            bucket_bounds=tuple(spec.speculation.batch_buckets),
            kv_cache_gib=kv_cache_gib,
            # Engines share the cores: each gets an equal share of OpenMP threads, none pinned.
            omp_num_threads=max(1, cores // count),
            extra_args=tuple(spec.engine.extra_args),
        )
        sidecar = SidecarConfig(
            modelName=spec.model.name,
            modelPath=str(model_path),
            drafters=drafters,
            engineDrafter=colocated,
            bucketBounds=list(spec.speculation.batch_buckets),
            runtimeDir=str(runtime_dir),
            tokenFile=str(token_file),
            host="127.0.0.1",
            port=sidecar_port,
            engineUrl=f"http://127.0.0.1:{engine_port}",
            warmupRequests=spec.speculation.warmup_requests,
            initialPolicy=initial_policy(spec),
            shadowShare=spec.speculation.shadow_share,
        )
        plans.append(ReplicaPlan(pod, i, pod_dir, engine, engine_port, sidecar))
    stock = tuple(
        dataclasses.replace(
            r.engine,
            runtime_dir=str(r.run_dir / "stock-runtime"),
            drafter=None,
            port=port,
            stock=True,
        )
        for r, port in zip(plans, stock_ports or (), strict=False)
    )
    return FleetPlan(
        namespace, resource.metadata.name, spec, tuple(plans), run_dir, token_file, model_path, stock
    )
