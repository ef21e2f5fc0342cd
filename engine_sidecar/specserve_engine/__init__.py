"""specserve's engine side: what runs in each GPU pod (vLLM plugins, the speculative engine sidecar).

The operator imports this package's API models and client; this package never imports the operator.
"""
