"""What the converter refuses, by name: unknown, missing and misshapen tensors, config fields it does not know or
cannot express, and models FLA has no counterpart of."""
import json

import pytest

from osdn_jax import convert
from osdn_jax.convert import safetensors_io
from tests.convert import helpers


@pytest.fixture
def gdn_dir(tmp_path):
  convert.save_fla(helpers.model("gdn"), tmp_path)
  return tmp_path


def _edit_tensors(directory, fn):
  tensors = safetensors_io.read_tensors(directory)
  fn(tensors)
  safetensors_io.write_tensors(directory, tensors)


def _edit_config(directory, **changes):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def test_unknown_tensor(gdn_dir):
  _edit_tensors(gdn_dir, lambda t: t.__setitem__("model.layers.0.attn.q_norm.weight", t["model.norm.weight"]))
  with pytest.raises(convert.Unsupported, match=r"'model\.layers\.0\.attn\.q_norm\.weight'.*no parameter"):
    convert.read_fla(gdn_dir)


def test_missing_tensor(gdn_dir):
  _edit_tensors(gdn_dir, lambda t: t.pop("model.layers.1.attn.dt_bias"))
  with pytest.raises(convert.Unsupported, match=r"'model\.layers\.1\.attn\.dt_bias' is missing"):
    convert.read_fla(gdn_dir)


def test_misshapen_tensor(gdn_dir):
  _edit_tensors(gdn_dir, lambda t: t.__setitem__("model.layers.0.attn.o_proj.weight",
                                                 t["model.layers.0.attn.o_proj.weight"][:, :8]))
  with pytest.raises(convert.Unsupported, match=r"'model\.layers\.0\.attn\.o_proj\.weight' has shape \[32, 8\]"):
    convert.read_fla(gdn_dir)


def test_untied_head_in_a_tied_config(tmp_path):
  convert.save_fla(helpers.model("pgdn"), tmp_path)
  _edit_tensors(tmp_path, lambda t: t.__setitem__("lm_head.weight", t["model.embeddings.weight"] * 2))
  with pytest.raises(convert.Unsupported, match=r"'lm_head\.weight' differs .*tie_word_embeddings"):
    convert.read_fla(tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("allow_neg_eigval", True, r"`allow_neg_eigval` = True is not supported"),
    ("use_short_conv", False, r"`use_short_conv` = False is not supported"),
    ("attnres_block_size", 2, r"`attnres_block_size` = 2 is not supported"),
    ("attn", {"layers": [1], "num_heads": 2}, r"`attn` = .* hybrid attention"),
    ("hidden_act", "powlu", r"`hidden_act` = 'powlu'"),
    ("output_gate_activation", "relu", r"`output_gate_activation` = 'relu'"),
    ("qk_rope", True, r"config field\(s\) 'qk_rope' unknown"),
])
def test_config_fields(gdn_dir, field, value, message):
  _edit_config(gdn_dir, **{field: value})
  with pytest.raises(convert.Unsupported, match=message):
    convert.read_fla(gdn_dir)


@pytest.mark.parametrize("point, field, value, message", [
    ("dn", "qk_norm", "sum", r"`qk_norm` = 'sum'"),
    ("dn", "use_beta", False, r"`use_beta` = False"),
    ("kda", "lower_bound", -5.0, r"`lower_bound` = -5\.0"),
    ("kda", "safe_gate", True, r"`safe_gate` = True"),
    ("pkda", "num_v_heads", 4, r"`num_v_heads` \(4\) ≠ `num_heads` \(2\)"),
])
def test_family_fields(tmp_path, point, field, value, message):
  convert.save_fla(helpers.model(point), tmp_path)
  _edit_config(tmp_path, **{field: value})
  with pytest.raises(convert.Unsupported, match=message):
    convert.read_fla(tmp_path)


def test_unknown_family(gdn_dir):
  _edit_config(gdn_dir, model_type="mesa_net", architectures=["MesaNetForCausalLM"])
  with pytest.raises(convert.Unsupported, match=r"model_type 'mesa_net'"):
    convert.read_fla(gdn_dir)


def test_no_safetensors(gdn_dir):
  (gdn_dir / "model.safetensors").rename(gdn_dir / "pytorch_model.bin")
  with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin .*safe_serialization=True"):
    convert.read_fla(gdn_dir)


@pytest.mark.parametrize("point, overrides, message", [
    ("osdn", {}, r"point 'osdn' has no FLA model"),
    ("dn", dict(output_gate_activation="sigmoid"), r"swish of a full-rank projection"),
    ("gdn", dict(output_gate_rank=8), r"swish or sigmoid of a full-rank projection"),
    ("dn", dict(num_value_heads=4), r"no grouped value heads"),
    ("kda", dict(output_gate_rank=None), r"σ of a rank-V projection"),
    ("kda", dict(gate_rank=8), r"rank V = 16; this model's `gate_rank` is 8"),
    ("pkda", dict(num_value_heads=4), r"`num_value_heads` \(4\) ≠ `num_heads` \(2\)"),
])
def test_to_fla_refusals(tmp_path, point, overrides, message):
  base = point if point in helpers.CONFIGS else "dn"
  cfg = helpers.config(base, **overrides).replace(variant=point)
  with pytest.raises(convert.Unsupported, match=message):
    convert.fla_config.to_fla(cfg)
