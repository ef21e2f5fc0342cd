"""Step-time cost model: a roofline prior for a decode step, which measured step times then calibrate.

A decode step that verifies `n` tokens for each of `B` sequences reads every weight once and each
sequence's KV cache once, and does about 2·params FLOPs per token; it takes the longer of the two
(memory or compute) plus a fixed per-step overhead. Speculation adds the drafter's time.

GPU figures (docs/policy.md, "Step time: a roofline prior, calibrated by measurement"): H200 bandwidth
and FLOP rate are the ones measured on an H200 (about 4.3 TB/s of the 4.8 TB/s datasheet, about
790 TFLOP/s dense bf16). H100 shares the H200's compute silicon, so it takes the same FLOP rate, and its
3.35 TB/s datasheet bandwidth scaled by the same 4.3/4.8 ratio. Any other GPU starts from GENERIC_GPU,
a modest data-centre GPU (docs/policy.md, "GPUs the cost model does not know"): measurements calibrate it
as they calibrate the others, and the resource says so in a condition.
An H200 recording since (docs/policy.md, "GPU figures") confirms the FLOP rate and streams the 8B's weights
at 3.2 TB/s, not 4.3: the prior keeps its figures, and measured step times correct it as on any fleet.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes_per_s: float  # achievable, not datasheet
    flops_per_s: float  # achievable dense bf16
    step_overhead_s: float  # launch, scheduling and sampling per engine step


GPUS: dict[str, GpuSpec] = {
    "H200": GpuSpec("H200", hbm_bytes_per_s=4.3e12, flops_per_s=790e12, step_overhead_s=1.0e-3),
    "H100": GpuSpec("H100", hbm_bytes_per_s=3.0e12, flops_per_s=790e12, step_overhead_s=1.0e-3),
}


# About an A100 40GB (1.55 TB/s, 312 TFLOP/s datasheet) at the H200's achieved share of each: slower
# than either known GPU, so an unknown one is not promised more than it gives before it is measured.
GENERIC_GPU = GpuSpec("generic", hbm_bytes_per_s=1.4e12, flops_per_s=250e12, step_overhead_s=1.0e-3)


def known_gpu(product: str | None) -> GpuSpec | None:
    """The GPU for a node-label product name such as `NVIDIA-H200` or `NVIDIA-H100-80GB-HBM3`, if the cost
    model has figures for it."""
    for key, spec in GPUS.items():
        if product and key in product.upper():
            return spec
    return None


def gpu_spec(product: str | None) -> GpuSpec:
    """The GPU's figures, GENERIC_GPU's for one the cost model does not know."""
    return known_gpu(product) or GENERIC_GPU


@dataclass(frozen=True)
class ModelShape:
    """What a step reads and computes: dense decoder, weights at `bytes_per_param`, GQA KV cache."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_elem: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem


MODELS: dict[str, ModelShape] = {
    "8b": ModelShape("llama-3.1-8b", params=8.0e9, layers=32, hidden=4096, kv_heads=8, head_dim=128),
    "70b": ModelShape("llama-3.1-70b", params=70.6e9, layers=80, hidden=8192, kv_heads=8, head_dim=128),
    "1b": ModelShape("llama-3.2-1b", params=1.24e9, layers=16, hidden=2048, kv_heads=8, head_dim=64),
}

_SIZE = re.compile(r"(?<![0-9.])([0-9]+(?:\.[0-9]+)?)\s*b\b", re.IGNORECASE)


def model_shape(name: str) -> ModelShape:
    """The shape for a served model name, by the parameter count in it ("llama-3.1-70b-instruct")."""
    for match in _SIZE.finditer(name.replace("_", "-")):
        size = match.group(1).lower()
        if size in {"8", "70", "1"}:
            return MODELS[f"{size}b"]
        # An unknown size: a dense model scaled from the 8B shape keeps bytes and FLOPs right.
        params = float(size) * 1e9
        base = MODELS["8b"]
        return ModelShape(name, params, base.layers, base.hidden, base.kv_heads, base.head_dim)
    return MODELS["8b"]


def verify_step_s(
    model: ModelShape, gpu: GpuSpec, batch: float, tokens_per_seq: float, context_len: float, tp: int = 1
) -> float:
    """Roofline time of one target step over `batch` sequences, each with `tokens_per_seq` query tokens."""
    tokens = batch * tokens_per_seq
    flops = 2.0 * model.params * tokens + 4.0 * model.layers * model.hidden * context_len * tokens
    bytes_moved = model.weight_bytes + batch * (context_len + tokens_per_seq) * model.kv_bytes_per_token
    return max(flops / (gpu.flops_per_s * tp), bytes_moved / (gpu.hbm_bytes_per_s * tp)) + gpu.step_overhead_s


DraftKind = Literal["model", "parallel", "cpu"]


@dataclass(frozen=True)
class DrafterCost:
    """How drafting K tokens costs time: `model` runs a small model K times in sequence, `parallel`
    drafts all K in one pass (Medusa heads, P-EAGLE), `cpu` is a lookup (n-gram, suffix). MTP counts as
    `model`: vLLM runs the MTP layer once per drafted token."""

    kind: DraftKind
    shape: ModelShape | None = None
    cpu_s_per_token: float = 2.0e-5  # per sequence and draft token, for lookups
    step_overhead_s: float = 1.0e-4  # a draft pass is a captured graph: far less overhead than a step

    def draft_s(self, gpu: GpuSpec, batch: float, k: int, context_len: float) -> float:
        if k <= 0:
            return 0.0
        if self.kind == "cpu" or self.shape is None:
            return self.cpu_s_per_token * batch * k
        one = (
            verify_step_s(self.shape, gpu, batch, 1, context_len) - gpu.step_overhead_s + self.step_overhead_s
        )
        return one if self.kind == "parallel" else k * one


# EAGLE-style head on an 8B target: one decoder layer plus the LM head (~0.75B parameters).
EAGLE_HEAD_8B = ModelShape("eagle3-head-8b", params=0.75e9, layers=1, hidden=4096, kv_heads=8, head_dim=128)

DRAFTER_COSTS: dict[str, DrafterCost] = {
    "eagle": DrafterCost("model", EAGLE_HEAD_8B),
    "eagle3": DrafterCost("model", EAGLE_HEAD_8B),
    "medusa": DrafterCost("parallel", EAGLE_HEAD_8B),
    "mtp": DrafterCost("model", EAGLE_HEAD_8B),
    "draftModel": DrafterCost("model", MODELS["1b"]),
    "selfSpeculative": DrafterCost("model", MODELS["1b"]),
    "ngram": DrafterCost("cpu"),
    "suffix": DrafterCost("cpu"),
}


def drafter_cost(method: str, parallel_drafting: bool = False) -> DrafterCost:
    """The method's draft cost; with parallel drafting (P-EAGLE) the head drafts all K in one pass."""
    try:
        cost = DRAFTER_COSTS[method]
    except KeyError:
        raise ValueError(f"drafters[].method: unknown method {method!r}") from None
    return dataclasses.replace(cost, kind="parallel") if parallel_drafting else cost


@dataclass(frozen=True)
class StepCostPrior:
    """The prior step time of one (model, drafter, GPU) group at a typical context length."""

    model: ModelShape
    gpu: GpuSpec
    drafter: DrafterCost
    context_len: float = 1024.0
    tp: int = 1

    def step_s(self, batch: float, k: int) -> float:
        """Time of one engine step at batch `batch` with K = `k` (0 = plain decoding)."""
        t = verify_step_s(self.model, self.gpu, batch, k + 1, self.context_len, self.tp)
        return t + self.drafter.draft_s(self.gpu, batch, k, self.context_len)
