# Source on the device machine after device_env.sh, with carry [".whl", ".whl-maxtext"]: installs the wheels of
# MaxText's train-loop imports and of tokamax that the GPU image lacks (.whl-maxtext, made on the CPU machine with
# `pip download --no-deps` of the packages the CPU runs import that are not in KINDS.md's list). xprof (32 MB,
# imported only by tokamax's benchmarking module) does not fit the 64 MiB carry: an empty stub stands in for it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-maxtext/*.whl > /dev/null 2>&1
mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
echo "get_kernel_stats_tool = None  # stub: see notes/experiments/maxtext_wheels.sh" > /tmp/site/xprof/cli/tools.py
