"""Decoder-only language models for every DGPS point, their named configs and recurrent decoding.

    from osdn_jax import models
    cfg = models.config("pgdn-340m")                  # any "<point>-<size>", sizes tiny | 340m | 1b | 1.3b
    print(models.summary(cfg))                        # parameters, FLOPs per token, state bytes
    model = models.build("pgdn-tiny", rngs=nnx.Rngs(0))
    logits = model(tokens)                            # [B, T] → [B, T, vocab]
    out, state = models.generate(model, prompt, 32)   # jitted prefill + lax.scan of one-token steps
"""
from osdn_jax.models.config import SIZES, STRUCTURE_FIELDS, ModelConfig, config, names, structure_fields
from osdn_jax.models.decoding import DecodeState, generate, prefill, sample, step
from osdn_jax.models.lm import Block, Cache, LanguageModel, build, count_params, param_shapes
from osdn_jax.models.summary import Summary, param_counts, state_bytes, summary

__all__ = ["SIZES", "STRUCTURE_FIELDS", "Block", "Cache", "DecodeState", "LanguageModel", "ModelConfig", "Summary",
           "build", "config", "count_params", "generate", "names", "param_counts", "param_shapes", "prefill", "sample",
           "state_bytes", "step", "structure_fields", "summary"]
