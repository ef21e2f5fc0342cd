"""Synthetic per-bucket loads for the controller tests (the BucketLoad fixture of tests/tuner/conftest.py)."""

from __future__ import annotations

from specserve_operator.tuner import observations

BUCKETS = (("4", 3.0), ("16", 12.0), ("64", 48.0))  # label, batch size


def loads_at_prior(bucket_load, prior, k: int = 3, slow: float = 1.0, buckets=BUCKETS) -> dict:
    """Plain and speculative steps in each bucket, plain steps as fast as the prior predicts and
    speculative ones `slow` times slower than it."""
    return {
        label: bucket_load(
            batch=batch,
            steps_plain=1000,
            step_s_plain=prior.step_s(batch, 0),
            steps_spec=1000,
            step_s_spec=prior.step_s(batch, k) * slow,
            k=k,
        )
        for label, batch in buckets
    }


def shadow_rows(
    pod: str,
    drafter: str,
    alphas: tuple[float, ...],
    drafts: float = 400.0,
    namespace: str = "ml",
    drafted_for: float | None = None,
) -> list:
    """Per-position shadow counts as a sidecar exports them: `drafts` shadow drafts of 4 tokens, and with
    `drafted_for`, the rows shadow-drafted for (those without a proposal included)."""
    rows, survival = [], 1.0
    if drafted_for is not None:
        labels = {"namespace": namespace, "pod": pod, "drafter": drafter}
        rows.append((observations.SHADOW_ROWS, labels, drafted_for))
    for pos, alpha in enumerate(alphas):
        survival *= alpha
        labels = {"namespace": namespace, "pod": pod, "drafter": drafter, "position": str(pos)}
        rows += [
            (observations.SHADOW_PROPOSED_POS, labels, drafts),
            (observations.SHADOW_ACCEPTED_POS, labels, drafts * survival),
        ]
    return rows
