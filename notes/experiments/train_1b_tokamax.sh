# Issue 17 on the H200: the 1B preset at seq 8192, packed documents, through our trainer with attention=clis,
# tokamax (its Mosaic GPU flash attention, documents as per-row first keys) and cudnn, interleaved
# (scripts/bench_train.py), with each one's compile-and-warm-up time. carry [".whl", ".whl-maxtext"].
#   source notes/experiments/device_env.sh && bash notes/experiments/train_1b_tokamax.sh [STEPS]
source notes/experiments/maxtext_wheels.sh
python3 scripts/bench_train.py recipes/cpt.yaml run_dir=/tmp/bt data.seq_len=8192 data.per_device_batch=1 \
    --attentions clis tokamax cudnn --warmup 1 --steps "${1:-8}" --out "$OUT/train_1b_tokamax.json"
