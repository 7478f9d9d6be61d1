#!/usr/bin/env bash
# Hostile command lines, one per line of cli_cases.txt (or $CASES), each run with a 120 s limit in a
# scratch folder that holds the odd input files the cases name. Prints one verdict line per case:
# ok (a non-zero exit, no traceback), EXIT0, TIMEOUT or TRACEBACK, with the first two stderr lines.
# Usage (from the repository root): docs/testing/bad-input-sweep/run_cli.sh > results.txt
set -u
here="$(cd "$(dirname "$0")" && pwd)"
KV="${KVLENS:-$(pwd)/.venv/bin/kvlens}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
printf '{"a": 1' > bad.json
printf '[1,2]' > list.json
printf '{"version": 1, "layers": []}' > recipe_empty.json
head -c 3000 /dev/urandom > bin.txt
: > empty.txt
printf '[sweep\nx=' > bad.toml
i=0
while IFS= read -r line; do
  [ -z "$line" ] && continue
  i=$((i + 1))
  eval "set -- $line"
  timeout 120 "$KV" "$@" > out 2> err < /dev/null
  rc=$?
  verdict=ok
  [ "$rc" = 0 ] && verdict=EXIT0
  [ "$rc" = 124 ] && verdict=TIMEOUT
  grep -q Traceback err && verdict=TRACEBACK
  first="$(grep -v '^\s*$' err | grep -v 'compiling kernels\|sensitivity: layer' | head -2 | tr '\n' '|' | cut -c1-200)"
  echo "$i [$verdict rc=$rc stdout=$(grep -c . out) lines] $line :: $first"
done < "${CASES:-$here/cli_cases.txt}"
