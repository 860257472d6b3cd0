#!/usr/bin/env bash
# Bit-for-bit check of a restructuring of the forward pass: builds BASE (a
# commit before it) in a git worktree beside this tree, dumps the logits of
# every golden case (tests/golden/dump_logits.py: the numerics, invariance
# and parallel-plan cases, tiny models and the default model) with both
# binaries on the same inputs, and compares them (compare_logits.py).
#
#   scripts/golden-compare.sh BASE [BUILD_DIR]   BUILD_DIR: ./build (built first)
#
# BASE's worktree and build live in BUILD_DIR/golden/ (kept, so a second run
# rebuilds only what changed); the dumps in BUILD_DIR/golden/{old,new}/.
# Goldens depend on the machine's kernels (AVX2, AVX-512, AMX): both sides
# are made here, in this run, and never committed.
# TD_GOLDEN_ONLY=REGEX limits the cases; TD_GOLDEN_NO_DEFAULT=1 leaves out
# the default model's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: scripts/golden-compare.sh BASE [BUILD_DIR]" >&2
  exit 2
fi
base=$(git rev-parse --verify "$1^{commit}")
dir=${2:-build}
root=$PWD
g="$dir/golden"
mkdir -p "$g"
g=$(cd "$g" && pwd)

scripts/build.sh "$dir"
if [ -d "$g/base-src" ]; then
  git -C "$g/base-src" checkout -q --detach "$base"
else
  git worktree add -q --detach "$g/base-src" "$base"
fi
(cd "$g/base-src" && scripts/build.sh "$g/base-build")

# One set of inputs for both: this tree's tiny models.
python3 tests/models/make_models.py --out "$g/models" >/dev/null
args=(--models "$g/models")
if [ "${TD_GOLDEN_NO_DEFAULT:-0}" != 1 ]; then
  # where the tandem binary looks (common/runtime/cli.c; scripts/setup.sh puts it there)
  args+=(--default-model "${TANDEM_MODEL:-$HOME/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}")
fi
if [ -n "${TD_GOLDEN_ONLY:-}" ]; then args+=(--only "$TD_GOLDEN_ONLY"); fi
rm -rf "$g/old" "$g/new"
export UCX_MEM_MALLOC_HOOKS=no
python3 tests/golden/dump_logits.py --tandem "$g/base-build/tandem" --out "$g/old" "${args[@]}"
python3 tests/golden/dump_logits.py --tandem "$root/$dir/tandem" --out "$g/new" "${args[@]}"
echo "old: $(git log -1 --format='%h %s' "$base" | cut -c1-72)"
echo "new: $(git describe --always --dirty)"
python3 tests/golden/compare_logits.py "$g/old" "$g/new"
