# The next device session's plan (issue 17's D 128 backward, issue 16's sweep), each call well inside 600 s.
# Written for session 14, which was lent no device; unchanged but for A's tests, which now also run the
# shared base's hull_escaping case on the Mosaic GPU kernels (the bidirectional centre fixed in session 14).
# carry [".whl", ".whl-maxtext"] (remake them as notes/experiments/maxtext_wheels.sh and the device README say:
# grain, array_record, portpicker, tokamax, immutabledict, qwix, pydantic, pydantic_core, annotated-types,
# typing-inspection, einshape, tensorboardX); from the repository root: `bash notes/experiments/next_h200.sh A`.
#   A: GPU tests of the split-dQ fused backward (BlockSizes(fused_dq=True, split_dq=True), head dim 128) against
#      float64, then its time against our two kernels, the unsplit fused one and cuDNN at causal 8k-32k.
#   B: issue 16's sweep, the rest of it (session 13 ran sinks_many unpacked, forward): one family and packing
#      per call, forward and forward+backward.
#   C: the example DiT's attention time after the skip path's pairwise orderings (notes/kernels.md round 10).
source notes/experiments/device_env.sh
source notes/experiments/maxtext_wheels.sh
GPU_TEST="env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rf"
case "$1" in
  A)
    TAIL=8 step split_check 150 python3 notes/experiments/split_dq_check.py --out "$OUT/split_dq_check.json"
    TAIL=15 step tests 200 $GPU_TEST tests/test_pallas_mgpu.py -k "backward_matches or hull"
    TAIL=30 step split_bwd 300 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 16384 32768 \
        --tokens 32768 --packed no --passes bwd fwd_bwd --impls clis clis_fused_bwd clis_split_bwd cudnn \
        --repeats 7 --inner 3 --out "$OUT/split_bwd.json"
    ;;
  B)  # `B FAMILY PACKED` (gaussian | outlier_channels | sinks_many ..., no | yes): one family, both masks, 7 lengths
    TAIL=3 step sweep 560 python3 scripts/bench_attention.py --suite llm --seq-lens 1024 2048 4096 8192 16384 \
        32768 65536 --tokens 32768 --causal both --packed "$3" --inputs "$2" --passes fwd fwd_bwd \
        --impls clis online --repeats 5 --inner 3 --out "$OUT/sweep_$2_packed_$3.json"
    grep -E "ms \[" "$OUT/sweep.log"
    ;;
  C)  # the example DiT after the skip path's pairwise orderings (session 13's D, same command, for the time)
    TAIL=10 step diffusion 240 python3 scripts/bench_diffusion.py --weights examples/video_dit/weights.safetensors \
        --impls xla cudnn clis clis_skip --schedules " -14:-8" " -10:-4" --repeats 2 --inner 2 \
        --out "$OUT/diffusion.json"
    ;;
  *) echo "usage: next_h200.sh A|B|C"; exit 2 ;;
esac
# At most 8 files come back from $OUT: everything goes back as one archive.
(cd "$OUT" && tar czf all.tgz --remove-files -- *)
