#!/usr/bin/env bash
# Run here (the CPU machine), once per checkout: downloads into .whl/ (git-ignored) the wheels the H200's image
# lacks, at the versions .venv holds: grain and its needs, tokamax and its needs, tensorboardX. Every device call
# that needs them passes carry [".whl"]; scripts/h200/env.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS=(grain array_record portpicker tokamax immutabledict qwix pydantic pydantic_core annotated-types
      typing-inspection einshape tensorboardX ${EXTRA:-})  # EXTRA: more names, e.g. MaxText's train-loop imports
pins=()
for p in "${PKGS[@]}"; do
  v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "scripts/h200/wheels.sh: $p is not in .venv; run scripts/setup.sh first" >&2; exit 1; }
  pins+=("$p==$v")
done
mkdir -p .whl
for pin in "${pins[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any -d .whl "$pin"
done
du -sh .whl
