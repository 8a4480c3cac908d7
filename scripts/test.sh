#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite (CPU; Pallas kernels in interpret mode).
#   scripts/test.sh            everything (what CI runs)
#   scripts/test.sh --fast     leaves out tests marked slow (tests/conftest.py lists them): the edit-test loop
# Other arguments go to pytest. Tests run in two pytest-xdist workers (CI's machine has two cores; every test seeds
# its own randomness, so the split changes no result); pass -n 0 to run them in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=(-n 2)
export CLIS_REQUIRE_HF=1  # the full run fails (not skips) the Hugging Face tests without .venv-hf
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then args+=(-m "not slow"); unset CLIS_REQUIRE_HF
  else args+=("$arg"); fi
done
# One persistent compilation cache per run: the subprocesses (fault children, scripts) and both workers compile many
# of the same programs (the SIGKILL test: 46 -> 34 s); a fresh directory keeps runs independent.
cache=""
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then cache=$(mktemp -d); export JAX_COMPILATION_CACHE_DIR=$cache; fi
status=0
.venv/bin/python -m pytest -q --durations=40 "${args[@]}" || status=$?
[ -z "$cache" ] || rm -rf "$cache"
exit $status
