"""The model's structure fields beyond a named size: an untied output head, the output gate's activation and a
low-rank gate with a bias (what FLA checkpoints need, `osdn_jax.convert`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osdn_jax import models
from osdn_jax.layers import DGPSMixer
from osdn_jax.train import configs, loop, step

TOKENS = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def test_untied_head_gives_the_logits_and_the_loss():
  model = models.build("gdn-tiny", tie_embeddings=False, rngs=nnx.Rngs(1))
  assert model.head is not None and not np.array_equal(model.head[...], model.embed[...])
  logits = model(TOKENS)
  np.testing.assert_allclose(logits, jnp.einsum("btd,vd->btv", model.hidden(TOKENS), model.head[...]),
                             rtol=1e-5, atol=1e-5)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  batch = {"tokens": TOKENS[:, :-1], "targets": TOKENS[:, 1:], "loss_mask": jnp.ones((2, 7)),
           "segment_ids": jnp.zeros((2, 7), jnp.int32)}
  got = step.loss_sum(step.graphdef(model.cfg), params, batch, loss_chunk=4, segments_per_row=1)
  logp = jax.nn.log_softmax(model(TOKENS[:, :-1]), axis=-1)
  want = -jnp.sum(jnp.take_along_axis(logp, TOKENS[:, 1:, None], axis=-1))
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("activation, act", [("sigmoid", jax.nn.sigmoid), ("swish", jax.nn.silu)])
def test_output_gate(activation, act):
  cfg = models.config("gdn-tiny", output_gate=True, output_gate_activation=activation, output_gate_rank=8)
  mixer = DGPSMixer(cfg.mixer, rngs=nnx.Rngs(0))
  mixer.g_proj.proj.bias[...] = jax.random.normal(jax.random.key(2), (64,))   # the bias is read, not just 0
  x = jax.random.normal(jax.random.key(0), (2, 5, 64))
  o = jax.random.normal(jax.random.key(1), (2, 5, 2, 32))
  g_proj = mixer.g_proj
  gate = (x @ g_proj.down.kernel[...]) @ g_proj.proj.kernel[...] + g_proj.proj.bias[...]
  want = mixer.o_proj((mixer.o_norm(o) * act(gate.reshape(o.shape))).reshape(2, 5, -1))
  np.testing.assert_allclose(mixer._output(o, x), want, rtol=1e-5, atol=1e-6)


def test_bad_structure_fields_are_named():
  with pytest.raises(ValueError, match="`output_gate_activation` must be one of sigmoid, swish"):
    models.config("gdn-tiny", output_gate_activation="relu")
  with pytest.raises(ValueError, match="`tie_embeddings` must be a bool"):
    models.config("gdn-tiny", tie_embeddings="no")
  c = configs.tiny()
  c.model_fields = {"d_modl": 32}
  with pytest.raises(ValueError, match=r"`model_fields` of 'gdn-tiny': .*unknown field\(s\) 'd_modl'"):
    configs.validate(c)
  c.model_fields = {"d_model": 32, "num_heads": 4, "tie_embeddings": False}
  configs.validate(c)
  cfg = loop.model_config(c, 256)
  assert (cfg.d_model, cfg.num_heads, cfg.tie_embeddings) == (32, 4, False)
