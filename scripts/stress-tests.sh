#!/usr/bin/env bash
# Finds the tests that fail under load. Runs the release suite (the tests
# scripts/test.sh runs in its release step, ctest -j $(nproc)) N times in a
# row; every second run has two extra processes spinning on the cores the
# whole time. Prints every test that failed at least once with its failure
# count, and exits 1 if any did.
#
#   scripts/stress-tests.sh [N] [BUILD_DIR]     N runs (default 6), ./build
#
# Runs 1, 3, 5, ... are plain, runs 2, 4, 6, ... under load. BUILD_DIR is
# built first (scripts/build.sh); run scripts/setup.sh once before. Each
# run's ctest output (with the failures' output in full) is kept in
# BUILD_DIR/stress/run-K.log.
# TD_STRESS_REGEX=R keeps the tests matching R (ctest -R), and
# TD_STRESS_LOAD=always puts every run under load, to repeat one suite:
#   TD_STRESS_REGEX=py_test_router TD_STRESS_LOAD=always scripts/stress-tests.sh 20
# TD_STRESS_SANITIZE=1 runs the sanitizer build instead (BUILD_DIR default
# ./build-asan), configured, run and filtered as scripts/test.sh's step 4.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-6}
asan=${TD_STRESS_SANITIZE:-0}
if [ "$asan" = 1 ]; then dir=${2:-build-asan}; else dir=${2:-build}; fi
case $n in '' | *[!0-9]* | 0)
  echo "usage: scripts/stress-tests.sh [N >= 1] [BUILD_DIR]" >&2
  exit 2
  ;;
esac
jobs=$(nproc)
# shellcheck source=scripts/ctest-skip.sh
. scripts/ctest-skip.sh

run_env=()
skip=$td_ctest_skip
if [ "$asan" = 1 ]; then
  scripts/build.sh "$dir" "${td_asan_cmake[@]}"
  run_env=("${td_asan_env[@]}")
  skip="$skip|$td_asan_skip"
else
  scripts/build.sh "$dir"
fi
out="$dir/stress"
mkdir -p "$out"
rm -f "$out"/run-*.log

spinners=()
stop_spinners() {
  for p in "${spinners[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${spinners[@]}"; do wait "$p" 2>/dev/null || true; done
  spinners=()
}
trap stop_spinners EXIT
trap 'exit 130' INT TERM

declare -A fails=()
summary=()
args=(--output-on-failure --timeout 1200 -j "$jobs" -LE "$skip")
if [ -n "${TD_STRESS_REGEX:-}" ]; then args+=(-R "$TD_STRESS_REGEX"); fi
for ((k = 1; k <= n; k++)); do
  mode=plain
  if ((k % 2 == 0)) || [ "${TD_STRESS_LOAD:-}" = always ]; then
    mode="2 spinners"
    for _ in 1 2; do
      bash -c 'while :; do :; done' &
      spinners+=($!)
    done
  fi
  log="$out/run-$k.log"
  printf '=== run %d/%d (%s) ===\n' "$k" "$n" "$mode"
  t0=$(date +%s)
  rc=0
  (cd "$dir" && env "${run_env[@]}" ctest "${args[@]}") >"$log" 2>&1 || rc=$?
  t1=$(date +%s)
  stop_spinners
  # ctest's summary: "The following tests FAILED:" then "\t 12 - name (Failed)"
  failed=$(awk '/^The following tests FAILED:/ {on = 1; next}
                on && /^[[:space:]]+[0-9]+ - / {print $3}' "$log")
  line=$(grep -E '^[0-9]+% tests passed' "$log" || echo "ctest exited $rc without a summary")
  summary+=("run $k ($mode, $((t1 - t0)) s): $line")
  printf '%s\n' "${summary[-1]}"
  if [ "$rc" != 0 ] && [ -z "$failed" ]; then failed="(ctest-exit-$rc)"; fi
  for t in $failed; do
    fails[$t]=$((${fails[$t]:-0} + 1))
    printf '  failed: %s\n' "$t"
  done
done

printf '\n=== stress summary: %d runs of the %s suite, -j %d (logs in %s) ===\n' "$n" "$([ "$asan" = 1 ] && echo sanitizer || echo release)" "$jobs" "$out"
printf '%s\n' "${summary[@]}"
if [ "${#fails[@]}" = 0 ]; then
  echo "every test passed on every run"
  exit 0
fi
echo "tests that failed at least once (failures of $n runs):"
for t in "${!fails[@]}"; do printf '  %3d  %s\n' "${fails[$t]}" "$t"; done | sort -k1,1nr -k2
exit 1
