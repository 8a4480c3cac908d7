# Source on the device machine (H200) before running anything from the repository root:
#   source notes/experiments/device_env.sh
# Makes `clis_kernels` and `clis_bench` importable (kernels/clis_kernels/ and benchmarks/ under their package names), installs the wheels
# carried in .whl/ (grain, tokamax, ...: pass carry [".whl"]) into /tmp/site, and sets the paths.
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/clis_kernels && ln -sfn "$PWD/benchmarks" /tmp/pk/clis_bench
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:/tmp/pk:$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output to $OUT/NAME.log, and prints
# the exit status and the log's tail (so one call can run several steps and keep every log).
step() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? =="
  grep -v -e Warning -e warn "$OUT/$name.log" | tail -"${TAIL:-12}"
}
