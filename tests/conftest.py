"""Test setup: 8 simulated CPU devices (for shard_map tests), set before JAX is imported; and the
fast path: what `scripts/test.sh --fast` (pytest -m "not slow") leaves out, listed in one place."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import re  # noqa: E402

import pytest  # noqa: E402

# Node-id patterns marked `slow` (CI's full run takes them all). The fast path keeps every backend's
# float64 forward/gradient cases, the adversarial inputs on the reference and the Triton kernels in
# interpret mode, every lowering check, the certificate's soundness, the trainer and its faults,
# and the user commands; it leaves out the interpret-mode TPU backend's shared-base run (its lowering
# checks stay), the Triton interpret run's shape sweeps, the peer suites' families, the pretrained-like
# and real-activation sweeps past one case, and the end-to-end scripts.
SLOW = [
    r"TestPallasTpu::",
    r"TestPallasGpu::(?!test_forward_and_gradients_match_float64|test_attention_sink|test_huge_logits|test_rows_without)",
    r"TestReference::test_(queries_and_keys_of_different|head_dims_that|separate_query|vmap_over)",
    r"::test_peer_case_families",
    r"test_block_bound_certifies_pretrained_like_inputs\[(?!sink0-True)",
    r"test_real_activations_of_a_trained_model\[(6|11)\]",
    r"test_kills_during_checkpoint|test_a_damaged_checkpoint",
    r"test_bench_(diffusion|attention|skipping|train)|test_multi_gpu_check|test_script_on_a_tiny_run",
    r"test_matches_maxtext_dot_product_with_packed_segments|test_clis_and_dot_product_agree",
    r"test_export_loads_back|::test_logits_match_transformers_llama",
]


def pytest_collection_modifyitems(config, items):
  for item in items:
    if any(re.search(pattern, item.nodeid) for pattern in SLOW):
      item.add_marker(pytest.mark.slow)
