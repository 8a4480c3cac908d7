#!/usr/bin/env bash
# Time from the command to the first training step, and its parts (state ready: parameters initialised; first
# step: its compile and run), for a recipe through `clis-train`, one attention value after another.
#   source scripts/h200/env.sh && bash scripts/h200/first_step.sh [RECIPE [ATTENTION...]] (default: cpt.yaml clis cudnn)
# Each run trains one step into a fresh run_dir; the logs come back as $OUT/first_step_<attention>.log.
recipe=${1:-recipes/cpt.yaml}
shift || true
for att in ${@:-clis cudnn}; do
  t0=$(date +%s.%N)
  timeout 280 python3 -m clis_train.cli "$recipe" run_dir=/tmp/first_step_$att attention=$att train.steps=1 \
      train.progress_bar=false > "$OUT/first_step_$att.log" 2>&1
  rc=$?
  line=$(grep "first step done at unix time" "$OUT/first_step_$att.log")
  t1=$(echo "$line" | sed -n 's/.*unix time \([0-9.]*\):.*/\1/p')
  if [ -n "$t1" ]; then
    echo "$att: command to first step $(python3 -c "print(round($t1 - $t0, 1))") s; ${line#*: }"
  else
    echo "$att: rc=$rc, no first step"; tail -5 "$OUT/first_step_$att.log"
  fi
done
