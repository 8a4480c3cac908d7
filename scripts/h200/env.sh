# Source on the H200 from the repository root, before anything else there:
#   source scripts/h200/env.sh
# Installs the wheels carried in .whl/ (made here by scripts/h200/wheels.sh; pass carry [".whl"]) into /tmp/site,
# puts the checkout on the path (PYTHONPATH=kernels:. : clis_kernels lives in kernels/clis_kernels), and defines
# `step`, which runs one part of a call under a time limit with its log kept in $OUT.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "scripts/h200/env.sh: installing .whl/ failed" >&2
  # xprof (32 MB, imported only by tokamax's benchmarking module) does not fit the 64 MiB carry: a stub stands in.
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  echo "get_kernel_stats_tool = None  # stub: see scripts/h200/env.sh" > /tmp/site/xprof/cli/tools.py
fi
export PYTHONPATH=/tmp/site:$PWD/kernels:$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# cuda first (the default backend the tests see), cpu beside it: the Mosaic GPU profiler reads its buffer back through a
# host callback, which needs a CPU device (test_profiled_forward_writes_its_step_regions_on_gpu).
export GPU_TEST="env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rf"

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output to $OUT/NAME.log, and prints the exit status
# and the log's tail (TAIL lines), so one call runs several steps and keeps every log.
step() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? =="
  # pytest-xdist's workers (execnet gateways: python3 -c "import sys;exec(eval(sys.stdin.readline()))") outlive a
  # pytest stopped by timeout and keep their share of GPU memory, so the next step's allocations fail.
  pkill -9 -f "[s]ys.stdin.readline" 2>/dev/null
  grep -v -e Warning -e warn "$OUT/$name.log" | tail -"${TAIL:-12}"
}

# pack: at most 8 files come back from $OUT, so a call ends by packing everything into one archive.
pack() { (cd "$OUT" && tar czf all.tgz --remove-files -- *); }
export -f step pack  # for the scripts/h200/*.sh run with bash after sourcing this
