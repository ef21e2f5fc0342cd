"""Synthetic per-bucket loads for the controller tests (the BucketLoad fixture of tests/tuner/conftest.py)."""

from __future__ import annotations

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
