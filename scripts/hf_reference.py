"""Writes a tiny random Hugging Face Llama (or, with --mistral-window W, a Mistral with sliding window W; with
--gemma2 / --gemma3, a Gemma 2 / Gemma 3 text model; with --qwen 2 / 3, a Qwen 2 (q, k, v biases) / Qwen 3 (QK norms)) as safetensors, and its
logits on fixed tokens.

Runs under a Python with torch + transformers (scripts/setup.sh makes .venv-hf with
Python 3.11 and the CPU torch wheel); tests/test_hf.py compares our Flax model's logits,
after importing the safetensors, against the ones written here. With --load it instead loads
a folder `clis-train export` wrote (AutoModelForCausalLM.from_pretrained: Llama or Gemma 2) and writes its logits
on the tokens in --tokens.

  .venv-hf/bin/python scripts/hf_reference.py --out /tmp/hf_tiny
  .venv-hf/bin/python scripts/hf_reference.py --load EXPORTED --tokens tokens.npy --out logits.npy
"""

import argparse
import json
import pathlib

import numpy as np
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=512, attention_bias=False, mlp_bias=False)


# Gemma 2's block with every option biting at 64 tokens: window 16 on layers 0 and 2, caps small enough to bend
# random logits, and a query_pre_attn_scalar other than the head dim.
GEMMA2 = dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512, attention_bias=False,
              query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
              attn_implementation="eager")


# Gemma 3's block (QK norms) with two RoPEs: full layers at base 1e6 with linear scaling 8 (Gemma 3 4B+), sliding
# ones at base 1e4; window 16 on layers 0 and 1 of 3 (sliding_window_pattern 3).
GEMMA3 = dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
              tie_word_embeddings=True, max_position_embeddings=512, attention_bias=False, query_pre_attn_scalar=24,
              sliding_window=16, sliding_window_pattern=3,
              rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
              attn_implementation="eager")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--load", default=None, help="an exported folder to load instead of a random model")
  parser.add_argument("--tokens", default=None, help="with --load: int tokens [B, S] (.npy)")
  parser.add_argument("--rope-scaling", type=float, nargs=4, default=None,
                      metavar=("FACTOR", "LOW", "HIGH", "ORIGINAL"), help="Llama 3's RoPE scaling for the random model")
  parser.add_argument("--mistral-window", type=int, default=None,
                      help="a Mistral with this sliding_window (shorter than the 64 tokens) instead of a Llama")
  parser.add_argument("--gemma2", action="store_true", help="a Gemma 2 (GEMMA2 below) instead of a Llama")
  parser.add_argument("--gemma3", action="store_true", help="a Gemma 3 text model (GEMMA3 below) instead of a Llama")
  parser.add_argument("--qwen", type=int, choices=[2, 3], default=None, help="a Qwen 2 or 3 of TINY's dims")
  args = parser.parse_args()
  if args.load:
    model = AutoModelForCausalLM.from_pretrained(args.load, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
      logits = model(torch.from_numpy(np.load(args.tokens).astype(np.int64))).logits.numpy()
    np.save(args.out, logits)
    return
  out = pathlib.Path(args.out)
  torch.manual_seed(args.seed)
  config = dict(TINY)
  if args.rope_scaling:
    factor, low, high, original = args.rope_scaling
    config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                              "high_freq_factor": high, "original_max_position_embeddings": int(original)}
  if args.gemma2:
    config = dict(GEMMA2)
    model = Gemma2ForCausalLM(Gemma2Config(**config)).float().eval()
  elif args.gemma3:
    config = dict(GEMMA3)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**config)).float().eval()
  elif args.qwen:
    config = {k: v for k, v in TINY.items() if k not in ("attention_bias", "mlp_bias")}
    config["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]  # Qwen 3's default is 128
    make, kind = (Qwen2ForCausalLM, Qwen2Config) if args.qwen == 2 else (Qwen3ForCausalLM, Qwen3Config)
    model = make(kind(**config)).float().eval()
  elif args.mistral_window:
    config["sliding_window"] = args.mistral_window
    model = MistralForCausalLM(MistralConfig(**config)).float().eval()
  else:
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
  with torch.no_grad():  # HF's init leaves norms at 1 (Gemma's (1 + w) at w = 0); randomise them
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(-0.5, 0.5) if args.gemma2 or args.gemma3 else p.uniform_(0.5, 1.5)
      elif name.endswith("bias"):  # HF's init zeroes biases too
        p.uniform_(-0.5, 0.5)
  model.save_pretrained(out, safe_serialization=True)
  tokens = torch.from_numpy(np.random.default_rng(args.seed).integers(0, TINY["vocab_size"], (2, 64)))
  with torch.no_grad():
    logits = model(tokens).logits.numpy()
  np.save(out / "tokens.npy", tokens.numpy())
  np.save(out / "logits.npy", logits)
  (out / "tiny_config.json").write_text(json.dumps(config))


if __name__ == "__main__":
  main()
