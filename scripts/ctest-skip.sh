# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/stress-tests.sh: the labels the
# release run leaves out, as one ctest -LE regex (ctest ANDs repeated -LE
# options). fuzz: the fuzzers' own step; nightly: the long matrices
# (ctest -L nightly); gpu: only where a GPU is visible.
td_ctest_skip="fuzz|nightly"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  td_ctest_skip="$td_ctest_skip|gpu"
fi
