"""The tiny sidecar-hosted pod that tests/sidecar/test_sidecar_engine.py checks and
benchmarks/engine_bench.py measures: its drafters over the tiny models, its buckets and its policies.
One definition, so the benchmark measures the pod the tests check."""

from __future__ import annotations

from pathlib import Path

from specserve_engine.api import PolicyRequest, SidecarConfig, SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.launch import free_port
from specserve_testing.engines import DRAFT, TARGET

MAX_K = 4
BUCKETS = (1, 2, 4, 8, 16, 32)
# 32, not the colocated test engines' 128: the sidecar drafts a whole batch within the engine's deadline
# (250 ms in the tests); at 128 on two cores self-speculation missed it in most steps of the sampling
# checks (0.07-0.15 drafts per tested token).
MAX_NUM_SEQS = 32
# Sidecar drafters: name -> (method, source, layers).
SIDECAR_DRAFTERS: dict[str, tuple[str, str | None, int | None]] = {
    "ngram": ("ngram", None, None),
    "suffix": ("suffix", None, None),
    "tiny-draft": ("draftModel", str(DRAFT), None),
    "self": ("selfSpeculative", None, 1),
}
# The engine's own view of its drafter: the custom_class proposer that asks the sidecar.
ENGINE_DRAFTER = SidecarDrafter(
    name="sidecar", method="ngram", maxSpeculativeTokens=MAX_K, placement="sidecar"
)


def full_k_policy(version: int, drafter: str, k: int = MAX_K, mode: str = "on") -> PolicyRequest:
    """A policy with the same K in every bucket."""
    return PolicyRequest(
        policyVersion=version, drafter=drafter, mode=mode, kByBucket={b: k for b in bucket_labels(BUCKETS)}
    )


def sidecar_config(runtime_dir: Path) -> SidecarConfig:
    drafters = [
        SidecarDrafter(
            name=name,
            method=method,
            source=source,
            layers=layers,
            maxSpeculativeTokens=MAX_K,
            placement="sidecar",
        )
        for name, (method, source, layers) in SIDECAR_DRAFTERS.items()
    ]
    return SidecarConfig(
        modelName="tiny-sidecar",
        modelPath=str(TARGET),
        drafters=drafters,
        bucketBounds=list(BUCKETS),
        runtimeDir=str(runtime_dir),
        host="127.0.0.1",
        port=free_port(),
        warmupRequests=8,
        initialPolicy=full_k_policy(1, "ngram"),
    )
