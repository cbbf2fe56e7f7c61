"""The public API: dispatch, decoding steps, chaining, transformations, extreme gates and bad input."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osdn_jax import ops
from osdn_jax.ops import chunked, naive
from osdn_jax.testing import close, random_problem, rel_rms

DECAYS = ("none", "scalar", "channel")


def _args(p, dtype=jnp.float32):
  a = p.arrays(dtype)
  return a.pop("q"), a.pop("k"), a.pop("v"), a.pop("beta"), a


@pytest.mark.parametrize("impl", ["naive", "xla", "auto"])
def test_dispatch_and_output_dtypes(impl):
  p = random_problem(0, T=40, H=2, HV=4, decay="scalar", k_write="key")
  q, k, v, beta, kw = _args(p, jnp.bfloat16)
  o, S = ops.delta_rule(q, k, v, beta, **kw, output_final_state=True, implementation=impl)
  chex.assert_type(o, jnp.bfloat16)
  chex.assert_shape(o, v.shape)
  chex.assert_type(S, jnp.float32)
  chex.assert_shape(S, (2, 4, 16, 32))
  o2, S2 = ops.delta_rule(q, k, v, beta, **kw, implementation=impl)
  assert S2 is None
  o3, S3 = ops.linear_attention(q, k, v, log_decay=kw["log_decay"], output_final_state=True,
                                implementation=impl)
  chex.assert_type([o3, S3], [jnp.bfloat16, jnp.float32])


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("solve", ["online", "offline"])
def test_steps_equal_the_solve(solve, decay):
  """delta_rule_step / linear_attention_step, token by token, equal the whole-sequence solve."""
  p = random_problem(1, T=37, H=2, HV=4, decay=decay, k_write="value" if solve == "online" else "none")
  q, k, v, beta, kw = _args(p)
  if solve == "online":
    o, S = ops.delta_rule(q, k, v, beta, **kw, output_final_state=True, chunk_size=16)
    step = jax.jit(lambda t, S: ops.delta_rule_step(
        q[:, t], k[:, t], v[:, t], beta[:, t], S, k_write=kw["k_write"][:, t],
        log_decay=None if kw["log_decay"] is None else kw["log_decay"][:, t]))
  else:
    o, S = ops.linear_attention(q, k, v, beta=beta, log_decay=kw["log_decay"],
                                initial_state=kw["initial_state"], output_final_state=True, chunk_size=16)
    step = jax.jit(lambda t, S: ops.linear_attention_step(
        q[:, t], k[:, t], v[:, t], S, beta=beta[:, t],
        log_decay=None if kw["log_decay"] is None else kw["log_decay"][:, t]))
  state, outs = kw["initial_state"], []
  for t in range(q.shape[1]):
    o_t, state = step(t, state)
    outs.append(o_t)
  assert close(jnp.stack(outs, 1), o, 1e-5, 1e-6)
  assert close(state, S, 1e-5, 1e-6)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("solve", ["online", "offline"])
def test_chaining_two_halves(solve, decay):
  """Running [0, 45) and then [45, 100) from its final state equals one run of [0, 100)."""
  p = random_problem(2, T=100, decay=decay, k_write="key")
  q, k, v, beta, kw = _args(p)

  def run(sl, s0):
    cut = lambda x: None if x is None else x[:, sl]
    if solve == "online":
      return ops.delta_rule(cut(q), cut(k), cut(v), cut(beta), k_write=cut(kw["k_write"]),
                            log_decay=cut(kw["log_decay"]), initial_state=s0, output_final_state=True,
                            chunk_size=32)
    return ops.linear_attention(cut(q), cut(k), cut(v), beta=cut(beta), log_decay=cut(kw["log_decay"]),
                                initial_state=s0, output_final_state=True, chunk_size=32)

  o, S = run(slice(None), kw["initial_state"])
  o1, S1 = run(slice(0, 45), kw["initial_state"])
  o2, S2 = run(slice(45, None), S1)
  assert close(jnp.concatenate([o1, o2], 1), o, 1e-5, 1e-6)
  assert close(S2, S, 1e-5, 1e-6)


@pytest.mark.parametrize("decay", DECAYS)
def test_jit_vmap_checkpoint(decay):
  p = random_problem(3, T=50, decay=decay, k_write="key")
  q, k, v, beta, kw = _args(p)

  def f(q, k, v, beta, kw):
    return ops.delta_rule(q, k, v, beta, **kw, output_final_state=True, chunk_size=16)

  o, S = f(q, k, v, beta, kw)
  oj, Sj = jax.jit(f)(q, k, v, beta, kw)
  np.testing.assert_array_equal(np.asarray(oj), np.asarray(o))
  np.testing.assert_array_equal(np.asarray(Sj), np.asarray(S))
  # vmap over a new leading axis: each slice equals the unbatched call.
  stack = lambda x: None if x is None else jnp.stack([x, x[::-1]])
  ov, Sv = jax.vmap(f)(*map(stack, (q, k, v, beta)), jax.tree.map(stack, kw))
  assert close(ov[0], o, 1e-6, 1e-7) and close(Sv[0], S, 1e-6, 1e-7)
  o_rev, S_rev = f(*(x[::-1] for x in (q, k, v, beta)), jax.tree.map(lambda x: x[::-1], kw))
  assert close(ov[1], o_rev, 1e-6, 1e-7) and close(Sv[1], S_rev, 1e-6, 1e-7)
  # jax.checkpoint: same values and gradients.
  loss = lambda q, k: jnp.sum(f(q, k, v, beta, kw)[0] ** 2)
  g = jax.grad(loss, argnums=(0, 1))(q, k)
  gc = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(q, k)
  for a, b in zip(g, gc):
    assert close(b, a, 1e-6, 1e-7)


EXTREMES = {
    "log_decay=-1e3": dict(log_decay=-1e3),
    "log_decay=0": dict(log_decay=0.0),
    "beta=0": dict(beta=0.0),
    "beta=1": dict(beta=1.0),
    "zero keys": dict(keys=0.0),
}


@pytest.mark.parametrize("case", list(EXTREMES))
@pytest.mark.parametrize("decay", ["scalar", "channel"])
@pytest.mark.parametrize("impl", ["naive", "xla"])
def test_extreme_gates_are_finite(impl, decay, case):
  p = random_problem(4, T=40, decay=decay, k_write="key")
  q, k, v, beta, kw = _args(p)
  ex = EXTREMES[case]
  if "log_decay" in ex:
    kw["log_decay"] = jnp.full_like(kw["log_decay"], ex["log_decay"])
  if "beta" in ex:
    beta = jnp.full_like(beta, ex["beta"])
  if "keys" in ex:
    k, kw["k_write"] = jnp.zeros_like(k), jnp.zeros_like(kw["k_write"])

  def loss(q, k, v, beta, kw):
    o, S = ops.delta_rule(q, k, v, beta, **kw, output_final_state=True, chunk_size=16, implementation=impl)
    o2, S2 = ops.linear_attention(q, k, v, beta=beta, log_decay=kw["log_decay"], output_final_state=True,
                                  chunk_size=16, implementation=impl)
    return jnp.sum(o ** 2) + jnp.sum(S ** 2) + jnp.sum(o2 ** 2) + jnp.sum(S2 ** 2)

  val, grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, beta, kw)
  chex.assert_tree_all_finite((val, grads))


def test_extreme_decay_matches_oracle():
  """log-decay −1e3 (a full reset each step) still matches the oracle: the clamp at −30 changes ~1e−13."""
  p = random_problem(5, T=40, decay="channel", k_write="key")
  q, k, v, beta, kw = _args(p)
  kw["log_decay"] = kw["log_decay"].at[:, ::7].set(-1e3)
  o1, S1 = naive.delta_rule(q, k, v, beta, **kw)
  o2, S2 = chunked.delta_rule(q, k, v, beta, **kw, chunk_size=16)
  assert close(o2, o1, 1e-5, 1e-6) and close(S2, S1, 1e-5, 1e-6)


@pytest.mark.parametrize("decay", DECAYS)
def test_residual_identity(decay):
  """v − S_tᵀk = (1 − β⟨k, k̃⟩)(v − S'_tᵀk) through the recurrence: ρ_t = (1 − β⟨k, k̃⟩)²."""
  p = random_problem(6, T=60, H=2, HV=4, decay=decay, k_write="value")
  a = p.arrays(jnp.float64, jnp.float64, jnp.float64)
  (pre, post), _ = naive.delta_rule_residuals(a["k"], a["v"], a["beta"], k_write=a["k_write"],
                                              log_decay=a["log_decay"], initial_state=a["initial_state"])
  k = jnp.repeat(a["k"], 2, axis=2)
  factor = 1.0 - a["beta"] * jnp.sum(k * a["k_write"], -1)
  rho = jnp.sum(post ** 2, -1) / jnp.sum(pre ** 2, -1)
  assert rel_rms(post, factor[..., None] * pre) < 1e-12
  assert rel_rms(rho, factor ** 2) < 1e-10
  assert float(jnp.max(jnp.abs(factor))) < 1.0 + 1e-12   # this problem's writes are contractive


BAD = [
    ("q", dict(q=np.zeros((2, 8, 2)))),
    ("k", dict(k=np.zeros((2, 8, 2, 4), np.float32))),
    ("k", dict(k=np.zeros((2, 8, 2, 16), np.float64))),
    ("v", dict(v=np.zeros((2, 8, 3, 32), np.float32))),
    ("v", dict(v=np.zeros((2, 9, 2, 32), np.float32))),
    ("beta", dict(beta=np.zeros((2, 8), np.float32))),
    ("beta", dict(beta=np.zeros((2, 8, 2), np.int32))),
    ("k_write", dict(k_write=np.zeros((2, 8, 3, 16), np.float32))),
    ("log_decay", dict(log_decay=np.zeros((2, 8, 2, 3), np.float32))),
    ("initial_state", dict(initial_state=np.zeros((2, 2, 32, 16), np.float32))),
    ("chunk_size", dict(chunk_size=48)),
    ("implementation", dict(implementation="cuda")),
    ("q", dict(q=np.zeros((2, 8, 2, 16), np.int32))),
]


@pytest.mark.parametrize("name,bad", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_invalid_input_names_the_argument(name, bad):
  args = dict(q=np.zeros((2, 8, 2, 16), np.float32), k=np.zeros((2, 8, 2, 16), np.float32),
              v=np.zeros((2, 8, 2, 32), np.float32), beta=np.zeros((2, 8, 2), np.float32))
  args.update(bad)
  q, k, v, beta = (args.pop(n) for n in ("q", "k", "v", "beta"))
  with pytest.raises(ValueError, match=f"`{name}`"):
    ops.delta_rule(q, k, v, beta, **args)


def test_invalid_step_input():
  q = np.zeros((2, 2, 16), np.float32)
  with pytest.raises(ValueError, match="`state`"):
    ops.delta_rule_step(q, q, np.zeros((2, 2, 8), np.float32), np.zeros((2, 2), np.float32),
                        np.zeros((2, 2, 8, 16), np.float32))
  with pytest.raises(ValueError, match="`log_decay`"):
    ops.linear_attention_step(q, q, np.zeros((2, 2, 8), np.float32), np.zeros((2, 2, 16, 8), np.float32),
                              log_decay=np.zeros((2, 3), np.float32))
  with pytest.raises(ValueError, match="`beta`"):
    ops.delta_rule(q[:, None], q[:, None], q[:, None], None)
  q64 = q[:, None].astype(np.float64)      # no Pallas kernel takes fp64 inputs
  with pytest.raises(ValueError, match="`implementation`='pallas'"):
    ops.delta_rule(q64, q64, q64, np.ones((2, 1, 2), np.float64), implementation="pallas")
