"""Plugins that run inside vLLM: the live-policy scheduler, the per-batch-size stat logger and the
sidecar proposer (a `custom_class` drafter)."""
