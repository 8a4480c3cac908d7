# Real activations (one device call, H200): train the `small` preset on real text (the installed scipy's sources,
# offline) with attention=clis until the time limit, then measure sink statistics, certified fractions and
# backward-skippable tiles per layer and head at every checkpoint on held-out text (numpy's sources), and save a
# q/k/v sample for the CPU tests (tests/data/).
#   source scripts/h200/env.sh && bash scripts/h200/real_corpus.sh TRAIN_S STATS_S
set -u
SP=$(python3 -c "import os, scipy; print(os.path.dirname(os.path.dirname(scipy.__file__)))")
RUN=/tmp/real_small
step train "${1:-330}" python3 -m clis_train.cli recipes/cpt.yaml run_dir=$RUN model.preset=small \
  model.vocab_size=384 model.remat=none data.train_path=$SP/scipy data.file_suffixes=.py,.pyi,.md,.rst,.txt data.tokenizer=byte data.seq_len=8192 \
  data.per_device_batch=4 data.packing_bins=64 optim.lr=6e-4 optim.warmup_steps=100 train.steps=1200 \
  train.log_every=25 train.eval_every=300 train.eval_batches=4 checkpoint.every=200 checkpoint.keep=20 \
  train.progress_bar=false train.save_on_interrupt=true
cp $RUN/metrics.jsonl $OUT/real_small_metrics.jsonl; cp $RUN/config.json $OUT/real_small_config.json
step stats "${2:-200}" python3 scripts/activation_stats.py $RUN --text $SP/numpy --seq-lens 8192 \
  --long-seq-lens 32768 --batch 2 --out $OUT/real_small_stats.json \
  --sample-out $OUT/real_small_qkv.safetensors --sample-layers 1 6 11 --sample-len 768
nvidia-smi --query-gpu=name,memory.used --format=csv
