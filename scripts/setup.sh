#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs clis-train with its test extras,
# pinned by constraints.txt (jax/jaxlib 0.11.2, the GPU machine's versions).
# Also .venv-hf: Python 3.11 with the CPU torch wheel and transformers, which only the
# Hugging Face comparison test uses (scripts/hf_reference.py).
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
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,bench,maxtext]"
.venv/bin/python -c "import jax, clis_kernels, clis_train; print('setup ok: jax', jax.__version__)"

find_python311() {
  for cand in python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3.11 /usr/bin/python3.11; do
    if command -v "$cand" >/dev/null 2>&1; then command -v "$cand"; return 0; fi
  done
  echo "scripts/setup.sh: no python3.11 found for .venv-hf (torch + transformers reference)" >&2
  return 1
}
if [ ! -x .venv-hf/bin/python ] || ! .venv-hf/bin/python -c "import torch, transformers" 2>/dev/null; then
  "$(find_python311)" -m venv .venv-hf
  .venv-hf/bin/python -m pip install -q --upgrade pip
  .venv-hf/bin/python -m pip install -q "torch==2.13.0" "transformers==5.24.0" "safetensors>=0.4" numpy
fi
