#!/usr/bin/env bash
# Fails if any C source differs from what clang-format makes of it.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.c' '*.h' '*.cu' '*.cuh')
[ -n "$files" ] || exit 0
bad=0
for f in $files; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "format: $f differs from clang-format (run clang-format -i $f)"
    bad=1
  fi
done
exit $bad
