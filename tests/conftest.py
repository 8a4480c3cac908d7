"""Test setup: 8 simulated CPU devices (for shard_map tests) and XLA's CPU backend at optimisation level 0, set
before JAX is imported; and the fast path: what `scripts/test.sh --fast` (pytest -m "not slow") leaves out, listed
in one place. The tests' programs are small and compiled once each, so compiling is most of their time: with level 0
and scripts/test.sh's compilation cache the fast path took 311 s against 467 s with the cache alone (BENCHMARKS.md
§7). Subprocesses (scripts, fault children) inherit both flags."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import collections  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

# Node-id patterns marked `slow` (CI's full run takes them all). The fast path (<= 5 minutes on two
# cores) keeps the float64 forward/gradient cases of the reference and the Triton kernels (interpreted),
# the reference's adversarial inputs, the lowering checks for an H200 and a TPU, the certificate's
# soundness, the trainer's core and its non-finite handling, the user commands' core; it leaves out
# the interpret-mode TPU backend's shared-base run, shape sweeps, the peer suites' families, the
# pretrained-like and real-activation sweeps, multi-run fault scenarios and the end-to-end scripts.
SLOW = [
    r"TestPallasTpu::",
    r"TestPallasGpu::(?!test_forward_and_gradients_match_float64)",
    r"TestReference::test_(queries_and_keys_of_different|head_dims_that|separate_query|vmap_over|local_window|"
    r"logits_soft_cap|works_with_x64|nan_in|real_activations|block_bound)",
    r"::test_peer_case_families",
    r"test_block_bound_certifies_pretrained_like_inputs",
    r"test_real_activations_of_a_trained_model",
    r"test_kills_during_checkpoint|test_a_damaged_checkpoint|test_errors_print_one_line|test_a_full_disk|"
    r"test_a_second_trainer",
    r"test_bench_(diffusion|attention|skipping|skip_rule|train|context_parallel)|test_multi_gpu_check|test_script_on_a_tiny_run",
    r"test_matches_maxtext_dot_product_with_packed_segments|test_clis_and_dot_product_agree|test_maxtext_train_loop",
    r"test_export_loads_back|::test_logits_match_transformers_llama|test_console_lines_tensorboard|"
    r"test_generate_is_reproducible|test_plot_run|test_generate_command",
    r"test_eight_devices_on_a_2x2x2_mesh|test_packed_documents_do_not_see|test_sft_tiny_trains|"
    r"test_resume_after_a_crash",
    r"test_forward_without_pingpong_lowers|test_mosaic_backward_lowers|test_calibration_finds|"
    r"test_shard_map_over_batch_and_heads|test_block_bound_is_sound_on_pretrained|test_certified_near_the_floor",
    r"test_pallas_tpu.py::test_document_ranges_(skip|change)|test_pallas_gpu.py::test_document_ranges_change",
    r"test_default_bound_certifies_pretrained_like_inputs|"
    r"test_default_block_bound_lowers_for_v5e_and_v6e\[TPU v6",
    r"test_mixture_resumes_mid_epoch_bit_exactly|test_eval_command_reads_a_prepared_run|test_worker_processes_are|"
    r"test_learned_sinks_match_maxtext_dot_product\[data2",
    r"test_sinks_and_split_heads.py::.*pallas_tpu|test_learned_sinks_match_float64\[(?!True-True)[^]]*pallas_gpu|"
    r"test_value_head_dim_other_than_the_qk_one\[128-pallas_gpu",
    r"test_skip_policy_skips_isolated|test_cached_decoding_gives_the_full_forward_logits|"
    r"test_attention_with_the_kernel_bound_is_exact_and_certifies\[True-packed_sinks|"
    r"test_kernel_bounds_match_xla_and_hold\[sink0-True-bfloat16|test_context_parallelism_matches_one_device",
    r"test_context_parallel_training_matches_one_device|test_uncertified_rows_fall_back|test_example_dit_attention_split|test_chunks_that_are_not_whole|test_context_parallel.py::test_(matches_one_device_and_float64\[(?!causal_gqa_packed-ring-zigzag)|certified_rows_add|"
    r"interpreted_triton)",
    r"test_model_families.py::(test_clis_matches_dense_attention_forward_and_gradients\[(?!gpt_oss)|"
    r"test_cached_decoding_matches_the_full_forward\[(?!deepseek)|test_family_presets_train|test_a_window_limits)",
    r"test_context_parallel_skipping_gives|test_example_dit_skipping_split",
    r"test_the_simulating_interpreter_gives_the_same_bits",
    r"test_context_parallel_training_of_an_mla_model|test_mla_value_head_dim_matches_one_device_and_float64\[False",
]


# Parametrized tests of which the fast path keeps only the first N cases (in collection order); CI's full run
# takes every case. Chosen from `scripts/test.sh --fast --durations=0` (2026-12-03: 496 s on the 2-core machine).
FAST_CASES = {
    "test_pallas_gpu.py::TestPallasGpu::test_forward_and_gradients_match_float64": 1,
    "test_reference.py::TestReference::test_forward_and_gradients_match_float64": 1,
    "test_stabilizer.py::test_bounds_hold_and_certified_tiles_are_within_tau": 24,
    "test_pallas_mgpu.py::test_kernel_lowers_for_the_gpu": 4,
    "test_pallas_mgpu.py::test_wide_heads_lower_as_mosaic_kernels": 2,
    "test_pallas_mgpu.py::test_window_and_soft_cap_lower_for_the_gpu": 2,
    "test_pallas_mgpu.py::test_mla_lowers_as_mosaic_kernels_with_v_unpadded": 2,
    "test_pallas_mgpu.py::test_lowers_with_x64_enabled": 1,
    "test_pallas_mgpu.py::test_fused_backward_lowers_as_one_kernel": 1,
    "test_pallas_mgpu.py::test_split_dq_backward_lowers_as_one_kernel": 1,
    "test_pallas_mgpu.py::test_document_ranges_lower_for_the_gpu": 1,
    "test_pallas_mgpu.py::test_heads_per_cta_lowers_for_the_gpu": 2,
    "test_sinks_and_split_heads.py::test_learned_sinks_match_float64": 1,
    "test_sinks_and_split_heads.py::test_value_head_dim_other_than_the_qk_one": 1,
    "test_sinks_and_split_heads.py::test_mosaic_gpu_forward_adds_the_sinks_in_its_epilogue": 2,
    "test_pallas_gpu_bounds.py::test_kernel_bounds_match_xla_and_hold": 2,
    "test_hf.py::test_logits_match_transformers_qwen": 1,
    "test_hf.py::test_logits_match_transformers_gemma2": 1,
    "test_hf.py::test_logits_match_transformers_gemma3": 0,
    "test_hf.py::test_a_gemma2_export_loads_in_transformers_with_the_same_logits": 0,
    "test_user_loop.py::test_eval_matches_a_direct_computation": 1,
    "test_user_loop.py::test_eval_command_writes_json": 1,
    "test_pallas_gpu.py::test_document_ranges_skip_the_blocks_where_documents_do_not_meet": 1,
    "test_faults.py::test_a_signal_in_the_step_loop_stops_at_the_step_boundary": 0,
    "test_faults.py::test_resume_writes_a_restart_record_and_a_finished_run_changes_nothing": 0,
    "test_maxtext.py::test_sliding_window_and_soft_cap_match_maxtext_dot_product": 1,
    "test_diffusion_skipping.py::test_skip_kernel_marks_like_the_reference_and_keeps_the_bound": 1,
    "test_context_parallel.py::test_mla_value_head_dim_matches_one_device_and_float64": 0,
    "test_pallas_gpu_bounds.py::test_attention_with_the_kernel_bound_is_exact_and_certifies": 0,
    "test_user_loop.py::test_export_matches_transformers": 0,
    "test_hf.py::test_logits_match_transformers_mistral_with_a_sliding_window": 0,
    "test_train.py::test_cudnn_attention_mask_matches_dot_product": 1,
    "test_reference.py::TestReference::test_huge_logits_stay_finite_and_exact": 1,
}


def _case_key(item) -> str:
  """'file::[Class::]function' of a collected test, without its parameters."""
  parts = item.nodeid.split("::")
  return "::".join([parts[0].rsplit("/", 1)[-1], *parts[1:-1], item.originalname])


def pytest_collection_modifyitems(config, items):
  kept = collections.Counter()
  for item in items:
    key = _case_key(item)
    if any(re.search(pattern, item.nodeid) for pattern in SLOW):
      item.add_marker(pytest.mark.slow)
    elif key in FAST_CASES:
      kept[key] += 1
      if kept[key] > FAST_CASES[key]:
        item.add_marker(pytest.mark.slow)
