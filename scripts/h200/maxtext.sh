# MaxText's own train loop on the H200, a Llama-3.2-1B-shaped model, each attention value back to back
# (scripts/bench_maxtext.py). carry [".whl"], made by `EXTRA="..." scripts/h200/wheels.sh` with the packages
# MaxText's train loop imports that the GPU image lacks (pyproject.toml's maxtext extra, less what KINDS.md lists).
#   source scripts/h200/env.sh && bash scripts/h200/maxtext.sh [SEQ_LEN [VARIANT...]]
MODEL="model_name=llama3-8b override_model_config=true base_emb_dim=2048 base_num_decoder_layers=16 \
base_mlp_dim=8192 base_num_query_heads=32 base_num_kv_heads=8 head_dim=64 logits_via_embedding=true"
SEQ=${1:-8192}
shift || true
VARIANTS=${*:-clis dot_product flash clis_online cudnn_flash_te}
python3 scripts/bench_maxtext.py --variants $VARIANTS --steps 20 --timeout 105 --out "$OUT/maxtext_s$SEQ.json" \
    skip_jax_distributed_system=true $MODEL per_device_batch_size=1 max_target_length=$SEQ packing=true \
    dtype=bfloat16 remat_policy=full
