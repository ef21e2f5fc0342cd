"""Pure rendering: a SpeculativeServing spec → the Kubernetes objects that run it (no I/O)."""
