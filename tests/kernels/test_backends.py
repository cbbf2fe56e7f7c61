"""The Pallas backends in the one `implementation` vocabulary (`osdn_jax.ops.dispatch`): "pallas-gpu" and
"pallas-tpu" choose that platform's kernels, in interpret mode on this CPU backend, and agree with the reference
through the public ops (outputs, final states and, for the online solve, the gradients of q, k, v and β) and
through DGPS points whose passes have kernels of both platforms (PDN: the second moment and its key; OSDN: the
d-pass); "pallas" keeps this backend's kernels, "auto" keeps XLA on a CPU, and an unknown value raises a
ValueError that lists the values.

Interpret mode is slow (the TPU interpreter most): one tiny shape per case, odd lengths. Each implementation runs as
one jitted program, finished before the next is dispatched (`_finished`): the TPU interpreter's callbacks run JAX
ops of their own, which can deadlock against ops dispatched eagerly meanwhile on a CPU with few cores.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from osdn_jax import dgps, ops
from osdn_jax.ops import dispatch
from osdn_jax.testing import assert_trees_close, random_point_inputs, random_problem, vjp_all
from pallas_kernels.gpu import delta_rule as gpu_delta_rule
from pallas_kernels.spec import Spec
from pallas_kernels.tpu import delta_rule as tpu_delta_rule
from pallas_kernels.tpu import osdn as tpu_osdn

PLATFORMS = ("pallas-gpu", "pallas-tpu")
F32 = jnp.float32


def _request(op="delta_rule", platform="cpu", **fields):
  """A small fp32 request of `op` on `platform` (what `dispatch.spec` builds on that backend)."""
  fields = {"dtype": "float32", "key_dim": 16, "value_dim": 16, "batch": 1, "length": 41, "heads": 2,
            "value_heads": 2, "chunk_size": 16, **fields}
  return Spec(op=op, platform=platform, **fields)


@pytest.fixture
def chosen(monkeypatch):
  """{op: the module of every kernel `dispatch` chose for it} over the test."""
  seen, lookup = {}, dispatch.kernel

  def spy(request):
    fn = lookup(request)
    if fn is not None:
      seen.setdefault(request.op, set()).add(fn.__module__)
    return fn
  monkeypatch.setattr(dispatch, "kernel", spy)
  return seen


def _platform(impl):
  """The kernels' package of "pallas-gpu" / "pallas-tpu"."""
  return "pallas_kernels." + dispatch.PLATFORMS[impl]


def _interpreted(got, fn) -> bool:
  """Whether `got` is what `dispatch.choose` returns for `fn`, a kernel of another platform than the backend's."""
  return (isinstance(got, functools.partial) and got.func is fn and not got.args
          and got.keywords == {"interpret": True})


def _finished(fn, *args):
  """jax.jit(fn)(*args), waited for."""
  return jax.block_until_ready(jax.jit(fn)(*args))


def test_vocabulary_is_one_list():
  assert dispatch.IMPLEMENTATIONS == ("auto", "reference", "xla", "pallas", "pallas-gpu", "pallas-tpu")
  assert dispatch.NAMES == dispatch.IMPLEMENTATIONS + ("naive",)
  assert [dispatch.normalize("op", n) for n in dispatch.NAMES] == list(dispatch.IMPLEMENTATIONS) + ["reference"]
  assert [n for n in dispatch.IMPLEMENTATIONS if dispatch.is_pallas(n)] == ["pallas", "pallas-gpu", "pallas-tpu"]


def test_choose_targets_the_named_platform():
  """On a CPU backend: "pallas" is the GPU kernel as it is (it interprets on a CPU by default), "pallas-gpu" and
  "pallas-tpu" that platform's kernel with interpret=True, "auto" XLA. On a TPU or GPU backend the kernel of that
  platform runs as it is, the other platform's in interpret mode."""
  cpu = _request()
  assert dispatch.choose(cpu, "pallas") == ("pallas", gpu_delta_rule.delta_rule)
  assert dispatch.choose(cpu, "auto") == ("xla", None)
  kind, fn = dispatch.choose(cpu, "pallas-gpu")
  assert kind == "pallas" and _interpreted(fn, gpu_delta_rule.delta_rule)
  kind, fn = dispatch.choose(cpu, "pallas-tpu")
  assert kind == "pallas" and _interpreted(fn, tpu_delta_rule.delta_rule)
  kind, fn = dispatch.choose(_request("osdn_d_pass", value_dim=0), "pallas-tpu")
  assert _interpreted(fn, tpu_osdn.d_pass)
  tpu, gpu = _request(platform="tpu"), _request(platform="gpu")
  assert dispatch.choose(tpu, "pallas-tpu") == dispatch.choose(tpu, "pallas") == ("pallas", tpu_delta_rule.delta_rule)
  assert dispatch.choose(tpu, "auto") == ("pallas", tpu_delta_rule.delta_rule)
  assert _interpreted(dispatch.choose(tpu, "pallas-gpu")[1], gpu_delta_rule.delta_rule)
  assert dispatch.choose(gpu, "pallas-gpu") == ("pallas", gpu_delta_rule.delta_rule)
  assert _interpreted(dispatch.choose(gpu, "pallas-tpu")[1], tpu_delta_rule.delta_rule)


def test_unsupported_request_names_the_platform():
  for impl, platform in (("pallas", "cpu"), ("pallas-gpu", "gpu"), ("pallas-tpu", "tpu")):
    with pytest.raises(ValueError, match=f"`implementation`='{impl}' has no kernel .* on platform '{platform}'"):
      dispatch.choose(_request(dtype="float64"), impl)
  with pytest.raises(ValueError, match="platform 'tpu' \\(in interpret mode on backend 'cpu'\\)"):
    dispatch.choose(_request("decayed_sum", packed=True), "pallas-tpu")
  assert dispatch.choose(_request(dtype="float64", platform="tpu"), "auto") == ("xla", None)
  q = jnp.zeros((1, 3, 2, 16), jnp.float64)
  with pytest.raises(ValueError, match="`implementation`='pallas-tpu' has no kernel"):
    ops.delta_rule(q, q, q, jnp.ones((1, 3, 2), jnp.float64), implementation="pallas-tpu")
  ids = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="`implementation`='pallas-gpu' with traced `segment_ids` needs N static"):
    jax.jit(lambda s: ops.linear_attention(q.astype(F32), q.astype(F32), q.astype(F32), segment_ids=s,
                                           implementation="pallas-gpu"))(ids)


def test_unknown_value_lists_the_values():
  """The solves and a DGPS point: a ValueError that lists the values (the configs: the next test)."""
  q = jnp.zeros((1, 3, 2, 16), F32)
  point = dgps.get("pdn")
  inputs = random_point_inputs(point, dgps.Dims(heads=2, value_heads=2, key_dim=16, value_dim=16), seed=0, B=1, T=3)
  values = "\\('auto', 'reference', 'xla', 'pallas', 'pallas-gpu', 'pallas-tpu'\\)"
  for call in (lambda: ops.delta_rule(q, q, q, jnp.ones((1, 3, 2), F32), implementation="pallas-cuda"),
               lambda: ops.linear_attention(q, q, q, implementation="tpu"),
               lambda: point(*inputs, implementation="gpu")):
    with pytest.raises(ValueError, match=f"`implementation` must be one of {values}"):
      call()


@pytest.mark.parametrize("impl", PLATFORMS)
def test_every_config_accepts_the_platforms(impl):
  """The layers' and models' options and the trainer's config take the new values and refuse unknown ones."""
  pytest.importorskip("flax")
  pytest.importorskip("ml_collections")
  from osdn_jax import models
  from osdn_jax.layers import mixer
  from osdn_jax.train import configs
  mixer.check_options("test", output_gate=None, norm_eps=1e-6, implementation=impl)
  assert models.config("gdn-340m", implementation=impl).implementation == impl
  c = configs.base()
  c.implementation = impl
  configs.validate(c)
  c.implementation = "pallas_tpu"
  with pytest.raises(ValueError, match="`implementation` must be one of .*'pallas-tpu'"):
    configs.validate(c)


def _delta_rule(impl):
  """`ops.delta_rule` as `vjp_all` calls it (every array by name), with the final state."""
  def call(q, k, v, beta, k_write=None, log_decay=None, initial_state=None):
    return ops.delta_rule(q, k, v, beta, k_write=k_write, log_decay=log_decay, initial_state=initial_state,
                          output_final_state=True, chunk_size=16, implementation=impl)
  return call


@pytest.mark.parametrize("impl", PLATFORMS)
def test_delta_rule_matches_reference(impl, chosen):
  """The online solve (T = 41 over chunks of 16, scalar decay, a carried state): o, S and the gradients of every
  input, q, k, v and β among them."""
  arrays = random_problem(3, B=1, T=41, H=2, K=16, V=16, decay="scalar").arrays(F32)
  got = _finished(lambda a: vjp_all(_delta_rule(impl), a), arrays)
  want = _finished(lambda a: vjp_all(_delta_rule("reference"), a), arrays)
  assert {"o", "S", "q", "k", "v", "beta"} <= set(got)
  assert_trees_close(got, want, F32)
  assert all(m.startswith(_platform(impl)) for m in chosen.pop("delta_rule")) and not chosen


@pytest.mark.parametrize("impl", PLATFORMS)
def test_linear_attention_matches_reference(impl, chosen):
  """The offline solve (B = 2, T = 37 over chunks of 16, per-channel decay, GVA): o and S."""
  a = random_problem(4, B=2, T=37, H=1, HV=2, K=16, V=16, decay="channel", initial_state=False).arrays(F32)
  run = lambda name: _finished(lambda a: ops.linear_attention(
      a["q"], a["k"], a["v"], beta=a["beta"], log_decay=a["log_decay"], output_final_state=True, chunk_size=16,
      implementation=name), a)
  o, S = run(impl)
  o_ref, S_ref = run("reference")
  assert_trees_close({"o": o, "S": S}, {"o": o_ref, "S": S_ref}, F32)
  assert all(m.startswith(_platform(impl)) for m in chosen.pop("linear_attention")) and not chosen


@pytest.mark.parametrize("name", ("pdn", "osdn"))
@pytest.mark.parametrize("impl", PLATFORMS)
def test_point_matches_reference(name, impl, chosen):
  """A DGPS point whose preconditioner pass has kernels of both platforms (PDN: the second moment and the fused
  key; OSDN: the clipped d-pass) and its solve, forward: o and the final states."""
  point = dgps.get(name)
  dims = dgps.Dims(heads=2, value_heads=2, key_dim=16, value_dim=16)
  q, k, v, features, params = random_point_inputs(point, dims, seed=5, B=1, T=33)
  run = lambda i: _finished(lambda *x: point(*x, output_final_state=True, chunk_size=16, implementation=i),
                            q, k, v, features, params)
  (o, st), (o_ref, st_ref) = run(impl), run("reference")
  got = {"o": o, "S": st["S"], "precond": st["precond"]}
  want = {"o": o_ref, "S": st_ref["S"], "precond": st_ref["precond"]}
  assert_trees_close(got, want, F32)
  passes = {"pdn": {"precond_key", "delta_rule"}, "osdn": {"osdn_d_pass", "delta_rule"}}[name]
  if name == "osdn" and impl == "pallas-gpu":      # the write key's guard has a GPU kernel only
    passes = passes | {"osdn_guard"}
  assert set(chosen) == passes and all(m.startswith(_platform(impl)) for ms in chosen.values() for m in ms), chosen
