"""Synthetic per-bucket loads for the controller tests (the BucketLoad fixture of tests/tuner/conftest.py)."""

from __future__ import annotations


def loads_at_prior(bucket_load, prior, k: int = 3) -> dict:
    """Plain and speculative steps in three buckets, each as fast as the prior predicts."""
    return {
        label: bucket_load(
            batch=batch,
            steps_plain=1000,
            step_s_plain=prior.step_s(batch, 0),
            steps_spec=1000,
            step_s_spec=prior.step_s(batch, k),
            k=k,
        )
        for label, batch in (("4", 3.0), ("16", 12.0), ("64", 48.0))
    }
