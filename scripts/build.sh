#!/usr/bin/env bash
# Configures and builds Tandem into ./build (or $1). Extra arguments after the
# build directory go to cmake, e.g. scripts/build.sh build-asan -DTD_SANITIZE=address,undefined
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -DTD_WERROR=ON "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)"
