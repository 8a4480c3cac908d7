#!/usr/bin/env bash
# Kernel timings on the H200, one purpose per word (each well inside one call's 600 s). carry [".whl"] (tokamax).
#   source scripts/h200/env.sh && bash scripts/h200/bench_kernels.sh WHAT [ARGS]
#   bwd_parts          the backward's parts (Δ, dQ kernel, dK/dV kernel) against cuDNN, causal GQA 32/8 D 128, 8k-32k
#   llm_d128           forward, backward, forward+backward against cuDNN, causal GQA 32/8 D 128, 8k-32k (B·S = 32k)
#   llm_d64            the same at the 1B shape (GQA 32/8, D 64), 2k and 8k
#   sweep FAMILY PACKED  forward and forward+backward, clis against online, 1k-64k, causal and bidirectional
#   bidir FAMILY       bidirectional 32k H 12 and 75,600 H 40 forward: clis, online, cuDNN
#   diffusion          the example DiT's sampler: dense XLA, cuDNN, clis, clis with skipping
#   mla                MLA's q·k 192 / v 128 (16/16 heads), 8k and 32k: forward and fwd+bwd against tokamax
#   mla_bwd_parts      the backward's parts at MLA's dims against tokamax's backward, 8k and 32k
#   lse FAMILY         the certified forward with the unrounded lse sum (default) against the rounded one and the
#                      online loop, 16k-64k, causal and bidirectional (re-deciding the Hopper certify rule)
#   d256               head dim 256 (Gemma 2, GQA 16/8) 8k and 32k: backward and fwd+bwd with the Mosaic GPU backward
#                      (pallas_mgpu_vjp_wide) against the Triton one and cuDNN
#   mla_batch          MLA's backward parts at 8k with B 1 and B 4, in one call (the dK/dV kernel's rate by batch)
#   delta_pass         Δ = rowsum(dO∘O) alone: the kernels' einsum against multiply-and-reduce
#   heads_per_cta      the forward with CTAs walking 1 / 2 / 4 / 8 heads of a GQA group: GPU tests, then gpt-oss's
#                      shape (window 128, GQA 64/8 D 64) fwd and fwd+bwd, windows 1024 and 4096 at D 128 fwd, 8k and
#                      32k; causal 2k rows at D 64 (GQA 32/8) fwd
#   certify_rule FAMILY  the certified forward against the online loop where the plan's Hopper rule decides: D 64
#                      (GQA 32/8) 8k-32k causal and bidirectional, and a 4096-key window at D 128, causal 32k
#   soft_cap           the soft cap's own bound (bound="cap", no pre-pass): GPU tests of the cap cases, then cap 50
#                      at D 128 (GQA 32/8) and Gemma 2's D 256 with a 4096 window (GQA 16/8), 8k and 32k, fwd and
#                      fwd+bwd: clis (the cap's bound), its tensor-core sum, online, the in-kernel radius, tokamax
#   sinks              gpt-oss's learned sinks (GQA 64/8, D 64; full causal and window 128, its alternating layers),
#                      GPU tests, then fwd and fwd+bwd 8k and 32k (and the certified loop, clis_mgpu) against cuDNN
#                      and tokamax (which take no sinks),
#                      then the errors of o, dq, dk, dv, dsinks seed by seed, online and certified
#                      (notes/experiments/sinks_accuracy.py)
#   profile            the forward step's regions per warpgroup from Mosaic GPU's in-kernel profiler (GPU test,
#                      then D 128 GQA 32/8 causal 4k rows with and without cap 50: notes/experiments/profile_forward.py)
#   sass               the forward's PTX, ours against tokamax's (D 128 GQA 32/8 causal 8k, with and without cap 50),
#                      and ptxas's registers and spills, then ncu's issue, pipe and stall sections of each attention
#                      kernel (notes/experiments/sass_forward.py: `sass` and `count` read the PTX here afterwards)
#   one_memory_warp [more]  the forward's BlockSizes(one_memory_warp), the default, against four streaming warps: GPU
#                      tests, then D 128 (GQA 32/8) causal 8k and 32k fwd and fwd+bwd with cuDNN and tokamax; with
#                      "more", GPU tests of the forward's features, then cap 50 D 128, Gemma 2 (D 256, cap 50, window
#                      4096) and MLA 192/128 against tokamax
#   overlap [more]     the backward's step orders: the default (online: overlap_dq at D 128), both kernels overlapped
#                      (online_overlap_bwd) and neither (online_serial_bwd). GPU tests (bit-identical gradients), then
#                      bwd and fwd+bwd at D 128 (GQA 32/8) and D 256 (GQA 16/8), causal 8k and 32k, with cuDNN; with
#                      "more", gpt-oss's D 64 (GQA 64/8), MLA 192/128 (tokamax), window 4096 and cap 50
#   kernels_apart [more]  each backward kernel timed alone in both step orders (scripts/profile_backward.py --overlap),
#                      8k and 32k, dV's wgmma moved too (GPU tests first): D 128 and D 128 with cap 50, then the split-dQ
#                      determinism check; with "more", D 256,
#                      MLA 192/128 and ptxas's report (registers, spills, wgmma serialization)
#   orders             the backward's per-kernel default orders (pallas_mgpu_vjp.default_block_sizes, 2026-12-07) as a
#                      whole: GPU tests (dV behind dP and the overlapped orders bit-identical), then bwd and fwd+bwd on
#                      sink inputs against the default before it (online_dq_overlap_bwd at D 128 with and without
#                      cap 50, online_serial_bwd at D 256 and MLA) and cuDNN or tokamax: D 128 and cap 50 8k/32k,
#                      MLA 8k/16k/32k, D 256 8k/32k
#   wide_orders [more]  the wide (D 256) dK/dV kernel's orders and the D 256 forward: GPU tests of dV behind dP in
#                      every dK/dV kernel, each D 256 backward kernel alone in every order (8k, 32k; with "more" also
#                      with cap 50), the D 256 forward alone (the default timed twice) against cuDNN and tokamax (sink
#                      inputs), and D 128 bwd / fwd+bwd with the default timed twice (online_twin: the spread between
#                      identical versions) against cuDNN, 8k and 32k
#   ncu_gemma2         our forward and tokamax's (its heuristics) at Gemma 2's local layer (D 256, cap 50, window 4096,
#                      GQA 16/8, 8k, sinks): the PTX/SASS dumps with ptxas's registers and spills, then ncu's
#                      speed-of-light, instruction, warp-state and scheduler sections
#   tokamax_grid       how much of tokamax's forward lead at Gemma 2's local layer (D 256, cap 50, window 4096, GQA 16/8)
#                      its persistent grid gives: tokamax_mosaic (its heuristics: persistent with a window), persistent
#                      and one CTA per q tile, against ours (online), 8k and 32k; then D 128 (GQA 32/8) window 4096
#   gemma2_fwd         what separates our forward from tokamax's at Gemma 2's local layer (D 256, cap 50, window 4096, GQA
#                      16/8), where tokamax's own grid is not the reason: online, the cap's bound (clis_mgpu_cap), the
#                      cap's bound with tokamax's arithmetic (one unrounded sum: clis_cap_unrounded) and with the rounded
#                      weights' sum on the tensor cores (clis_cap_tc_sum), tokamax with one
#                      CTA per q tile and its heuristics, 8k and 32k, sink and Gaussian inputs
#   named              the forward's turns and K/V slot release on hardware named barriers (BlockSizes.named_barriers,
#                      FA3's and tokamax's; the default at head dim 256) against mbarriers: its GPU tests, then Gemma 2's
#                      local layer (D 256, cap 50, window 4096, GQA 16/8) online and certified with tokamax, and causal
#                      GQA 16/8 D 256 with cuDNN, 8k and 32k, sinks
#   named_narrow       named barriers at head dim 64, where a step is half as long as at 128: GPU tests (sinks among them),
#                      then gpt-oss's full causal layer (GQA 64/8, D 64, learned sinks) online and certified against
#                      mbarriers, cuDNN and tokamax, 8k and 32k, sinks
#   stalls             ncu's stall reasons per issued instruction of Gemma 2's local-layer forward at B 4 (the paired
#                      benchmark's shape, where tokamax leads): ours certified (the cap's bound), the same summing the
#                      unrounded weights, and tokamax's
#   stall_sources      ncu's PC sampling per SASS instruction of Gemma 2's local-layer forward at B 4: ours certified (the
#                      cap's bound; named barriers, the default at D 256, and mbarriers) and tokamax's, summed by opcode
#                      and wait kind (notes/experiments/stall_sources.py): which wait the long-scoreboard stalls are
#   mla_ncu            ncu of MLA's forward (q·k 192 / v 128, 16/16 heads, causal B 1 × 32k, sinks), ours (online, the plan's
#                      choice) and tokamax's: instructions, cycles, stall reasons, L2 hit rate, DRAM throughput
#   mla_dkv_l2         ncu of MLA's dK/dV kernel alone (clis_mgpu_bwd_dkv, q·k 192 / v 128, 16/16 heads, causal 8k, sinks) at
#                      B 1 and B 4: L2 hit rate, L2 and DRAM reads, cycles, the main stall reasons (why B 4 runs slower)
#   clocks             whether the card's clock explains tokamax's lead at Gemma 2's local layer (D 256, cap 50, window
#                      4096, GQA 16/8, 8k): each forward sustained alone with nvidia-smi's SM clock and power, the paired
#                      benchmark at B 1 and B 4, then ncu of our certified cap loop and tokamax's at B 4
#   opcodes            ncu's executed instructions by SASS opcode of Gemma 2's local-layer forward (D 256, cap 50, window
#                      4096, GQA 16/8, 8k, B 1): ours online, certified (the cap's bound), certified summing the unrounded
#                      weights (tokamax's arithmetic), and tokamax's
#   context_parallel [N]  context-parallel attention over N GPUs (default 1: the machinery's cost on one) against
#                      one GPU, CLiS combine against an online ring: causal 32k GQA 32/8 D 128, sinks
# ncu_forward NAME TAIL "IMPL STABILIZER [cap [TILES]]" NCU_ARGS...: ncu over one launch of sass_forward.py's forward at
# the shape in ${gemma2[@]} (set by the word), ours (with its stabilizer, the cap's bound, BlockSizes changes) or tokamax's
sections=(--section SpeedOfLight --section InstructionStats --section WarpStateStats --section SchedulerStats)
ncu_forward() {
  local name=$1 tail=$2 impl stabilizer bound tiles
  read -r impl stabilizer bound tiles <<< "$3"
  shift 3
  local extra=(--stabilizer "$stabilizer")
  [ "$bound" = cap ] && extra+=(--bound cap)
  [ -n "$tiles" ] && extra+=(--tiles "$tiles")
  TAIL=$tail step "$name" 120 timeout -s INT 110 ncu --clock-control none -k "regex:clis_mgpu_fwd|flash_attention" \
      --launch-count 1 "$@" python3 notes/experiments/sass_forward.py run --impl "$impl" "${gemma2[@]}" "${extra[@]}" \
      --no-dump --dump-dir /tmp/ncu_dump
}

case "$1" in
  bwd_parts)
    TAIL=30 step bwd_parts 300 python3 scripts/profile_backward.py --seq-lens 8192 16384 32768 --tokens 32768 \
        --out "$OUT/bwd_parts.json" ;;
  llm_d128)
    TAIL=30 step llm_d128 500 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 16384 32768 \
        --tokens 32768 --packed no --passes fwd bwd fwd_bwd --impls clis online cudnn tokamax_mosaic \
        --repeats 7 --inner 3 --out "$OUT/llm_d128.json" ;;
  llm_d64)
    TAIL=30 step llm_d64 400 python3 scripts/bench_attention.py --suite llm --seq-lens 2048 8192 --tokens 16384 \
        --llm-heads 32 8 64 --packed no --passes fwd bwd fwd_bwd --impls clis online cudnn tokamax_mosaic \
        --repeats 7 --inner 3 --out "$OUT/llm_d64.json" ;;
  sweep)
    TAIL=3 step "sweep_$2_packed_$3" 560 python3 scripts/bench_attention.py --suite llm --seq-lens 1024 2048 4096 \
        8192 16384 32768 65536 --tokens 32768 --causal both --packed "$3" --inputs "$2" --passes fwd fwd_bwd \
        --impls clis online --repeats 5 --inner 3 --out "$OUT/sweep_$2_packed_$3.json"
    grep -E "ms \[" "$OUT/sweep_$2_packed_$3.log" ;;
  bidir)
    TAIL=20 step "bidir_$2" 500 python3 scripts/bench_attention.py --suite llm --seq-lens 32768 --tokens 32768 \
        --llm-heads 12 12 128 --causal no --packed no --inputs "$2" --passes fwd --impls clis online clis_radius cudnn \
        --repeats 7 --inner 3 --out "$OUT/bidir_$2.json" ;;
  diffusion)
    TAIL=10 step diffusion 400 python3 -m scripts.bench_diffusion --weights examples/video_dit/weights.safetensors \
        --impls xla cudnn clis clis_skip --schedules " -14:-8" " -10:-4" --repeats 2 --inner 2 \
        --out "$OUT/diffusion.json" ;;
  mla)
    TAIL=20 step mla 330 python3 scripts/bench_attention.py --suite llm --llm-heads 16 16 192 --value-dim 128 \
        --seq-lens 8192 32768 --tokens 32768 --causal yes --packed no --inputs sinks_many --passes fwd fwd_bwd \
        --impls clis online online_kv64 tokamax_mosaic --repeats 9 --inner 3 --out "$OUT/mla.json" ;;
  mla_bwd_parts)
    TAIL=20 step mla_bwd_parts 300 python3 scripts/profile_backward.py --heads 16 16 192 --value-dim 128 \
        --seq-lens 8192 32768 --tokens 32768 --out "$OUT/mla_bwd_parts.json" ;;
  mla_batch)
    for tokens in 8192 32768; do
      TAIL=9 step "mla_batch_T$tokens" 120 python3 scripts/profile_backward.py --heads 16 16 192 --value-dim 128 \
          --seq-lens 8192 --tokens "$tokens" --repeats 5 --out "$OUT/mla_batch_T$tokens.json"
    done ;;
  delta_pass)
    TAIL=6 step delta_pass 90 python3 notes/experiments/delta_pass.py --out "$OUT/delta_pass.json" ;;
  lse)
    TAIL=20 step "lse_$2" 500 python3 scripts/bench_attention.py --suite llm --seq-lens 16384 32768 65536 \
        --tokens 32768 --causal both --packed no --inputs "$2" --passes fwd fwd_bwd \
        --impls clis_mgpu clis_rounded_lse online_mgpu --repeats 7 --inner 3 --out "$OUT/lse_$2.json" ;;
  d256)
    TAIL=20 step d256 420 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 --seq-lens 8192 32768 \
        --tokens 32768 --causal yes --packed no --inputs sinks_many --passes bwd fwd_bwd \
        --impls online online_mgpu_triton_bwd cudnn --repeats 7 --inner 3 --out "$OUT/d256.json" ;;
  heads_per_cta)
    TAIL=8 step heads_tests 150 timeout -s INT 140 $GPU_TEST tests/test_pallas_mgpu.py -k "heads_per_cta" --durations 3
    TAIL=24 step heads_w128 170 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 --tokens 32768 \
        --llm-heads 64 8 64 --window 128 --causal yes --packed no --inputs sinks_many --passes fwd fwd_bwd \
        --impls online_heads1 online_heads2 online_heads4 online_heads8 cudnn tokamax_mosaic --repeats 5 --inner 3 \
        --out "$OUT/heads_w128.json"
    for w in 1024 4096; do
      TAIL=12 step "heads_w$w" 120 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --tokens 32768 --window "$w" --causal yes --packed no --inputs sinks_many --passes fwd \
          --impls online_heads1 online_heads2 online_heads4 cudnn --repeats 5 --inner 3 --out "$OUT/heads_w$w.json"
    done
    TAIL=8 step heads_s2k 90 python3 scripts/bench_attention.py --suite llm --seq-lens 2048 --tokens 16384 \
        --llm-heads 32 8 64 --causal yes --packed no --inputs sinks_many --passes fwd \
        --impls online_heads1 online_heads2 online_heads4 cudnn --repeats 5 --inner 3 --out "$OUT/heads_s2k.json" ;;
  certify_rule)
    TAIL=14 step "certify_d64_$2" 240 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 16384 32768 \
        --tokens 32768 --llm-heads 32 8 64 --causal both --packed no --inputs "$2" --passes fwd \
        --impls clis_mgpu clis_rounded_lse online_mgpu --repeats 7 --inner 3 --out "$OUT/certify_d64_$2.json"
    TAIL=6 step "certify_window_$2" 150 python3 scripts/bench_attention.py --suite llm --seq-lens 32768 \
        --tokens 32768 --window 4096 --causal yes --packed no --inputs "$2" --passes fwd fwd_bwd \
        --impls clis_mgpu online_mgpu --repeats 7 --inner 3 --out "$OUT/certify_window_$2.json" ;;
  soft_cap)
    TAIL=8 step cap_tests 170 timeout -s INT 160 $GPU_TEST tests/test_pallas_mgpu.py -k "cap" --durations 3
    TAIL=24 step cap50_d128 200 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 --tokens 32768 \
        --softcap 50 --causal yes --packed no --inputs sinks_many --passes fwd fwd_bwd \
        --impls clis clis_cap_tc_sum online clis_radius tokamax_mosaic --repeats 5 --inner 3 --out "$OUT/cap50_d128.json"
    TAIL=16 step cap50_w4096_d256 170 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 \
        --seq-lens 8192 32768 --tokens 32768 --softcap 50 --window 4096 --causal yes --packed no --inputs sinks_many \
        --passes fwd fwd_bwd --impls clis online tokamax_mosaic --repeats 5 --inner 3 \
        --out "$OUT/cap50_w4096_d256.json" ;;
  sinks)
    TAIL=8 step sinks_tests 260 timeout -s INT 250 $GPU_TEST tests/test_sinks_and_split_heads.py --durations 4
    for w in none 128; do
      window=(); [ "$w" = none ] || window=(--window "$w")
      TAIL=12 step "sinks_w$w" 170 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --tokens 32768 --llm-heads 64 8 64 "${window[@]}" --sinks 2 --causal yes --packed no --inputs sinks_many \
          --passes fwd fwd_bwd --impls clis online clis_mgpu cudnn tokamax_mosaic --repeats 5 --inner 3 \
          --out "$OUT/sinks_w$w.json"
    done
    TAIL=8 step sinks_accuracy 150 env PYTHONPATH="tests:$PYTHONPATH" python3 notes/experiments/sinks_accuracy.py \
        --out "$OUT/sinks_accuracy.json" ;;
  profile)
    TAIL=6 step profile_tests 150 timeout -s INT 140 $GPU_TEST tests/test_pallas_mgpu.py -k "profiled_forward" \
        --durations 3
    for cap in none 50; do
      capflag=(); [ "$cap" = none ] || capflag=(--softcap "$cap")
      TAIL=14 step "profile_d128_cap$cap" 90 python3 notes/experiments/profile_forward.py --heads 32 8 128 \
          --seq 4096 --batch 2 "${capflag[@]}" --out "$OUT/profile_d128_cap$cap.json"
    done ;;
  sass)
    uname -r
    for impl in ours tokamax; do
      for cap in none 50; do
        name="${impl}_cap$cap" capflag=(); [ "$cap" = none ] || capflag=(--softcap "$cap")
        TAIL=3 step "sass_$name" 90 python3 notes/experiments/sass_forward.py run --impl "$impl" "${capflag[@]}" \
            --dump-dir "$OUT/dump_$name"
      done
    done
    # ncu last (a profile cut off by its time limit left the GPU unusable to the next process), the attention kernel
    # alone: ours is clis_mgpu_fwd, tokamax's flash_attention_sm90
    for impl in ours tokamax; do
      for cap in none 50; do
        name="${impl}_cap$cap" capflag=(); [ "$cap" = none ] || capflag=(--softcap "$cap")
        TAIL=50 step "ncu_$name" 100 timeout -s INT 90 ncu --clock-control none -k "regex:clis_mgpu_fwd|flash_attention" \
            --launch-count 1 --section SpeedOfLight --section InstructionStats --section WarpStateStats \
            --section SchedulerStats --section Occupancy python3 notes/experiments/sass_forward.py run \
            --impl "$impl" "${capflag[@]}" --no-dump --dump-dir /tmp/ncu_dump
      done
    done ;;
  overlap)
    common=(--tokens 32768 --causal yes --packed no --inputs sinks_many --passes bwd fwd_bwd --repeats 7 --inner 3)
    if [ "$2" = more ]; then
      TAIL=10 step overlap_d64 150 python3 scripts/bench_attention.py --suite llm --llm-heads 64 8 64 \
          --seq-lens 8192 32768 --impls online online_overlap_bwd online_serial_bwd cudnn "${common[@]}" --out "$OUT/overlap_d64.json"
      TAIL=10 step overlap_mla 150 python3 scripts/bench_attention.py --suite llm --llm-heads 16 16 192 \
          --value-dim 128 --seq-lens 8192 32768 --impls online online_overlap_bwd online_serial_bwd tokamax_mosaic "${common[@]}" \
          --out "$OUT/overlap_mla.json"
      TAIL=10 step overlap_w4096 120 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --window 4096 --impls online online_overlap_bwd online_serial_bwd cudnn "${common[@]}" --out "$OUT/overlap_w4096.json"
      TAIL=10 step overlap_cap50 120 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --softcap 50 --impls online online_overlap_bwd online_serial_bwd tokamax_mosaic "${common[@]}" --out "$OUT/overlap_cap50.json"
    else
      TAIL=10 step overlap_tests 240 timeout -s INT 230 $GPU_TEST tests/test_pallas_mgpu.py -k "overlapped" \
          --durations 3
      TAIL=10 step overlap_d128 170 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --impls online online_overlap_bwd online_serial_bwd cudnn "${common[@]}" --out "$OUT/overlap_d128.json"
      TAIL=10 step overlap_d256 150 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 \
          --seq-lens 8192 32768 --impls online online_overlap_bwd online_serial_bwd cudnn "${common[@]}" --out "$OUT/overlap_d256.json"
    fi ;;
  orders)
    common=(--tokens 32768 --causal yes --packed no --inputs sinks_many --passes bwd fwd_bwd --repeats 5 --inner 3)
    TAIL=6 step orders_tests 200 timeout -s INT 190 $GPU_TEST tests/test_pallas_mgpu.py -k "overlapped or dv_behind" \
        --durations 3
    TAIL=10 step orders_d128 110 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
        --impls online online_dq_overlap_bwd cudnn "${common[@]}" --out "$OUT/orders_d128.json"
    TAIL=10 step orders_cap50 110 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 --softcap 50 \
        --impls online online_dq_overlap_bwd tokamax_mosaic "${common[@]}" --out "$OUT/orders_cap50.json"
    TAIL=14 step orders_mla 130 python3 scripts/bench_attention.py --suite llm --llm-heads 16 16 192 --value-dim 128 \
        --seq-lens 8192 16384 32768 --impls online online_serial_bwd tokamax_mosaic "${common[@]}" \
        --out "$OUT/orders_mla.json"
    TAIL=10 step orders_d256 110 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 \
        --seq-lens 8192 32768 --impls online online_serial_bwd cudnn "${common[@]}" --out "$OUT/orders_d256.json" ;;
  wide_orders)
    parts=(python3 scripts/profile_backward.py --seq-lens 8192 32768 --overlap --repeats 5 --heads 16 8 256)
    TAIL=6 step wide_tests 120 timeout -s INT 110 $GPU_TEST tests/test_pallas_mgpu.py -k "dv_behind" --durations 3
    TAIL=12 step wide_parts 110 "${parts[@]}" --out "$OUT/wide_parts.json"
    TAIL=10 step wide_fwd 120 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 --seq-lens 8192 32768 \
        --tokens 32768 --causal yes --packed no --inputs sinks_many --passes fwd \
        --impls online online_twin cudnn tokamax_mosaic --repeats 7 --inner 3 --out "$OUT/wide_fwd.json"
    if [ "$2" = more ]; then
      TAIL=12 step wide_parts_cap50 110 "${parts[@]}" --softcap 50 --out "$OUT/wide_parts_cap50.json"
    fi
    TAIL=14 step d128_twin 120 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 --tokens 32768 \
        --causal yes --packed no --inputs sinks_many --passes bwd fwd_bwd --impls online online_twin cudnn \
        --repeats 6 --inner 3 --out "$OUT/d128_twin.json" ;;
  named)
    TAIL=8 step named_tests 200 timeout -s INT 190 $GPU_TEST tests/test_pallas_mgpu.py -k "named_barriers" --durations 3
    common=(--causal yes --packed no --inputs sinks_many --passes fwd --repeats 7 --inner 3 --tokens 32768
            --seq-lens 8192 32768)
    TAIL=8 step named_gemma2 200 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 --softcap 50 \
        --window 4096 "${common[@]}" --impls online online_mbarriers clis_mgpu_cap clis_cap_mbarriers tokamax_streamed \
        --out "$OUT/named_gemma2.json"
    TAIL=8 step named_d256 200 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 "${common[@]}" \
        --impls online online_mbarriers clis_mgpu clis_mgpu_mbarriers cudnn --out "$OUT/named_d256.json" ;;
  named_narrow)
    TAIL=8 step named_narrow_tests 200 timeout -s INT 190 $GPU_TEST tests/test_pallas_mgpu.py -k "named_barriers" \
        --durations 3
    common=(--causal yes --packed no --inputs sinks_many --passes fwd --repeats 7 --inner 3 --tokens 32768
            --seq-lens 8192 32768)
    TAIL=8 step named_gptoss 200 python3 scripts/bench_attention.py --suite llm --llm-heads 64 8 64 --sinks 2 \
        "${common[@]}" --impls online online_named clis_mgpu clis_mgpu_named cudnn tokamax_mosaic \
        --out "$OUT/named_gptoss.json" ;;
  opcodes)
    gemma2=(--heads 16 8 256 --softcap 50 --window 4096)
    for v in "ours_online:ours online" "ours_clis_cap:ours clis cap" "unrounded:ours clis cap exact_sum=False" \
             "tokamax:tokamax online"; do
      ncu_forward "opcodes_${v%%:*}" 4 "${v#*:}" --metrics \
          sass__inst_executed_per_opcode,sm__cycles_elapsed.max,smsp__inst_executed.sum --print-metric-instances details
    done
    python3 notes/experiments/ncu_table.py "$OUT"/opcodes_*.log --top 30 | tee "$OUT/opcodes_table.md" ;;
  stalls)
    gemma2=(--heads 16 8 256 --softcap 50 --window 4096 --batch 4)
    for v in "unrounded:ours clis cap exact_sum=False" "ours_clis_cap:ours clis cap" "tokamax:tokamax online"; do
      ncu_forward "stalls_${v%%:*}" 30 "${v#*:}" --metrics \
          "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__cycles_elapsed.max,smsp__inst_executed.sum"
    done
    python3 notes/experiments/ncu_table.py "$OUT"/stalls_*.log --top 30 | tee "$OUT/stalls_table.md" ;;
  stall_sources)
    gemma2=(--heads 16 8 256 --softcap 50 --window 4096 --batch 4)
    for v in "ours_clis_cap:ours clis cap" "ours_cap_mbarriers:ours clis cap named_barriers=False" \
             "tokamax:tokamax online"; do
      name="sources_${v%%:*}"
      ncu_forward "$name" 6 "${v#*:}" --section SourceCounters --section WarpStateStats -f -o "$OUT/$name"
      ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.csv" 2> "$OUT/$name.err"
    done
    python3 notes/experiments/stall_sources.py "$OUT"/sources_*.csv --top 25 | tee "$OUT/sources_table.md" ;;
  mla_ncu)
    gemma2=(--heads 16 16 192 --value-dim 128 --seq 32768)
    for v in "ours_online:ours online" "tokamax:tokamax online"; do
      ncu_forward "mla_ncu_${v%%:*}" 40 "${v#*:}" --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,\
sm__cycles_elapsed.max,smsp__inst_executed.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed"
    done
    python3 notes/experiments/ncu_table.py "$OUT"/mla_ncu_*.log --top 30 | tee "$OUT/mla_ncu_table.md" ;;
  mla_dkv_l2)
    # the dK/dV kernel alone (ncu -k) at B 1 and B 4 × 8k: its L2 hit rate, DRAM traffic and cycles by batch
    for b in 1 4; do
      TAIL=30 step "mla_dkv_l2_b$b" 150 timeout -s INT 140 ncu --clock-control none -k "regex:clis_mgpu_bwd_dkv" \
          --launch-count 1 --metrics "sm__cycles_elapsed.max,smsp__inst_executed.sum,lts__t_sector_hit_rate.pct,\
lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
regex:smsp__average_warps_issue_stalled_(long_scoreboard|barrier|wait|short_scoreboard)_per_issue_active\.ratio" \
          python3 notes/experiments/sass_forward.py run --impl ours --heads 16 16 192 --value-dim 128 --seq 8192 \
          --batch "$b" --backward --no-dump --dump-dir /tmp/ncu_dump
    done
    python3 notes/experiments/ncu_table.py "$OUT"/mla_dkv_l2_b*.log --top 30 | tee "$OUT/mla_dkv_l2_table.md" ;;
  clocks)
    gemma2=(--heads 16 8 256 --softcap 50 --window 4096)
    TAIL=10 step clocks_gemma2 150 python3 notes/experiments/clocks_under_load.py "${gemma2[@]}" --out "$OUT/clocks_gemma2.json"
    for tokens in 8192 32768; do
      TAIL=5 step "gemma2_b_$tokens" 120 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 --softcap 50 \
          --window 4096 --causal yes --packed no --inputs sinks_many --passes fwd --repeats 7 --inner 3 --seq-lens 8192 \
          --tokens "$tokens" --impls online clis_mgpu_cap tokamax_streamed --out "$OUT/gemma2_b_$tokens.json"
    done
    gemma2+=(--batch 4)
    ncu_forward ncu_gemma2_b4_ours 25 "ours clis cap" "${sections[@]}"
    ncu_forward ncu_gemma2_b4_tokamax 25 "tokamax online" "${sections[@]}" ;;
  gemma2_fwd)
    for inputs in sinks_many gaussian; do
      TAIL=8 step "gemma2_fwd_$inputs" 150 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 \
          --softcap 50 --window 4096 --causal yes --packed no --inputs "$inputs" --passes fwd --repeats 7 --inner 3 \
          --tokens 32768 --seq-lens 8192 32768 --impls online clis_mgpu_cap clis_cap_unrounded clis_cap_tc_sum \
          tokamax_streamed tokamax_mosaic --out "$OUT/gemma2_fwd_$inputs.json"
    done ;;
  ncu_gemma2)
    gemma2=(--heads 16 8 256 --softcap 50 --window 4096)
    for impl in ours tokamax; do  # ptxas's registers and spills first (sass_forward.py count reads the dumps here)
      TAIL=3 step "sass_gemma2_$impl" 90 python3 notes/experiments/sass_forward.py run --impl "$impl" "${gemma2[@]}" \
          --dump-dir "$OUT/dump_gemma2_$impl"
    done
    for impl in ours tokamax; do
      ncu_forward "ncu_gemma2_$impl" 60 "$impl online" "${sections[@]}"
    done ;;
  tokamax_grid)
    grid=(--causal yes --packed no --inputs sinks_many --passes fwd --repeats 7 --inner 3 --tokens 32768
          --seq-lens 8192 32768 --impls online tokamax_mosaic tokamax_persistent tokamax_streamed)
    TAIL=8 step grid_gemma2 150 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 --softcap 50 \
        --window 4096 "${grid[@]}" --out "$OUT/grid_gemma2.json"
    TAIL=8 step grid_w4096_d128 100 python3 scripts/bench_attention.py --suite llm --window 4096 "${grid[@]}" \
        --out "$OUT/grid_w4096_d128.json" ;;
  kernels_apart)
    parts=(python3 scripts/profile_backward.py --seq-lens 8192 32768 --overlap --repeats 5)
    if [ "$2" = more ]; then
      TAIL=9 step parts_d256 100 "${parts[@]}" --heads 16 8 256 --out "$OUT/parts_d256.json"
      TAIL=9 step parts_mla 100 "${parts[@]}" --heads 16 16 192 --value-dim 128 --out "$OUT/parts_mla.json"
      TAIL=20 step ptxas_d128 100 python3 notes/experiments/bwd_ptxas.py --dump-dir /tmp/ptxas --out "$OUT/ptxas_d128.json"
      TAIL=12 step ptxas_mla 100 python3 notes/experiments/bwd_ptxas.py --heads 16 16 192 --value-dim 128 \
          --dump-dir /tmp/ptxas_mla --out "$OUT/ptxas_mla.json"
    else
      TAIL=8 step dv_moved_tests 120 timeout -s INT 110 $GPU_TEST tests/test_pallas_mgpu.py -k "dv_moved" --durations 3
      TAIL=10 step parts_d128 100 "${parts[@]}" --out "$OUT/parts_d128.json"
      TAIL=10 step parts_cap50 100 "${parts[@]}" --softcap 50 --out "$OUT/parts_cap50.json"
      TAIL=8 step split_determinism 100 python3 notes/experiments/split_determinism.py
    fi ;;
  one_memory_warp)
    common=(--tokens 32768 --causal yes --packed no --inputs sinks_many --repeats 7 --inner 3)
    if [ "$2" = more ]; then  # the default (one warp) against four, after the GPU tests of the forward's features
      TAIL=8 step one_warp_tests 150 timeout -s INT 140 $GPU_TEST tests/test_pallas_mgpu.py \
          tests/test_sinks_and_split_heads.py --durations 3 \
          -k "streaming_warps_change or window_and_soft_cap_match or mla_matches or learned_sinks_on_the_mosaic"
      TAIL=8 step one_warp_cap50 90 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --softcap 50 --passes fwd --impls online online_four_warps tokamax_mosaic "${common[@]}" \
          --out "$OUT/one_warp_cap50.json"
      TAIL=14 step one_warp_gemma2 140 python3 scripts/bench_attention.py --suite llm --llm-heads 16 8 256 \
          --seq-lens 8192 32768 --softcap 50 --window 4096 --passes fwd fwd_bwd \
          --impls online online_four_warps tokamax_mosaic "${common[@]}" --out "$OUT/one_warp_gemma2.json"
      TAIL=14 step one_warp_mla 140 python3 scripts/bench_attention.py --suite llm --llm-heads 16 16 192 \
          --value-dim 128 --seq-lens 8192 32768 --passes fwd fwd_bwd --impls online online_four_warps tokamax_mosaic \
          "${common[@]}" --out "$OUT/one_warp_mla.json"
    else  # as first run, when one warp was opt-in (its impls are gone: their names now say four warps)
      TAIL=8 step one_warp_tests 170 timeout -s INT 160 $GPU_TEST tests/test_pallas_mgpu.py \
          -k "streaming_warps_change" --durations 3
      TAIL=28 step one_warp_d128 320 python3 scripts/bench_attention.py --suite llm --seq-lens 8192 32768 \
          --passes fwd fwd_bwd --impls online_four_warps online clis_mgpu_four_warps clis_mgpu cudnn tokamax_mosaic \
          "${common[@]}" --out "$OUT/one_warp_d128.json"
    fi ;;
  context_parallel)
    TAIL=12 step "context_parallel_${2:-1}" 300 python3 scripts/bench_context_parallel.py --seq 32768 \
        --heads 32 8 128 --context "${2:-1}" --family sinks_many --repeats 5 --inner 3 \
        --out "$OUT/context_parallel_${2:-1}.json" ;;
  *) echo "usage: bench_kernels.sh bwd_parts|llm_d128|llm_d64|sweep FAMILY PACKED|bidir FAMILY|diffusion|mla|"\
"mla_bwd_parts|mla_batch|delta_pass|lse FAMILY|d256|heads_per_cta|certify_rule FAMILY|soft_cap|sinks|profile|"\
"sass|one_memory_warp [more]|context_parallel [N]"; exit 2 ;;
esac
