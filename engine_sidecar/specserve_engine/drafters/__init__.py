"""The sidecar's drafters, built from the drafter entries of the sidecar's configuration."""

from __future__ import annotations

from specserve_engine.api import SidecarDrafter
from specserve_engine.drafters.base import Drafter, DrafterError, Seq
from specserve_engine.drafters.model import ModelDrafter
from specserve_engine.drafters.ngram import NgramDrafter
from specserve_engine.drafters.suffix import SuffixDrafter

# Methods the sidecar can host (placement `sidecar` or `separateGpu`).
SIDECAR_METHODS = ("ngram", "suffix", "draftModel", "selfSpeculative")

__all__ = ["SIDECAR_METHODS", "Drafter", "DrafterError", "Seq", "build_drafter"]


def build_drafter(spec: SidecarDrafter, model_path: str, device: str = "cpu") -> Drafter:
    """A drafter for one configuration entry (not loaded yet: call `load()`, it may be slow)."""
    k = spec.max_speculative_tokens
    if spec.method == "ngram":
        return NgramDrafter(spec.name, k)
    if spec.method == "suffix":
        return SuffixDrafter(spec.name, k)
    if spec.method == "draftModel":
        if not spec.source:
            raise DrafterError(f"drafter {spec.name}: method draftModel needs a source (a local model path)")
        return ModelDrafter(spec.name, spec.method, k, spec.source, device=device)
    if spec.method == "selfSpeculative":
        # The target's own checkpoint unless the entry names another copy of it.
        return ModelDrafter(spec.name, spec.method, k, spec.source or model_path, spec.layers, device)
    raise DrafterError(
        f"drafter {spec.name}: method {spec.method!r} cannot be hosted by the sidecar "
        f"(sidecar methods: {', '.join(SIDECAR_METHODS)})"
    )
