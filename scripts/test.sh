#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite (CPU; Pallas kernels in interpret mode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=15 "$@"
