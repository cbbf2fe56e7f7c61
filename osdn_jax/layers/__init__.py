"""Flax NNX layers: the DGPS token mixer (one module for every registry point), short conv, norms, MLP.

    from osdn_jax import layers
    cfg = layers.MixerConfig("pgdn", d_model=1024, num_heads=8)
    mixer = layers.DGPSMixer(cfg, rngs=nnx.Rngs(0))
    y = mixer(x)                                       # x [B, T, D]
    y, cache = mixer(x, return_cache=True)             # prefill
    y_t, cache = mixer.step(x_t, cache)                # one token
"""
from osdn_jax.layers.conv import ShortConv
from osdn_jax.layers.mixer import DGPSMixer, FeatureProjection, LayerCache, MixerConfig, is_kda_family
from osdn_jax.layers.mlp import SwiGLU, hidden_width
from osdn_jax.layers.norms import RMSNorm

__all__ = ["DGPSMixer", "FeatureProjection", "LayerCache", "MixerConfig", "RMSNorm", "ShortConv", "SwiGLU",
           "hidden_width", "is_kda_family"]
