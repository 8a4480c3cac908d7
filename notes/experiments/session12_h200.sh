# The next device session's plan in two calls (issues 17, 18), each well inside a 600 s call.
# Both: carry [".whl", ".whl-maxtext"]; from the repository root: `bash notes/experiments/session12_h200.sh A` (then B1, B2)
#   A: GPU tests of the fused backward and the skip kernel's calibration; backward alone and forward+backward
#      against cuDNN and tokamax at causal 8k/16k/32k (GQA 32/8, D 128) and 8k at D 64 (H 16/16).
#   B: the 1B trainer with clis / tokamax / cuDNN; the Wan-shaped call marked by the rule; the example DiT.
source notes/experiments/device_env.sh
source notes/experiments/maxtext_wheels.sh
GPU_TEST="env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rf"
case "$1" in
  A)
    TAIL=20 step tests 200 $GPU_TEST tests/test_pallas_mgpu.py tests/test_diffusion_skipping.py -k "backward_matches or calibration_works"
    TAIL=40 step bwd 240 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 16384 32768 --tokens 32768 \
        --packed no --passes bwd fwd_bwd --impls clis clis_fused_bwd cudnn tokamax_mosaic --repeats 7 --inner 3 \
        --out "$OUT/bwd.json"
    TAIL=20 step bwd_d64 100 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 --tokens 8192 \
        --llm-heads 16 16 64 --packed no --passes bwd fwd_bwd --impls clis clis_fused_bwd cudnn --repeats 7 \
        --inner 3 --out "$OUT/bwd_d64.json"
    ;;
  B1)
    TAIL=25 step tests 170 $GPU_TEST tests/test_pallas_mgpu.py tests/test_diffusion_skipping.py -k "backward_matches or calibration_works"
    TAIL=15 step train 300 bash notes/experiments/train_1b_tokamax.sh 6
    ;;
  B2)
    TAIL=20 step skip_rule 170 python3 scripts/bench_skip_rule.py --grid 21 45 80 --heads 40 --target 0.42 \
        --out "$OUT/skip_rule.json"
    TAIL=20 step diffusion 230 python3 scripts/bench_diffusion.py --weights examples/video_dit/weights.safetensors \
        --impls xla clis clis_skip --schedules " -14:-8" --calibrate 0.01 --repeats 3 --inner 3 --out "$OUT/diffusion.json"
    ;;
  C)  # after the fused backward became the default at head dim <= 64 (the 1B preset's 64)
    TAIL=20 step bwd_1b 120 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 --tokens 16384 \
        --llm-heads 32 8 64 --packed both --passes bwd fwd_bwd --impls clis clis_two_kernel_bwd cudnn tokamax_mosaic \
        --repeats 7 --inner 3 --out "$OUT/bwd_1b.json"
    TAIL=6 step train 200 python3 scripts/bench_train.py recipes/cpt.yaml run_dir=/tmp/bt data.seq_len=8192 \
        data.per_device_batch=1 --attentions clis tokamax --warmup 1 --steps 6 --out "$OUT/train_1b_fused.json"
    TAIL=20 step skip_rule 170 python3 scripts/bench_skip_rule.py --grid 21 45 80 --heads 40 --target 0.42 \
        --out "$OUT/skip_rule.json"
    ;;
  D)  # C's skip_rule step timed out while compiling q, k, v in as 2.3 GB of constants (fixed: they are arguments)
    TAIL=20 step skip_rule 210 python3 scripts/bench_skip_rule.py --grid 21 45 80 --heads 40 --target 0.42 \
        --repeats 3 --out "$OUT/skip_rule.json"
    TAIL=20 step diffusion 230 python3 scripts/bench_diffusion.py --weights examples/video_dit/weights.safetensors \
        --impls xla cudnn clis clis_skip --schedules " -14:-8" --calibrate 0.01 --repeats 2 --inner 2 --out "$OUT/diffusion.json"
    ;;
  *) echo "usage: session12_h200.sh A|B1|B2|C|D"; exit 2 ;;
esac
# At most 8 files come back from $OUT: everything goes back as one archive.
(cd "$OUT" && tar czf all.tgz --remove-files -- *)
