"""The SpeculativeServing custom resource: pydantic v2 models, the single source of the API.

The CRD in crds/ and docs/crd-reference.md are generated from these models (`specserve_operator.api.crd`
and `.reference`), and the cross-field rules below are mirrored there as CEL rules, so that the API
server and the operator reject the same resources. Field names on the wire are camelCase; Python
attributes are snake_case.
"""

from __future__ import annotations

import itertools
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specserve_engine.api import Placement
from specserve_engine.buckets import DEFAULT_BUCKETS

GROUP = "specserve.io"
VERSION = "v1alpha1"
KIND = "SpeculativeServing"
PLURAL = "speculativeservings"
SINGULAR = "speculativeserving"
SHORT_NAMES = ["specserve", "sps"]
API_VERSION = f"{GROUP}/{VERSION}"

DrafterMethod = Literal[
    "eagle3", "eagle", "medusa", "mtp", "draftModel", "ngram", "suffix", "selfSpeculative"
]
SpeculationMode = Literal["auto", "advise", "on", "off"]
Phase = Literal["Pending", "Deploying", "Ready", "Degraded", "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]

DRAFTER_METHODS: tuple[str, ...] = DrafterMethod.__args__  # type: ignore[attr-defined]
PLACEMENTS: tuple[str, ...] = Placement.__args__  # type: ignore[attr-defined]

# Which placements each method can run in (docs/architecture.md#placements). colocated = vLLM's own drafter
# inside the engine; sidecar = hosted by the sidecar on the pod's own GPUs; separateGpu = hosted by the
# sidecar on its own GPU.
METHODS_BY_PLACEMENT: dict[str, tuple[str, ...]] = {
    "colocated": ("eagle3", "eagle", "medusa", "mtp", "draftModel", "ngram", "suffix"),
    "sidecar": ("draftModel", "ngram", "suffix", "selfSpeculative"),
    "separateGpu": ("draftModel", "selfSpeculative"),
}
# Methods that load weights of their own (a `source` is required) and methods that have none (forbidden).
METHODS_NEEDING_SOURCE: tuple[str, ...] = ("eagle3", "eagle", "medusa", "draftModel")
METHODS_WITHOUT_WEIGHTS: tuple[str, ...] = ("ngram", "suffix")
# EAGLE-style heads vLLM can run with parallel drafting (P-EAGLE: all K tokens in one forward pass).
PARALLEL_DRAFTING_METHODS: tuple[str, ...] = ("eagle3", "eagle")

# image://NAME: a folder baked into the engine image (one path segment, so it cannot leave the folder).
MODEL_SOURCE_PATTERN = (
    r"^(hf://[^/\s]+/\S+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/\S*)?|s3://[^/\s]+/\S*|image://[\w-]+)$"
)
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_DRAFTERS = 16
MAX_BUCKETS = 32
# A Kubernetes quantity without sign or exponent: 4, 500m, 1.5, 16Gi, 512M.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE])?$"
# A `..` path segment would lead a source's pod path out of its mount (pvc://claim/../../etc).
PARENT_SEGMENT = "(^|/)[.][.](/|$)"
# `vllm serve` flags the operator sets itself, so engine.extraArgs cannot override them: where the engine
# listens (the probes, the Service and the sidecar reach http://<pod>:8000), its access control (a key in
# the Deployment is readable by anyone who may read Deployments, and would lock the sidecar out), what the
# resource's own fields say, and specserve's plugins.
OWNED_ENGINE_FLAGS: tuple[str, ...] = (
    "--host",
    "--port",
    "--uds",
    "--root-path",
    "--ssl-keyfile",
    "--ssl-certfile",
    "--ssl-ca-certs",
    "--ssl-cert-reqs",
    "--enable-ssl-refresh",
    "--no-enable-ssl-refresh",
    "--api-key",
    "--model",
    "--served-model-name",
    "--max-model-len",
    "--tensor-parallel-size",
    "-tp",
    "--max-num-seqs",
    "--speculative-config",
    "-sc",
    "--scheduler-cls",
    "--worker-cls",
    "--additional-config",
    "--disable-log-stats",
    "--enable-logging-iteration-details",
    "--no-enable-logging-iteration-details",
)


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration such as "30s", "5m" or "1m30s"."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration like '30s', '5m' or '1h30m'")
    return sum(float(n) * _DURATION_UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


def owned_engine_flag(arg: str) -> str | None:
    """The operator's flag `arg` sets, in any spelling vLLM's parser takes: `--flag=v`, `--flag.key v`
    (JSON fields), underscores for dashes, or an abbreviation (argparse expands unambiguous prefixes)."""
    flag = arg.split("=", 1)[0].split(".", 1)[0]
    if not flag.startswith("-"):
        return None
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
    for owned in OWNED_ENGINE_FLAGS:
        if flag == owned or (flag.startswith("--") and len(flag) > 2 and owned.startswith(flag)):
            return owned
    return None


def _owned_flag_regex() -> str:
    """owned_engine_flag as one RE2 pattern for the CRD: each flag, or any prefix of it (nested optional
    groups), with `-` or `_` between words, then the end, `=` or `.`."""

    def prefixes(rest: str) -> str:
        if not rest:
            return ""
        head = "[-_]" if rest[0] == "-" else rest[0]
        return f"({head}{prefixes(rest[1:])})?"

    long_flags = [f[2:] for f in OWNED_ENGINE_FLAGS if f.startswith("--")]
    short_flags = [f[1:] for f in OWNED_ENGINE_FLAGS if not f.startswith("--")]
    alternatives = [f[0] + prefixes(f[1:]) for f in long_flags]
    return f"^(--({'|'.join(alternatives)})|-({'|'.join(short_flags)}))([=.].*)?$"


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


def _quoted(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=False)

    def to_wire(self) -> dict[str, Any]:
        """The resource's JSON form: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]


def _source_within_its_mount(source: str | None) -> str | None:
    if source is not None and re.search(PARENT_SEGMENT, source):
        raise ValueError("must not contain a '..' path segment")
    return source


SOURCE_RULES = {
    "x-kubernetes-validations": [
        _cel(f"!self.matches('{PARENT_SEGMENT}')", "source must not contain a '..' path segment")
    ]
}


class ResourceAmounts(_Model):
    """CPU and memory, as Kubernetes quantities; unset: none."""

    cpu: str | None = Field(
        default=None, max_length=32, pattern=QUANTITY_PATTERN, description="CPU cores, e.g. 4 or 500m."
    )
    memory: str | None = Field(
        default=None, max_length=32, pattern=QUANTITY_PATTERN, description="Memory, e.g. 16Gi."
    )


class EngineResources(_Model):
    """The engine container's CPU and memory (its GPUs come from engine.gpu). No CPU limit by default:
    throttling a serving engine costs latency; a memory limit is left to the cluster's admin, as an
    out-of-memory kill costs a full model load."""

    requests: ResourceAmounts = Field(
        default_factory=lambda: ResourceAmounts(cpu="4", memory="16Gi"),
        description="What the scheduler reserves; set as a whole (a field left out is not requested).",
    )
    limits: ResourceAmounts = Field(default_factory=ResourceAmounts, description="Hard limits; unset: none.")


class SidecarResources(_Model):
    """The sidecar container's CPU and memory (a separateGpu drafter adds its GPU)."""

    requests: ResourceAmounts = Field(
        default_factory=lambda: ResourceAmounts(cpu="500m", memory="1Gi"),
        description="What the scheduler reserves; set as a whole (a field left out is not requested).",
    )
    limits: ResourceAmounts = Field(
        default_factory=lambda: ResourceAmounts(memory="8Gi"),
        description="Hard limits; set as a whole. The memory limit bounds a drafter that leaks.",
    )


class SidecarSpec(_Model):
    """The specserve sidecar container of each pod (pods of a resource with drafters)."""

    resources: SidecarResources = Field(default_factory=SidecarResources, description="CPU and memory.")


class ModelSpec(_Model):
    """The target model the engine serves."""

    name: str = Field(
        min_length=1, max_length=128, description="The served model name (the OpenAI API's `model`)."
    )
    source: str = Field(
        pattern=MODEL_SOURCE_PATTERN,
        max_length=512,
        json_schema_extra=SOURCE_RULES,
        description="Where the weights come from: hf://org/repo, pvc://claim/path, s3://bucket/path, or "
        "image://name for a folder baked into the engine image (/models/image/name; the CPU image's tiny "
        "models).",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, alias="tensorParallelSize", description="GPUs the target is sharded over."
    )
    max_model_len: int = Field(
        default=8192, ge=16, le=1_048_576, alias="maxModelLen", description="Longest prompt plus output."
    )

    _source_within_its_mount = field_validator("source")(_source_within_its_mount)


class GpuSpec(_Model):
    count: int = Field(
        default=1,
        ge=0,
        le=16,
        description="GPUs per pod for the engine (the target model); 0: none, the engine runs on CPUs "
        "(an engine image with vLLM's CPU build, e.g. the Dockerfile's engine-cpu target).",
    )
    product: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$",
        description="The GPU product (node label nvidia.com/gpu.product), e.g. NVIDIA-H200; unset: any.",
    )


class EngineSpec(_Model):
    """The vLLM engine container of each pod."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Engine image: vLLM with the specserve plugins and sidecar; unset: the image the "
        "operator was installed with (the chart's engines.image).",
    )
    gpu: GpuSpec = Field(default_factory=GpuSpec, description="GPUs for the engine container.")
    max_num_seqs: int = Field(
        default=256, ge=1, le=4096, alias="maxNumSeqs", description="Most sequences the engine batches."
    )
    extra_args: list[
        Annotated[
            str,
            Field(
                max_length=1024,
                json_schema_extra={
                    "x-kubernetes-validations": [
                        _cel(
                            f"!self.matches('{_owned_flag_regex()}')",
                            "extraArgs must not set a flag the operator sets itself (docs/engine-pod.md)",
                        )
                    ]
                },
            ),
        ]
    ] = Field(
        default_factory=list,
        max_length=64,
        alias="extraArgs",
        description="More `vllm serve` arguments; not the flags the operator sets itself (--host, --port, "
        "--api-key, --model, --max-model-len, --speculative-config, ...: docs/engine-pod.md).",
    )
    resources: EngineResources = Field(
        default_factory=EngineResources, description="CPU and memory of the engine container."
    )
    shm_size: str = Field(
        default="8Gi",
        max_length=32,
        pattern=QUANTITY_PATTERN,
        alias="shmSize",
        description="Size of the engine's /dev/shm (memory-backed; NCCL and vLLM's workers share tensors "
        "through it), counted in the pod's memory.",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_owned_flags(cls, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            owned = owned_engine_flag(arg)
            if owned is not None:
                raise ValueError(f"[{i}] {arg!r} sets {owned}, which the operator sets itself")
        return args


class DrafterSpec(_Model):
    """One candidate drafter."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"self.placement != '{placement}' || self.method in {_quoted(methods)}",
                    f"placement {placement} is allowed only for methods {', '.join(methods)}",
                    ".placement",
                )
                for placement, methods in METHODS_BY_PLACEMENT.items()
            ]
            + [
                _cel(
                    f"!(self.method in {_quoted(METHODS_NEEDING_SOURCE)}) || has(self.source)",
                    f"source is required for methods {', '.join(METHODS_NEEDING_SOURCE)}",
                    ".source",
                ),
                _cel(
                    f"!(self.method in {_quoted(METHODS_WITHOUT_WEIGHTS)}) || !has(self.source)",
                    f"source must not be set for methods {', '.join(METHODS_WITHOUT_WEIGHTS)}",
                    ".source",
                ),
                _cel(
                    f"!self.parallelDrafting || (self.method in {_quoted(PARALLEL_DRAFTING_METHODS)} "
                    "&& self.placement == 'colocated')",
                    f"parallelDrafting is allowed only for colocated {', '.join(PARALLEL_DRAFTING_METHODS)} "
                    "drafters",
                    ".parallelDrafting",
                ),
            ]
        }
    )

    name: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN, description="Unique name of the drafter."
    )
    method: DrafterMethod = Field(description="How drafts are made.")
    source: str | None = Field(
        default=None,
        pattern=MODEL_SOURCE_PATTERN,
        max_length=512,
        json_schema_extra=SOURCE_RULES,
        description="The drafter's weights (hf://, pvc://, s3://, image://); required for eagle3, eagle, "
        "medusa, draftModel; forbidden for ngram, suffix.",
    )
    max_speculative_tokens: int = Field(
        default=4, ge=1, le=16, alias="maxSpeculativeTokens", description="The largest K this drafter runs."
    )
    placement: Placement = Field(
        default="colocated",
        description="colocated: in the engine on the target's GPUs; sidecar: in the sidecar on the same "
        "GPUs; separateGpu: in the sidecar on a GPU of its own, NVLink-connected to the target's.",
    )
    parallel_drafting: bool = Field(
        default=False,
        alias="parallelDrafting",
        description="P-EAGLE: vLLM drafts all K tokens in one forward pass of the head instead of K "
        "passes (colocated eagle3 and eagle only; the head must be trained for it: its config.json names "
        "the mask token, e.g. `mask_token_id`, and its weights hold `mask_hidden`).",
    )

    _source_within_its_mount = field_validator("source")(_source_within_its_mount)

    @model_validator(mode="after")
    def _method_fits_placement_and_source(self) -> DrafterSpec:
        allowed = METHODS_BY_PLACEMENT[self.placement]
        if self.method not in allowed:
            raise ValueError(
                f"placement: {self.placement} is allowed only for methods {', '.join(allowed)}, "
                f"not {self.method}"
            )
        if self.method in METHODS_NEEDING_SOURCE and self.source is None:
            raise ValueError(f"source: required for method {self.method}")
        if self.method in METHODS_WITHOUT_WEIGHTS and self.source is not None:
            raise ValueError(f"source: must not be set for method {self.method} (it has no weights)")
        if self.parallel_drafting and (
            self.method not in PARALLEL_DRAFTING_METHODS or self.placement != "colocated"
        ):
            raise ValueError(
                f"parallelDrafting: allowed only for colocated {', '.join(PARALLEL_DRAFTING_METHODS)} "
                f"drafters, not {self.method} ({self.placement})"
            )
        return self


class SpeculationSpec(_Model):
    """The speculation policy the controller enforces."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "duration(self.evaluationInterval) >= duration('1s')",
                    "evaluationInterval must be at least 1s",
                    ".evaluationInterval",
                ),
            ]
        }
    )

    mode: SpeculationMode = Field(
        default="auto",
        description="auto: the controller decides per batch-size bucket, the pods decoding plain (K 0) "
        "until it does; advise: it decides as in auto but changes nothing (status.recommendation, Events "
        "and metrics show what it would do), the pods keep what they run (plain from the start); on: "
        "always speculate with the default drafter at its maximum K; off: never speculate.",
    )
    default_drafter: str | None = Field(
        default=None,
        max_length=63,
        alias="defaultDrafter",
        description=(
            "The drafter pods start with, until the controller chooses another (status.activeDrafter, "
            "which later renders keep); must name one of spec.drafters; unset: the first."
        ),
    )
    batch_buckets: list[Annotated[int, Field(ge=1, le=65536)]] = Field(
        default_factory=lambda: list(DEFAULT_BUCKETS),
        min_length=1,
        max_length=MAX_BUCKETS,
        alias="batchBuckets",
        description="Upper bounds of the batch-size buckets, strictly increasing; K is chosen per bucket.",
        json_schema_extra={
            "x-kubernetes-list-type": "set",
            "x-kubernetes-validations": [
                _cel(
                    "self.isSorted() && self.all(b, self.exists_one(c, c == b))",
                    "batchBuckets must be strictly increasing",
                ),
            ],
        },
    )
    mal_floor: float = Field(
        default=2.0,
        gt=1.0,
        le=17.0,
        alias="malFloor",
        description=(
            "Mean accepted length below which a drafter is demoted unless it still pays (minGain), "
            "and the alert fires."
        ),
    )
    min_gain: float = Field(
        default=1.1,
        ge=1.0,
        le=10.0,
        alias="minGain",
        description="Speculate in a bucket only where predicted goodput gains at least this factor.",
    )
    evaluation_interval: Duration = Field(
        default="30s", alias="evaluationInterval", description="How often the controller re-decides."
    )
    cooldown: Duration = Field(
        default="5m", description="Least time between two changes of one kind (hysteresis, no flapping)."
    )
    warmup_requests: int = Field(
        default=50,
        ge=0,
        le=100_000,
        alias="warmupRequests",
        description="Synthetic requests that warm a fresh drafter before it takes traffic.",
    )
    exploration_share: float = Field(
        default=0.05,
        ge=0.0,
        le=0.5,
        alias="explorationShare",
        description="Share of steps kept speculating where it is off, so acceptance stays measured.",
    )
    shadow_share: float = Field(
        default=0.05,
        ge=0.0,
        le=0.5,
        alias="shadowShare",
        description="Share of each engine connection's time the sidecar's drafters not in force may spend "
        "drafting in the shadow, so every hosted drafter's acceptance is measured on the live traffic "
        "(0 turns it off).",
    )

    @field_validator("batch_buckets")
    @classmethod
    def _strictly_increasing(cls, buckets: list[int]) -> list[int]:
        for a, b in itertools.pairwise(buckets):
            if b <= a:
                raise ValueError(f"must be strictly increasing ({a} then {b})")
        return buckets

    @field_validator("evaluation_interval", "cooldown")
    @classmethod
    def _parses(cls, text: str) -> str:
        parse_duration(text)
        return text

    @field_validator("evaluation_interval")
    @classmethod
    def _at_least_a_second(cls, text: str) -> str:
        if parse_duration(text) < 1.0:
            raise ValueError("must be at least 1s")
        return text

    @property
    def evaluation_interval_seconds(self) -> float:
        return parse_duration(self.evaluation_interval)

    @property
    def cooldown_seconds(self) -> float:
        return parse_duration(self.cooldown)


class MonitoringSpec(_Model):
    prometheus_url: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^https?://[^\s]+$",
        alias="prometheusUrl",
        description="The Prometheus the controller queries; unset: the operator's default.",
    )
    service_monitor: bool = Field(
        default=True,
        alias="serviceMonitor",
        description="Create a ServiceMonitor (when the Prometheus Operator's CRDs exist).",
    )


class SpeculativeServingSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.engine.gpu.count == 0 || self.engine.gpu.count >= self.model.tensorParallelSize",
                    "engine.gpu.count must be 0 (CPUs) or at least model.tensorParallelSize",
                    ".engine.gpu.count",
                ),
                _cel(
                    "self.drafters.all(d, self.drafters.exists_one(e, e.name == d.name))",
                    "drafter names must be unique",
                    ".drafters",
                ),
                _cel(
                    "!has(self.speculation.defaultDrafter) || "
                    "self.drafters.exists(d, d.name == self.speculation.defaultDrafter)",
                    "speculation.defaultDrafter must name one of spec.drafters",
                    ".speculation.defaultDrafter",
                ),
                _cel(
                    "self.speculation.mode == 'off' || size(self.drafters) > 0",
                    "speculation.mode auto, advise or on needs at least one drafter",
                    ".drafters",
                ),
                _cel(
                    "self.drafters.all(d, d.method != 'mtp' || self.drafters.all(e, e.method != 'mtp' "
                    "|| e.name == d.name))",
                    "at most one mtp drafter (it uses the target's own MTP layers)",
                    ".drafters",
                ),
            ]
        }
    )

    replicas: int = Field(default=1, ge=0, le=1000, description="Engine pods.")
    model: ModelSpec = Field(description="The target model.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The engine container.")
    drafters: list[DrafterSpec] = Field(
        default_factory=list,
        max_length=MAX_DRAFTERS,
        description="Candidate drafters; names are unique.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    speculation: SpeculationSpec = Field(default_factory=SpeculationSpec, description="The policy.")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Metrics.")
    sidecar: SidecarSpec = Field(default_factory=SidecarSpec, description="The sidecar container.")

    @model_validator(mode="after")
    def _cross_field(self) -> SpeculativeServingSpec:
        if 0 < self.engine.gpu.count < self.model.tensor_parallel_size:
            raise ValueError(
                f"engine.gpu.count: {self.engine.gpu.count} GPUs cannot hold tensorParallelSize "
                f"{self.model.tensor_parallel_size}"
            )
        seen: set[str] = set()
        for i, drafter in enumerate(self.drafters):
            if drafter.name in seen:
                raise ValueError(f"drafters[{i}].name: duplicate drafter name {drafter.name!r}")
            seen.add(drafter.name)
        default = self.speculation.default_drafter
        if default is not None and default not in seen:
            raise ValueError(
                f"speculation.defaultDrafter: {default!r} names no drafter "
                f"(drafters: {', '.join(sorted(seen)) or 'none'})"
            )
        if self.speculation.mode != "off" and not self.drafters:
            raise ValueError(f"drafters: speculation.mode {self.speculation.mode} needs at least one drafter")
        if sum(d.method == "mtp" for d in self.drafters) > 1:
            raise ValueError("drafters: at most one mtp drafter (it uses the target's own MTP layers)")
        return self

    @property
    def initial_drafter(self) -> DrafterSpec | None:
        """The drafter pods start with: defaultDrafter, else the first one."""
        if not self.drafters:
            return None
        name = self.speculation.default_drafter
        return next((d for d in self.drafters if d.name == name), self.drafters[0])

    def drafter(self, name: str) -> DrafterSpec:
        for d in self.drafters:
            if d.name == name:
                return d
        raise KeyError(name)


# ---- status (written by the operator and the controller) -------------------------------------------


class Condition(_Model):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: str = Field(min_length=1, max_length=316, description="Ready, Deployed, Invalid, ...")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        default="",
        max_length=1024,
        description="CamelCase machine-readable reason.",
        pattern=r"^([A-Za-z]\w*)?$",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: datetime | None = Field(
        default=None, alias="lastTransitionTime", description="When status last changed."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, alias="observedGeneration", description="The generation this condition is about."
    )


class FleetStatus(_Model):
    mal: dict[str, float] = Field(default_factory=dict, description="Mean accepted length per bucket.")
    mean_accepted_length: float | None = Field(
        default=None, ge=0, alias="meanAcceptedLength", description="Fleet-wide MAL over all buckets."
    )
    acceptance_rate: float | None = Field(
        default=None, ge=0.0, le=1.0, alias="acceptanceRate", description="Fleet-wide draft acceptance."
    )
    gpu_utilization: float | None = Field(
        default=None, ge=0.0, le=1.0, alias="gpuUtilization", description="Mean GPU utilisation (0..1)."
    )


class PodStatus(_Model):
    name: str = Field(description="Pod name.")
    drafter: str | None = Field(default=None, description="The drafter in force in the pod.")
    policy_version: int | None = Field(
        default=None,
        ge=0,
        alias="policyVersion",
        description="The policy version the pod reports in force (its sidecar's metrics).",
    )
    speculating: bool | None = Field(default=None, description="Whether the pod speculates now.")
    batch_size: float | None = Field(default=None, ge=0, alias="batchSize", description="Mean batch size.")
    mal: float | None = Field(default=None, ge=0, description="The pod's mean accepted length.")


class Decision(_Model):
    time: datetime = Field(description="When the controller decided.")
    action: str = Field(max_length=63, description="e.g. enable, disable, setK, switchDrafter, hold.")
    reason: str = Field(default="", max_length=1024, description="Why, in words.")


class Recommendation(_Model):
    """What the controller would put in force (speculation.mode advise), or has put (auto)."""

    mode: SpeculationMode = Field(description="The mode the recommendation was made in.")
    drafter: str = Field(max_length=63, description="The drafter it recommends.")
    k_by_bucket: dict[str, int] = Field(
        default_factory=dict, alias="kByBucket", description="K it recommends per bucket (0 = off)."
    )
    cliff_batch_size: int | None = Field(
        default=None, ge=0, alias="cliffBatchSize", description="Predicted first batch size not worth it."
    )
    predicted_gain: float | None = Field(
        default=None,
        ge=0,
        alias="predictedGain",
        description="Predicted goodput of the recommendation relative to no speculation (1 = equal).",
    )
    action: str = Field(max_length=63, description="The decision it would take: setK, switchDrafter, ...")
    reason: str = Field(default="", max_length=1024, description="Why, in words.")
    time: datetime = Field(description="When it was made.")


class SpeculativeServingStatus(_Model):
    phase: Phase | None = Field(default=None, description="Pending, Deploying, Ready, Degraded or Failed.")
    observed_generation: int | None = Field(
        default=None, ge=0, alias="observedGeneration", description="The generation last deployed."
    )
    replicas: int | None = Field(default=None, ge=0, description="Engine pods that exist.")
    ready_replicas: int | None = Field(
        default=None, ge=0, alias="readyReplicas", description="Engine pods ready (warm) for traffic."
    )
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    active_drafter: str | None = Field(
        default=None, alias="activeDrafter", description="The drafter the controller has put in force."
    )
    k_by_bucket: dict[str, int] | None = Field(
        default=None, alias="kByBucket", description="K in force per batch-size bucket (0 = off)."
    )
    cliff_batch_size: int | None = Field(
        default=None, ge=0, alias="cliffBatchSize", description="First batch size where speculation stops."
    )
    fleet: FleetStatus | None = Field(default=None, description="Fleet-wide measurements.")
    pods: list[PodStatus] | None = Field(default=None, description="Per-pod state.")
    last_decision: Decision | None = Field(
        default=None, alias="lastDecision", description="The controller's last decision."
    )
    policy_version: int | None = Field(
        default=None, ge=0, alias="policyVersion", description="Version of the policy last pushed to pods."
    )
    recommendation: Recommendation | None = Field(
        default=None, description="The controller's latest recommendation (what advise mode would apply)."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        description="Deployed, Ready, Invalid, MetricsAvailable, SpeculationHealthy, ...",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = ""
    namespace: str | None = None


class SpeculativeServing(_Model):
    """A whole resource as the API server holds it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["specserve.io/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["SpeculativeServing"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: SpeculativeServingSpec
    status: SpeculativeServingStatus | None = None


MAX_NAME_LENGTH = 49  # room for the longest child suffix ("-control-token") in a 63-character name


def name_error(name: str) -> str | None:
    """Why a resource name cannot be used for its children, or None."""
    if len(name) > MAX_NAME_LENGTH:
        return f"metadata.name: {len(name)} characters, at most {MAX_NAME_LENGTH} (children add suffixes)"
    if not re.fullmatch(DNS_LABEL_PATTERN, name):
        return f"metadata.name: {name!r} must be a DNS label (lower-case letters, digits, '-')"
    return None


def describe_error(exc: ValidationError, prefix: str = "spec") -> str:
    """One line per problem, each naming the field: `spec.drafters[1].placement: ...`."""
    lines = []
    for err in exc.errors():
        path = prefix
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        message = err["msg"]
        if message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
            # A model-level rule names its field itself ("drafters[0].name: ...").
            field, sep, rest = message.partition(": ")
            if sep and re.fullmatch(r"[A-Za-z][\w.\[\]]*", field):
                path, message = f"{path}.{field}", rest
        lines.append(f"{path}: {message}")
    return "; ".join(lines)


def parse_spec(spec: dict[str, Any]) -> SpeculativeServingSpec:
    """Validate a resource's spec (raises pydantic's ValidationError)."""
    return SpeculativeServingSpec.model_validate(spec)
