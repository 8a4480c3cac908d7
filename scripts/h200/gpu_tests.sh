#!/usr/bin/env bash
# The GPU tests (pytest -m gpu: the Mosaic GPU and Triton kernels compiled, against float64) on the H200.
#   source scripts/h200/env.sh && bash scripts/h200/gpu_tests.sh [LIMIT_S] [pytest args, default: tests]
# carry [".whl"]. Prints the failures; the whole log comes back as $OUT/gpu_tests.log.
limit=${1:-540}
shift || true
TAIL=25 step gpu_tests "$limit" $GPU_TEST "${@:-tests}"
