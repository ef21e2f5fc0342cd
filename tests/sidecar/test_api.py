"""The sidecar's wire models (api.py)."""

from __future__ import annotations

from specserve_engine.api import PolicyRequest


def test_a_policy_request_reads_k_per_bucket_and_zero_for_a_bucket_it_leaves_out() -> None:
    req = PolicyRequest.model_validate(
        {"policyVersion": 4, "drafter": "ngram", "mode": "on", "kByBucket": {"1": 2, "2": 2, "4": 1}}
    )
    assert req.k_for_bucket("1") == 2 and req.k_for_bucket("8") == 0
