# The next device session's plan in two calls (issues 17, 18), each well inside a 600 s call.
# Both: carry [".whl", ".whl-maxtext"]; from the repository root: `bash notes/experiments/session12_h200.sh A` (then B)
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
  B)
    TAIL=15 step train 260 bash notes/experiments/train_1b_tokamax.sh 6
    TAIL=20 step skip_rule 150 python3 scripts/bench_skip_rule.py --grid 21 45 80 --heads 40 --target 0.42 \
        --out "$OUT/skip_rule.json"
    TAIL=20 step diffusion 170 python3 scripts/bench_diffusion.py --weights examples/video_dit/weights.safetensors \
        --impls xla clis clis_skip --schedules " -14:-8" --calibrate 0.01 --repeats 3 --inner 3 --out "$OUT/diffusion.json"
    ;;
  *) echo "usage: session12_h200.sh A|B"; exit 2 ;;
esac
