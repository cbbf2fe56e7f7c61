"""Golden files from FLA's language models for CI: small random models of each family FLA has and `osdn_jax.convert`
reads, saved as FLA saves them, with their logits on fixed token ids and one decoding step.

Needs torch, FLA (fla-core and flash-linear-attention 0.6.0, with einops and transformers ≥ 5.6.2), numpy and
safetensors on a GPU; imports nothing of osdn-jax, so it runs wherever FLA runs. Writes, per family,
tests/fixtures/fla_models/<family>/:

  config.json, model.safetensors   save_pretrained's output (fp32 weights)
  golden.npz                       tokens [B, T]; logits_fp32, logits_bf16 [B, T, vocab] (the model in fp32, then cast
                                   to bf16 whole as FLA runs in bf16); step_token [B] and step_logits [B, vocab] (one
                                   decoding step after the prefix, fp32); S_<l> (the prefix's final recurrent state of
                                   layer l, in FLA's layout) and A_<l> (the preconditioner's, PGDN and PKDA)
  provenance.json                  the command, versions, GPU, FLA's kernel mode per dtype and any step that failed

tests/convert/test_fla_models_golden.py converts each directory and compares without torch.

  python -m experiments.fla_models_golden [--out tests/fixtures/fla_models] [--families kda,...] [--one-config]

--one-config keeps only the first of each FLA kernel's autotuning configs (`experiments.fla_golden`): block sizes
change only the order of FLA's fp32 accumulations, and autotuning takes minutes per kernel without it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

COMMON = dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, intermediate_size=128, norm_eps=1e-5,
              conv_size=4, fuse_cross_entropy=False, initializer_range=0.02)
# (config class, model class, the family's fields). K = 16 ≠ V = 32 everywhere (a transposed state shows in its
# shape), grouped value heads where FLA has them, each output gate and both embedding choices.
FAMILIES = {
    "delta_net": ("DeltaNetConfig", "DeltaNetForCausalLM",
                  dict(num_heads=2, expand_k=0.5, expand_v=1.0, use_gate=True, tie_word_embeddings=False)),
    "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM",
                       dict(num_heads=2, num_v_heads=4, head_dim=16, expand_v=2.0, use_gate=True,
                            tie_word_embeddings=False)),
    "kda": ("KDAConfig", "KDAForCausalLM",
            dict(num_heads=2, num_v_heads=4, head_dim=16, expand_v=2.0, tie_word_embeddings=True)),
    "precond_gated_deltanet": ("PrecondGatedDeltaNetConfig", "PrecondGatedDeltaNetForCausalLM",
                               dict(num_heads=2, head_dim=16, expand_v=2.0, use_gate=False, squash_x=1.7,
                                    tie_word_embeddings=True)),
    "precond_kda": ("PrecondKDAConfig", "PrecondKDAForCausalLM",
                    dict(num_heads=2, head_dim=16, expand_v=2.0, log_atk_scale_init=-0.5,
                         tie_word_embeddings=False)),
}
BATCH, LENGTH = 2, 100    # T spans FLA's 64-token chunk boundary (and FLA's models switch to their recurrent
                          # kernels at T ≤ 64 in eval mode)
SEED = 0
KEEP_INIT = ("A_log", "dt_bias", "A_log_atk", "dt_bias_atk", "log_atk_scale")


def randomise(model, seed: int) -> None:
  """New random values for every parameter, so that no mapping error hides behind a constant: matrices N(0, 1/fan_in)
  (conv filters N(0, 1/4), the embedding N(0, 1)), vectors (norm weights) 1 + N(0, 0.1²), biases N(0, 0.1²), and
  the gates' A_log, dt_bias and PDN's center FLA's initial values + N(0, 0.1²). Every value is rounded to bf16
  (and kept in fp32), so the bf16 model holds exactly the fp32 model's weights."""
  import torch
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
      if name.split(".")[-1] in KEEP_INIT:
        value = p.detach().float().cpu() + 0.1 * noise
      elif name.endswith("bias"):
        value = 0.1 * noise
      elif p.ndim == 1:
        value = 1.0 + 0.1 * noise
      elif "conv1d" in name:
        value = 0.5 * noise
      elif "embeddings" in name:
        value = noise
      else:
        value = noise / p.shape[-1] ** 0.5
      p.copy_(value.to(torch.bfloat16).to(p.device, p.dtype))


def _np(t):
  return t.detach().float().cpu().numpy()


def run_family(family: str, out: str) -> dict:
  import torch
  import fla.models as fla_models
  config_cls, model_cls, fields = FAMILIES[family]
  config = getattr(fla_models, config_cls)(**COMMON, **fields)
  torch.manual_seed(SEED)
  model = getattr(fla_models, model_cls)(config).cuda().eval()
  randomise(model, SEED)
  directory = os.path.join(out, family)
  os.makedirs(directory, exist_ok=True)
  try:
    model.save_pretrained(directory, safe_serialization=True)
  except TypeError:   # transformers 5 writes safetensors only and has no such argument
    model.save_pretrained(directory)
  if not any(name.endswith(".safetensors") for name in os.listdir(directory)):
    raise RuntimeError(f"{family}: save_pretrained wrote no .safetensors file into {directory}")
  rng = np.random.default_rng(SEED)
  tokens = rng.integers(0, COMMON["vocab_size"], size=(BATCH, LENGTH + 1))
  prefix, step_token = tokens[:, :LENGTH], tokens[:, LENGTH]
  ids = torch.tensor(prefix, device="cuda")
  golden = {"tokens": prefix.astype(np.int32), "step_token": step_token.astype(np.int32)}
  record = {"family": family, "modes": {}, "failed": {}}

  def forward(m, what):
    """FLA's forward on the prefix: its chunked kernels, else (when they refuse the dtype) its recurrent ones."""
    for mode in ("chunk", "fused_recurrent"):
      for layer in m.model.layers:
        layer.attn.mode = mode
      try:
        with torch.no_grad():
          return m(input_ids=ids, use_cache=what == "fp32"), mode
      except Exception as e:  # noqa: BLE001 — recorded; the recurrent kernels are tried next
        record["failed"][f"{what} {mode}"] = f"{type(e).__name__}: {str(e)[:300]}"
    raise RuntimeError(f"{family}: FLA's {what} forward failed in both modes: {record['failed']}")

  out32, record["modes"]["fp32"] = forward(model, "fp32")
  golden["logits_fp32"] = _np(out32.logits)
  cache = out32.past_key_values
  try:
    for layer in range(config.num_hidden_layers):
      state = cache[layer]
      S, A = state["recurrent_state"], state.get("A_state")
      if isinstance(S, (tuple, list)):   # FLA 0.6's preconditioned layers: (recurrent state, second moment)
        S, A = S
      golden[f"S_{layer}"] = _np(S)
      if A is not None:
        golden[f"A_{layer}"] = _np(A)
    with torch.no_grad():
      step = model(input_ids=torch.tensor(step_token[:, None], device="cuda"), past_key_values=cache, use_cache=True)
    golden["step_logits"] = _np(step.logits[:, -1])
  except Exception as e:  # noqa: BLE001 — the state and step are optional goldens
    record["failed"]["decoding step"] = f"{type(e).__name__}: {str(e)[:300]}"
  model16 = model.to(torch.bfloat16)
  try:
    out16, record["modes"]["bf16"] = forward(model16, "bf16")
    golden["logits_bf16"] = _np(out16.logits)
  except Exception as e:  # noqa: BLE001
    record["failed"]["bf16"] = f"{type(e).__name__}: {str(e)[:300]}"
  np.savez_compressed(os.path.join(directory, "golden.npz"), **golden)
  record["shapes"] = {k: list(v.shape) for k, v in golden.items()}
  return record


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="tests/fixtures/fla_models")
  ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {tuple(FAMILIES)}")
  ap.add_argument("--one-config", action="store_true", help="keep the first FLA autotuning config only")
  args = ap.parse_args()
  families = args.families.split(",")
  if not set(families) <= set(FAMILIES):
    raise ValueError(f"--families={args.families}: expected a subset of {tuple(FAMILIES)}")
  if args.one_config:
    from experiments.fla_golden import keep_first_autotune_config
    keep_first_autotune_config()
  import fla
  import torch
  import transformers
  versions = {"fla": getattr(fla, "__version__", "?"), "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name(0)}
  for family in families:
    record = run_family(family, args.out)
    record.update(versions, command="python -m experiments.fla_models_golden " + " ".join(sys.argv[1:]))
    with open(os.path.join(args.out, family, "provenance.json"), "w") as f:
      json.dump(record, f, indent=2, sort_keys=True)
      f.write("\n")
    print(family, json.dumps({k: record[k] for k in ("modes", "failed")}), flush=True)


if __name__ == "__main__":
  main()
