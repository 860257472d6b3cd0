# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/stress-tests.sh: the labels the
# release run leaves out, as one ctest -LE regex (ctest ANDs repeated -LE
# options). fuzz: the fuzzers' own step; nightly: the long matrices
# (ctest -L nightly). The gpu tests always run: where no GPU is visible (or
# the build has no CUDA) they exit 77 and ctest reports them as skipped.
# shellcheck disable=SC2034 # read by the scripts that source this file
td_ctest_skip="fuzz|nightly"
# The sanitizer build: its configuration, the environment its tests run
# in, and the labels it leaves out besides td_ctest_skip (heavy: the default
# model's fault and load suites, too slow under the sanitizers).
# shellcheck disable=SC2034,SC2054 # one argument: the sanitizers' list
td_asan_cmake=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTD_SANITIZE=address,undefined -DTD_CUDA=OFF)
# shellcheck disable=SC2034
td_asan_env=(UCX_MEM_MALLOC_HOOKS=no ASAN_OPTIONS=detect_leaks=1
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)
# shellcheck disable=SC2034
td_asan_skip="heavy"
