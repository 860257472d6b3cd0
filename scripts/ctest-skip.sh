# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/stress-tests.sh: the labels the
# release run leaves out, as one ctest -LE regex (ctest ANDs repeated -LE
# options). fuzz: the fuzzers' own step; nightly: the long matrices
# (ctest -L nightly). The gpu tests always run: where no GPU is visible (or
# the build has no CUDA) they exit 77 and ctest reports them as skipped.
# shellcheck disable=SC2034 # read by the scripts that source this file
td_ctest_skip="fuzz|nightly"
