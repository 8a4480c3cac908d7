#!/usr/bin/env bash
# Training tokens/s through our trainer, attention values interleaved step by step (scripts/bench_train.py), on
# packed documents at one length. carry [".whl"] (tokamax).
#   source scripts/h200/env.sh && bash scripts/h200/bench_train.sh PRESET SEQ_LEN STEPS [ATTENTION...]
#   e.g. bash scripts/h200/bench_train.sh 1b 8192 8 clis tokamax cudnn
preset=${1:-1b} seq=${2:-8192} steps=${3:-8}
shift 3 || true
TAIL=12 step "train_${preset}_S$seq" 560 python3 scripts/bench_train.py recipes/cpt.yaml run_dir=/tmp/bt \
    model.preset=$preset data.seq_len=$seq data.per_device_batch=1 --attentions ${@:-clis tokamax cudnn} \
    --warmup 1 --steps "$steps" --out "$OUT/train_${preset}_S$seq.json"
