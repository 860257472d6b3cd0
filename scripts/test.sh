#!/usr/bin/env bash
# The whole test suite, installs included: what CI runs (.ci/run).
#   1. setup (Debian packages, Python test packages, default model) and the
#      real K-quant test files (scripts/fetch-test-models.sh, ~750 MB once)
#   2. format check
#   3. release build (warnings are errors), every test
#   4. sanitizer build (address,undefined), every test again
#   5. libFuzzer build, each fuzzer for a bounded time
# TD_TEST_QUICK=1 skips steps 4 and 5 (for a quick local run, never in CI).
# Strict: a pytest that skips for anything but a CPU feature or a GPU fails.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

step() { printf '\n=== %s ===\n' "$*"; }

step setup
scripts/setup.sh
scripts/fetch-test-models.sh

step format
scripts/check-format.sh

ctest_args=(--output-on-failure --timeout 1200 -j "$jobs")
# a test that skips for a prerequisite this machine has fails instead
# (tests/integration/conftest.py); a quick local run may leave it off
export TANDEM_TEST_STRICT="${TANDEM_TEST_STRICT:-1}"
# shellcheck source=scripts/ctest-skip.sh
. scripts/ctest-skip.sh
skip=$td_ctest_skip

step "release build + all tests"
scripts/build.sh build
(cd build && ctest "${ctest_args[@]}" -LE "$skip")
if [ -f build/chaos-soak-summary.txt ]; then
  step "the chaos soak's summary (tests/soak, passed above)"
  cat build/chaos-soak-summary.txt
fi

if [ "${TD_TEST_QUICK:-0}" != 1 ]; then
  # heavy: the default model's fault and load suites (tests/CMakeLists.txt).
  # Optimised (-O2 -g, asserts kept), as the sanitizers' own documentation
  # advises: at -O0 the default model's suites made this step take over
  # 50 minutes (test_invariance alone 4 minutes, 40 s at -O2).
  step "sanitizer build (address,undefined) + all tests but the heavy ones"
  scripts/build.sh build-asan "${td_asan_cmake[@]}"
  (cd build-asan && env "${td_asan_env[@]}" ctest "${ctest_args[@]}" -LE "$skip|$td_asan_skip")

  step "fuzzers (libFuzzer + address,undefined, ${TD_FUZZ_SECONDS:-60}s each)"
  CC=clang CXX=clang++ scripts/build.sh build-fuzz -DTD_FUZZ=ON -DTD_SANITIZE=address,undefined \
    -DTD_FUZZ_SECONDS="${TD_FUZZ_SECONDS:-60}" -DTD_CUDA=OFF
  (cd build-fuzz && ctest --output-on-failure -j "$jobs" -L fuzz)
fi
echo "tests: all steps passed"
