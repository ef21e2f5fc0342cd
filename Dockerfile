# syntax=docker/dockerfile:1
# Two images from one build:
#   docker build --target operator -t specserve-operator:0.1.0 .
#   docker build --target engine   -t specserve-engine:0.1.0 .
# Base images are pinned by version; pin them by digest too in your registry mirror
# (--build-arg PYTHON_IMAGE=python@sha256:… / VLLM_IMAGE=vllm/vllm-openai@sha256:…).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# --- the specserve wheel (operator and engine side in one distribution) -----------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY engine_sidecar/ engine_sidecar/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the operator: slim Python, the operator extra only, non-root, read-only friendly -------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN wheel="$(ls /wheels/specserve-*.whl)" \
    && pip install "${wheel}[operator]" \
    && rm -rf /wheels \
    && groupadd --gid 65532 specserve \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specserve
USER 65532:65532
# The chart passes `operator` and its flags as arguments.
ENTRYPOINT ["specserve"]
CMD ["operator"]

# --- the engine pod: vLLM's image plus specserve's vLLM plugins and the sidecar -------------------
FROM ${VLLM_IMAGE} AS engine
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
COPY --from=wheel /wheels /wheels
# --no-deps: vLLM's image already holds torch, pydantic, aiohttp, prometheus-client and pyyaml at the
# versions vLLM was built with; the import check fails the build if one is missing.
RUN python3 -m pip install --no-deps /wheels/specserve-*.whl \
    && rm -rf /wheels \
    && python3 -c "import specserve_engine.server, specserve_engine.vllm_plugins.stat_logger, specserve_engine.vllm_plugins.live_policy, specserve_engine.vllm_plugins.proposer" \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 0 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specserve)
# vLLM's own suffix decoding (colocated `suffix` drafters) imports arctic-inference's suffix tree, which
# ships as a source distribution: build it against the image's torch (only the C++ suffix tree without
# ARCTIC_INFERENCE_PRECOMPILED_OPS; its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED is set).
RUN python3 -m pip install nanobind==2.9.2 cmake ninja \
    && python3 -m pip install --no-build-isolation --no-deps arctic-inference==0.3.0 \
    && python3 -c "import arctic_inference.suffix_decoding"
# vLLM's entrypoint stays; the operator sets each container's command: `vllm serve …` for the engine,
# `specserve-sidecar --config …` for the sidecar, both as uid 1000.
USER 1000
