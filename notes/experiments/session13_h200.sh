# The next device session's plan (issues 17, 18), each call well inside 600 s. carry [".whl", ".whl-maxtext"];
# from the repository root: `bash notes/experiments/session13_h200.sh A` (then B once A's tests pass and
# document_ranges is the default in pallas_mgpu.BlockSizes and pallas_mgpu_vjp.BlockSizes).
# A ran at 699afa9, before document ranges were the default: its clis_doc_ranges is today's clis, and today's
# clis_all_blocks is its clis.
#   A: GPU tests of document ranges (bit-identical to the full causal loops) and of the skip kernel with nothing
#      skipped (bit-identical to the dense kernel); packed-document timings at the 1B shape and at D 128.
#   B: the 1B trainer with clis / tokamax / cuDNN on packed documents.
#   C: the example DiT, PSNR of each skip schedule against its unskipped twin, sparsity per layer.
source notes/experiments/device_env.sh
source notes/experiments/maxtext_wheels.sh
GPU_TEST="env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rf"
case "$1" in
  A)
    TAIL=15 step tests 150 $GPU_TEST tests/test_pallas_mgpu.py tests/test_diffusion_skipping.py \
        -k "document_ranges or bit_for_bit"
    TAIL=30 step docs_1b 170 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 --tokens 16384 \
        --llm-heads 32 8 64 --packed yes --doc-len 300 --passes fwd bwd fwd_bwd \
        --impls clis clis_doc_ranges tokamax_k_start --repeats 7 --inner 3 --out "$OUT/docs_1b.json"
    TAIL=30 step docs_d128 170 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 --tokens 32768 \
        --packed yes --doc-len 1000 --passes fwd_bwd --impls clis clis_doc_ranges tokamax_k_start --repeats 5 \
        --inner 3 --out "$OUT/docs_d128.json"
    ;;
  B)
    TAIL=15 step train 330 python3 scripts/bench_train.py recipes/cpt.yaml run_dir=/tmp/bt data.seq_len=8192 \
        data.per_device_batch=1 --attentions clis tokamax cudnn --warmup 1 --steps 8 --out "$OUT/train_1b_docs.json"
    ;;
  C)  # the example DiT: each skip schedule against its unskipped twin (same step programs, nothing marked);
      # then clis training alone with every compile logged (B's clis spread had one 22.8 s step)
    TAIL=12 step diffusion 400 python3 scripts/bench_diffusion.py --weights examples/video_dit/weights.safetensors \
        --impls xla cudnn clis clis_skip --schedules " -14:-8" " -10:-4" --calibrate --repeats 2 --inner 2 \
        --out "$OUT/diffusion.json"
    TAIL=6 step recompile 150 env JAX_LOG_COMPILES=1 JAX_EXPLAIN_CACHE_MISSES=1 python3 scripts/bench_train.py \
        recipes/cpt.yaml run_dir=/tmp/bt data.seq_len=8192 data.per_device_batch=1 --attentions clis --warmup 1 \
        --steps 6 --out "$OUT/train_clis_compiles.json"
    grep -n -E "Compiling|Finished|CACHE MISS|because|never seen" "$OUT/recompile.log" | cut -c1-300 | tail -40
    ;;
  D)  # the DiT with the sampler's skip path on the dense call's automatic plan (nothing skipped = dense clis), and
      # issue 16's length sweep, forward, on the sink family (B x S = 32k tokens)
    TAIL=10 step diffusion 200 python3 scripts/bench_diffusion.py --weights examples/video_dit/weights.safetensors \
        --impls xla cudnn clis clis_skip --schedules " -14:-8" " -10:-4" --repeats 2 --inner 2 \
        --out "$OUT/diffusion_same_plan.json"
    TAIL=3 step sweep_sinks 300 python3 scripts/bench_attention.py --suite llm --seq-lens 1024 2048 4096 8192 16384 \
        32768 65536 --tokens 32768 --causal both --packed no --inputs sinks_many --passes fwd --impls clis online \
        --repeats 5 --inner 3 --out "$OUT/sweep_sinks_fwd.json"
    grep -E "ms \[" "$OUT/sweep_sinks.log"
    ;;
  E)  # with document ranges the default: the Triton kernels compiled (A ran the Mosaic GPU ones), the sampler's
      # skip path against dense clis; then the two-kernel backward's slots at D 128 against cuDNN
    TAIL=12 step tests 150 $GPU_TEST tests/test_pallas_gpu.py tests/test_diffusion_skipping.py \
        -k "document_ranges or packed or bit_for_bit"
    TAIL=12 step bwd_slots 130 python3 notes/experiments/bwd_slots.py --repeats 5 --inner 3 --out "$OUT/bwd_slots.json"
    ;;
  *) echo "usage: session13_h200.sh A|B|C|D|E"; exit 2 ;;
esac
# At most 8 files come back from $OUT: everything goes back as one archive.
(cd "$OUT" && tar czf all.tgz --remove-files -- *)
