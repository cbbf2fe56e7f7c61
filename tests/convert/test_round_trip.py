"""osdn-jax → FLA / Hugging Face directory → osdn-jax is exact for every family: the same parameters bit for bit,
the same logits, and the same FLA config when written again."""
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from osdn_jax import convert
from osdn_jax.convert import safetensors_io
from tests.convert import helpers

TOKENS = jnp.array([[1, 5, 9, 2, 33, 63, 0, 7, 7, 12], [3, 3, 60, 1, 0, 2, 9, 40, 41, 8]])


def _same(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: x.dtype == y.dtype and np.array_equal(x, y), a, b)))


@pytest.mark.parametrize("point", list(helpers.CONFIGS))
def test_round_trip_is_exact(point, tmp_path):
  model = helpers.model(point)
  convert.save_fla(model, tmp_path / "a")
  cfg, params = convert.read_fla(tmp_path / "a")
  assert _same(convert.model_params(model), params)
  back = convert.build(cfg, params)
  np.testing.assert_array_equal(np.asarray(back(TOKENS)), np.asarray(model(TOKENS)))
  convert.write_fla(cfg, params, tmp_path / "b")
  first, second = (json.loads((tmp_path / d / "config.json").read_text()) for d in "ab")
  assert first == second
  assert convert.read_fla(tmp_path / "b")[0] == cfg


def test_changed_weight_changes_the_logits(tmp_path):
  """The logits comparison above can fail: one weight of one layer changed in the file shows in them."""
  model = helpers.model("gdn")
  convert.save_fla(model, tmp_path)
  tensors = safetensors_io.read_tensors(tmp_path)
  tensors["model.layers.1.attn.a_proj.weight"] = tensors["model.layers.1.attn.a_proj.weight"] * 1.5
  safetensors_io.write_tensors(tmp_path, tensors)
  back = convert.load_fla(tmp_path)
  assert not np.array_equal(np.asarray(back(TOKENS)), np.asarray(model(TOKENS)))


def test_sharded_and_bf16_files(tmp_path):
  """Shards listed by model.safetensors.index.json read as one file does; bf16 tensors read as their values."""
  model = helpers.model("kda")
  convert.save_fla(model, tmp_path / "whole")
  convert.save_fla(model, tmp_path / "shards", max_shard_bytes=20_000)
  assert (tmp_path / "shards" / safetensors_io.INDEX).is_file()
  assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 2
  assert _same(convert.read_fla(tmp_path / "whole")[1], convert.read_fla(tmp_path / "shards")[1])
  convert.save_fla(model, tmp_path / "bf16", dtype="bfloat16")
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  rounded = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), convert.model_params(model))
  assert _same(convert.read_fla(tmp_path / "bf16")[1], rounded)
