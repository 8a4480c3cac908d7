#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs clis-train with its test extras,
# pinned by constraints.txt (jax/jaxlib 0.11.2, the GPU machine's versions).
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  echo "scripts/setup.sh: no python3.12 found; install Python 3.12 (JAX 0.11 needs it)" >&2
  return 1
}
if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,bench]"
.venv/bin/python -c "import jax, clis_kernels; print('setup ok: jax', jax.__version__)"
