"""Careless options, sizes, features and parameters: every one is a ValueError naming the option (and its allowed
range) or the feature/parameter (and the shape it must have), at construction where the value is known and at
call for the public preconditioner functions; valid values still work."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from osdn_jax import dgps, layers, models
from osdn_jax.dgps import decay, gain, naive, precond
from osdn_jax.testing import random_point_inputs
from osdn_jax.train import configs

NAN, INF = float("nan"), float("inf")
DIMS = dgps.Dims(heads=1, value_heads=2, key_dim=4, value_dim=4)   # H ≠ HV: a head-count mix-up shows
B, T = 1, 3


# ---------------------------------------------------------------------------------------------------------------
# Point options: dgps.get / dgps.compose (and through them register, MixerConfig, ModelConfig, the train config).
# ---------------------------------------------------------------------------------------------------------------
BAD_OPTIONS = [
    # OSDN and OSDN-APF: η ≥ 0, d_min ≤ d_max, d_init finite in [d_min, d_max], guard None or > 0, anchors.
    ("osdn", dict(d_min=2.0, d_max=1.0), r"`d_min` \(2.0\) must be ≤ `d_max` \(1.0\)"),
    ("osdn", dict(eta=-1.0), "`eta` must be a finite number ≥ 0, got -1.0"),
    ("osdn", dict(eta=NAN), "`eta` must be a finite number ≥ 0, got nan"),
    ("osdn", dict(eta=INF), "`eta` must be a finite number ≥ 0, got inf"),
    ("osdn", dict(eta="1.0"), "`eta` must be a finite number ≥ 0, got '1.0'"),
    ("osdn", dict(eta=True), "`eta` must be a finite number ≥ 0, got True"),
    ("osdn", dict(d_min=NAN), "`d_min` must be None or a finite number, got nan"),
    ("osdn", dict(d_max=INF), "`d_max` must be None or a finite number, got inf"),
    ("osdn", dict(d_init=NAN), "`d_init` must be a finite number, got nan"),
    ("osdn", dict(d_init=9.0), r"`d_init` \(9.0\) must lie in \[`d_min`, `d_max`\] = \[0, 8\]"),
    ("osdn", dict(d_max=0.5), r"`d_init` \(1.0\) must lie in \[`d_min`, `d_max`\] = \[0, 0.5\]"),
    ("osdn", dict(d_min=None, d_init=9.0), r"`d_init` \(9.0\) must lie in \[`d_min`, `d_max`\] = \[-inf, 8\]"),
    ("osdn", dict(d_init=np.array([0.5, 9.0])), "`d_init`"),
    ("osdn", dict(guard=0.0), "`guard` must be None or a finite number > 0, got 0.0"),
    ("osdn", dict(guard=-2.0), "`guard` must be None or a finite number > 0"),
    ("osdn", dict(guard=NAN), "`guard` must be None or a finite number > 0"),
    ("osdn-apf", dict(apf_anchor="one"), "`apf_anchor` must be 'zero' or 'init', got 'one'"),
    ("osdn-apf", dict(apf_bias=INF), "`apf_bias` must be None or a finite number, got inf"),
    ("osdn-apf-kda", dict(d_min=3.0, d_max=2.0), r"`d_min` \(3.0\) must be ≤ `d_max` \(2.0\)"),
    # PDN: x ≥ 1 (finite), ε > 0, center finite.
    ("pdn", dict(eps=0.0), "`eps` must be a finite number > 0, got 0.0"),
    ("pgdn", dict(eps=-1e-6), "`eps` must be a finite number > 0"),
    ("pdn", dict(x=0.5), "`x` must be a finite number ≥ 1, got 0.5"),
    ("pdn", dict(x=INF), "`x` must be a finite number ≥ 1, got inf"),
    ("pkda", dict(x=NAN), "`x` must be a finite number ≥ 1, got nan"),
    ("pdn", dict(x="2"), "`x` must be a finite number ≥ 1, got '2'"),
    ("pdn", dict(center_init=NAN), "`center_init` must be a finite number, got nan"),
    # ATQ: λ > 0.
    ("pla", dict(lam=0.0), "`lam` must be a finite number > 0, got 0.0"),
    ("pmamba2", dict(lam=-1.0), "`lam` must be a finite number > 0"),
    ("pgla", dict(lam=INF), "`lam` must be a finite number > 0, got inf"),
    # fixed-d control: d_init > 0 (d = exp(log_d)), guard.
    ("dn-fixed-d", dict(d_init=0.0), "`d_init` must be a finite number > 0, got 0.0"),
    ("dn-fixed-d", dict(guard=0), "`guard` must be None or a finite number > 0, got 0"),
    # Names: unknown options, and the solve axis given as an option.
    ("pdn", dict(eta=1.0), r"unknown options \['eta'\] for its axes \(.*precond 'pdn'"),
    ("gdn", dict(x=2.0), r"unknown options \['x'\] for its axes \(.*precond 'identity'"),
    ("dn", dict(solve="offline"), r"`solve` is the point's axis \('online'\), not an option"),
]


@pytest.mark.parametrize("name,options,match", BAD_OPTIONS,
                         ids=[f"{n}-{'-'.join(o)}-{i}" for i, (n, o, _) in enumerate(BAD_OPTIONS)])
def test_get_rejects_bad_options(name, options, match):
  with pytest.raises(ValueError, match=match) as info:
    dgps.get(name, **options)
  assert f"DGPS point {name!r}" in str(info.value)


BAD_COMPOSED = [
    (dict(precond="exact", lam=0.0), "`lam` must be a finite number > 0"),
    (dict(precond="fixed", d_init=-1.0), "`d_init` must be a finite number > 0"),
    (dict(precond="osdn-apf", decay="channel", apf_anchor="zero ", eta=1.0), "`apf_anchor`"),
    (dict(precond="osdn", guard="2"), "`guard` must be None or a finite number > 0, got '2'"),
    (dict(normalize_qk="false"), "`normalize_qk` must be a bool, got 'false'"),
    (dict(decay="cubic"), "unknown `decay`"),
]


@pytest.mark.parametrize("kwargs,match", BAD_COMPOSED, ids=[m.split("`")[1] for _, m in BAD_COMPOSED])
def test_compose_rejects_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dgps.compose(**kwargs)


def test_register_and_replace_check_options():
  with pytest.raises(ValueError, match=r"`d_min` \(1.0\) must be ≤ `d_max` \(0.5\)"):
    dgps.register(dgps.compose(precond="osdn", name="bad-osdn-bounds", d_min=1.0, d_max=0.5, d_init=0.7))
  assert "bad-osdn-bounds" not in dgps.POINTS
  with pytest.raises(ValueError, match="`eta`"):
    dataclasses.replace(dgps.get("osdn"), options=(("eta", -0.5),))


GOOD_OPTIONS = [
    ("osdn", dict(eta=0.0)),                                   # d stays d_init
    ("osdn", dict(d_min=None, d_max=None, d_init=20.0)),        # unbounded
    ("osdn", dict(d_min=1.0, d_max=1.0)),                       # a pinned d
    ("osdn", dict(guard=None, eta=np.float32(0.5), d_max=2)),   # guard off, numpy and int values
    ("osdn", dict(d_init=np.array([0.5, 1.0, 1.5, 2.0]))),      # per-channel d_init in bounds
    ("osdn-apf", dict(apf_anchor="init", apf_bias=-3.0)),
    ("pdn", dict(x=1.0, eps=1e-12, center_init=0.0)),           # x = 1: the backbone
    ("pla", dict(lam=1e-3)),
    ("dn-fixed-d", dict(d_init=0.25, guard=None)),
    ("dn", dict(solve="online")),                               # the point's own solve repeated
]


@pytest.mark.parametrize("name,options", GOOD_OPTIONS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(GOOD_OPTIONS)])
def test_get_accepts_good_options(name, options):
  point = dgps.get(name, **options)
  assert all(point.opts[k] is v or np.all(point.opts[k] == v) for k, v in options.items())


def test_opts_round_trip_for_every_named_point():
  for name in dgps.names():
    point = dgps.get(name)
    assert dgps.get(name, **point.opts).opts == point.opts


def test_good_options_run():
  """Valid edge values give finite outputs (eta = 0, x = 1, a pinned d, guard off)."""
  for name, options in [("osdn", dict(eta=0.0, guard=None)), ("pdn", dict(x=1.0)), ("pla", dict(lam=1e-3)),
                        ("osdn-apf", dict(d_min=1.0, d_max=1.0, apf_anchor="init"))]:
    point = dgps.get(name, **options)
    q, k, v, f, prm = random_point_inputs(point, DIMS, 0, B=B, T=T)
    o, _ = point(q, k, v, f, prm, chunk_size=16)
    assert o.shape == (B, T, DIMS.value_heads, DIMS.value_dim) and bool(jnp.all(jnp.isfinite(o))), name


# ---------------------------------------------------------------------------------------------------------------
# Dims.
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("heads", 0), ("value_heads", 0), ("key_dim", 0), ("value_dim", -1),
                                         ("key_dim", 2.0), ("heads", True), ("value_dim", "8")])
def test_dims_must_be_positive_ints(field, value):
  sizes = {**dict(heads=2, value_heads=2, key_dim=8, value_dim=8), field: value}
  with pytest.raises(ValueError, match=f"Dims: `{field}` must be an int ≥ 1"):
    dgps.Dims(**sizes)


def test_dims_value_heads_multiple_of_heads():
  with pytest.raises(ValueError, match="`value_heads`"):
    dgps.Dims(heads=3, value_heads=4, key_dim=8, value_dim=8)
  assert dgps.Dims(np.int64(2), 4, 8, 8).value_heads == 4


# ---------------------------------------------------------------------------------------------------------------
# The lower-level functions: checked at call when the options are Python (or numpy) numbers.
# ---------------------------------------------------------------------------------------------------------------
def _arrays():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  k, q = f(B, T, 1, 4), f(B, T, 1, 4)
  beta, g = jax.nn.sigmoid(f(B, T, 1)), -jax.nn.softplus(f(B, T, 1))
  u = k * k
  return dict(q=q, k=k, beta=beta, g=g, u=u, n=jnp.sum(u, -1), d1=jnp.ones((B, 1, 4)), A=jnp.abs(f(B, T, 1, 4)))


A = _arrays()
BAD_CALLS = [
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], d_min=2.0, d_max=1.0),
     r"osdn_write_key: `d_min` \(2.0\) must be ≤ `d_max` \(1.0\)"),
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], eta=-0.1), "`eta` must be a finite"),
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], eta=NAN), "`eta`"),
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], d_init=INF), "`d_init` must be a finite"),
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], guard=0.0), "`guard` must be None or"),
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], apf_anchor="Zero"), "`apf_anchor`"),
    ("osdn_write_key", lambda: precond.osdn_write_key(A["k"], A["beta"], chunk_size=0), "`chunk_size` must be"),
    ("osdn_d_pass", lambda: precond.osdn_d_pass(A["u"], A["n"], A["beta"], None, A["d1"], 1.0, eta=-1.0, d_min=0.0,
                                                d_max=8.0, apf_anchor="zero"), "osdn_d_pass: `eta`"),
    ("osdn_d_pass", lambda: precond.osdn_d_pass(A["u"], A["n"], A["beta"], None, A["d1"], 1.0, eta=1.0, d_min=8.0,
                                                d_max=0.0, apf_anchor="zero"), r"`d_min` \(8.0\) must be ≤ `d_max`"),
    ("osdn_d_pass", lambda: precond.osdn_d_pass(A["u"], A["n"], A["beta"], None, A["d1"], 1.0, eta=1.0, d_min=0.0,
                                                d_max=8.0, apf_anchor="init "), "osdn_d_pass: `apf_anchor` must be"),
    ("pdn_write_key", lambda: precond.pdn_write_key(A["k"], A["beta"], A["g"], jnp.zeros(1), eps=0.0),
     "pdn_write_key: `eps` must be a finite number > 0"),
    ("pdn_write_key", lambda: precond.pdn_write_key(A["k"], A["beta"], A["g"], jnp.zeros(1), x=0.9),
     "pdn_write_key: `x` must be a finite number ≥ 1"),
    ("pdn_scale", lambda: precond.pdn_scale(A["A"], jnp.zeros(1), x=INF), "pdn_scale: `x`"),
    ("pdn_scale", lambda: precond.pdn_scale(A["A"], jnp.zeros(1), eps=-1.0), "pdn_scale: `eps`"),
    ("atq_query", lambda: precond.atq_query(A["q"], A["k"], A["beta"], A["g"], lam=0.0),
     "atq_query: `lam` must be a finite number > 0"),
    ("naive.atq_query", lambda: naive.atq_query(A["q"], A["k"], A["beta"], A["g"], lam=-1.0), "atq_query: `lam`"),
    ("naive.pdn_write_key", lambda: naive.pdn_write_key(A["k"], A["beta"], A["g"], jnp.zeros(1), x=0.0), "`x`"),
    ("fixed_write_key", lambda: precond.fixed_write_key(A["k"], A["beta"], 1.0, guard=-1.0),
     "fixed_write_key: `guard`"),
    ("apply_guard", lambda: precond.apply_guard(A["k"], A["k"], A["beta"], 0.0), "apply_guard: `guard`"),
    ("exact_write_key", lambda: precond.exact_write_key(A["k"], A["beta"], lam=0.0), "exact_write_key: `lam`"),
    ("exact_query", lambda: precond.exact_query(A["q"], A["k"], A["beta"], lam=NAN), "exact_query: `lam`"),
    ("nlms", lambda: gain.nlms(A["beta"], A["k"], eps=0.0), "nlms: `eps` must be a finite number > 0"),
    ("init_gate", lambda: decay.init_gate(jax.random.key(0), (2,), a_range=(0.0, 16.0)), r"`a_range\[0\]`"),
    ("init_gate", lambda: decay.init_gate(jax.random.key(0), (2,), dt_range=(0.1, 1e-3)),
     r"`dt_range\[0\]` \(0.1\) must be ≤ `dt_range\[1\]` \(0.001\)"),
    ("init_gate", lambda: decay.init_gate(jax.random.key(0), (2,), dt_floor=0.0), "`dt_floor`"),
    ("init_gate", lambda: decay.init_gate(jax.random.key(0), (2,), a_range=1.0), "`a_range` must be a pair"),
]


@pytest.mark.parametrize("name,call,match", BAD_CALLS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_CALLS)])
def test_functions_reject_bad_options(name, call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_traced_options_pass_unchecked_and_python_numbers_are_checked_under_jit():
  k, beta = A["k"], A["beta"]
  out, _ = jax.jit(lambda e: precond.osdn_write_key(k, beta, eta=e, implementation="xla"))(0.5)
  assert bool(jnp.all(jnp.isfinite(out)))
  with pytest.raises(ValueError, match="`eta`"):
    jax.jit(lambda k: precond.osdn_write_key(k, beta, eta=-1.0))(k)


def test_function_d_init_may_lie_outside_the_bounds():
  """At call d_init is the first token's scale (like any initial state); the bounds clip from token 2 on."""
  out, d = precond.osdn_write_key(A["k"], A["beta"], d_init=1.5, d_min=0.0, d_max=1.4)
  assert bool(jnp.all(jnp.isfinite(out))) and float(jnp.max(d)) <= 1.4


# ---------------------------------------------------------------------------------------------------------------
# Features and parameters: by name, exact shape and a floating dtype, for __call__, prepare and step.
# ---------------------------------------------------------------------------------------------------------------
def _inputs(name):
  point = dgps.get(name)
  return (point, *random_point_inputs(point, DIMS, 0, B=B, T=T))


def _set(tree, path, value):
  axis, key = path.split(".")
  tree = {w: dict(fs) for w, fs in tree.items()}
  if value is None:
    del tree[axis][key]
  else:
    tree.setdefault(axis, {})[key] = value
  return tree


HV, H, K = DIMS.value_heads, DIMS.heads, DIMS.key_dim
BAD_FEATURES = [
    ("gdn", "decay.a", np.zeros((B, T, 1), np.float32), rf"`decay.a` must have shape \[B, T, HV\] = \({B}, {T}, {HV}\)"
     rf", got \({B}, {T}, 1\)"),
    ("dn", "gain.b", np.zeros((B, T, 1), np.float32), r"`gain.b` must have shape \[B, T, HV\]"),
    ("dn", "gain.b", np.zeros((T, HV), np.float32), r"`gain.b` must have shape \[B, T, HV\]"),
    ("kda", "decay.a", np.zeros((B, T, HV), np.float32), r"`decay.a` must have shape \[B, T, HV, K\]"),
    ("pgdn", "precond.a", np.zeros((B, T, HV), np.float32), rf"`precond.a` must have shape \[B, T, H\] = "
     rf"\({B}, {T}, {H}\), got \({B}, {T}, {HV}\)"),
    ("osdn-apf", "precond.r", np.zeros((B, T, 1), np.float32), r"`precond.r` must have shape \[B, T, HV\]"),
    ("gdn", "decay.a", np.zeros((B, T, HV), np.int32), "`decay.a` must be a floating array, got dtype int32"),
    ("gdn", "decay.a", None, r"missing feature `decay.a`; the point takes features decay.a \[B, T, HV\], "
     r"gain.b \[B, T, HV\]"),
    ("pdn", "precond.b", None, r"missing feature `precond.b`"),
]


@pytest.mark.parametrize("name,path,value,match", BAD_FEATURES,
                         ids=[f"{n}-{p}-{i}" for i, (n, p, _, _) in enumerate(BAD_FEATURES)])
def test_features_are_checked_by_name_shape_and_dtype(name, path, value, match):
  point, q, k, v, f, prm = _inputs(name)
  f = _set(f, path, value)
  for call in (lambda: point(q, k, v, f, prm), lambda: point.prepare(q, k, v, f, prm)):
    with pytest.raises(ValueError, match=match):
      call()


BAD_PARAMS = [
    ("gdn", "decay.A_log", None, r"missing parameter `decay.A_log`; the point takes parameters decay.A_log \[HV\], "
     r"decay.dt_bias \[HV\]"),
    ("kda", "decay.dt_bias", np.zeros((HV,), np.float32), rf"`decay.dt_bias` must have shape \[HV, K\] = "
     rf"\({HV}, {K}\), got \({HV},\)"),
    ("pgdn", "precond.center", np.zeros((HV,), np.float32), r"`precond.center` must have shape \[H\]"),
    ("pgdn", "precond.center", None, "missing parameter `precond.center`"),
    ("dn-fixed-d", "precond.log_d", np.zeros((HV, 1), np.float32), r"`precond.log_d` must have shape \[HV, K\]"),
]


@pytest.mark.parametrize("name,path,value,match", BAD_PARAMS,
                         ids=[f"{n}-{p}-{i}" for i, (n, p, _, _) in enumerate(BAD_PARAMS)])
def test_params_are_checked_by_name_and_shape(name, path, value, match):
  point, q, k, v, f, prm = _inputs(name)
  with pytest.raises(ValueError, match=match):
    point(q, k, v, f, _set(prm, path, value))
  state = point.initial_state(B, DIMS)
  with pytest.raises(ValueError, match=match):
    point.step(q[:, 0], k[:, 0], v[:, 0], jax.tree.map(lambda x: x[:, 0], f), _set(prm, path, value), state)


def test_other_features_and_params_are_ignored():
  """A richer point's inputs feed a simpler point: names it does not take are not read."""
  point, q, k, v, f, prm = _inputs("dn")
  want = point(q, k, v, f, prm)[0]
  extra_f = _set(f, "decay.a", np.full((B, T, HV), np.nan, np.float32))
  extra_p = _set(prm, "decay.A_log", np.full((HV,), np.nan, np.float32))
  np.testing.assert_array_equal(np.asarray(point(q, k, v, extra_f, extra_p)[0]), np.asarray(want))


def test_step_checks_per_token_features():
  point, q, k, v, f, prm = _inputs("gdn")
  f1 = jax.tree.map(lambda x: x[:, 0], f)
  state = point.initial_state(B, DIMS)
  with pytest.raises(ValueError, match=rf"`decay.a` must have shape \[B, HV\] = \({B}, {HV}\), got \({B}, 1\)"):
    point.step(q[:, 0], k[:, 0], v[:, 0], _set(f1, "decay.a", np.zeros((B, 1), np.float32)), prm, state)
  with pytest.raises(ValueError, match=r"`q` must be \[B, H, K\]"):
    point.step(q, k, v, f1, prm, state)   # the sequence's [B, T, H, K] given to the one-token step
  o, _ = point.step(q[:, 0], k[:, 0], v[:, 0], f1, prm, state)
  assert o.shape == (B, HV, DIMS.value_dim)


def test_points_without_features_or_params_take_none():
  point, q, k, v, _, _ = _inputs("la")
  o, _ = point(q, k, v, None, None, chunk_size=16)
  assert o.shape == (B, T, HV, DIMS.value_dim)
  with pytest.raises(ValueError, match="must be a mapping"):
    point(q, k, v, [1.0], None)


# ---------------------------------------------------------------------------------------------------------------
# Configs: the mixer's, the model's (point_options) and the trainer's.
# ---------------------------------------------------------------------------------------------------------------
BAD_MIXER = [
    (dict(output_gate="no"), "`output_gate` must be None or a bool, got 'no'"),
    (dict(norm_eps=0.0), "`norm_eps` must be a finite number > 0, got 0.0"),
    (dict(norm_eps=NAN), "`norm_eps`"),
    (dict(out_init_scale=-1.0), "`out_init_scale` must be a finite number > 0"),
    (dict(implementation="cuda"), "`implementation` must be one of"),
    (dict(implementation=None), "`implementation` must be a str"),
    (dict(point=dgps.get("osdn", eta=0.5), conv_size=0), "`conv_size`"),
]


@pytest.mark.parametrize("kwargs,match", BAD_MIXER, ids=[m.split("`")[1] for _, m in BAD_MIXER])
def test_mixer_config_rejects_bad_options(kwargs, match):
  kwargs = dict(dict(point="gdn", d_model=16, num_heads=2), **kwargs)
  with pytest.raises(ValueError, match="MixerConfig: " + match):
    layers.MixerConfig(**kwargs)


def test_mixer_config_takes_a_checked_point():
  cfg = layers.MixerConfig(dgps.get("osdn-apf", apf_anchor="init", d_max=4.0), d_model=16, num_heads=2,
                           output_gate=np.bool_(True), norm_eps=1e-5, implementation="naive")
  assert cfg.point.opts["d_max"] == 4.0 and cfg.gated


BAD_MODEL = [
    ("osdn-tiny", dict(point_options={"d_min": 2.0, "d_max": 1.0}), r"`d_min` \(2.0\) must be ≤ `d_max` \(1.0\)"),
    ("pdn-tiny", dict(point_options={"eps": 0.0}), "`eps` must be a finite number > 0"),
    ("pla-tiny", dict(point_options=(("lam", -1.0),)), "`lam` must be a finite number > 0"),
    ("pdn-tiny", dict(point_options={"xx": 2.0}), "unknown options"),
    ("pdn-tiny", dict(point_options=("x", 2.0)), "`point_options` must be a mapping or"),
    ("pdn-tiny", dict(point_options={1: 2.0}), "`point_options` must be a mapping or"),
    ("gdn-tiny", dict(init_std=0.0), "`init_std` must be a finite number > 0"),
    ("gdn-tiny", dict(norm_eps=-1e-6), "`norm_eps` must be a finite number > 0"),
    ("gdn-tiny", dict(output_gate=1), "`output_gate` must be None or a bool"),
    ("gdn-tiny", dict(implementation="gpu"), "`implementation`"),
]


@pytest.mark.parametrize("name,overrides,match", BAD_MODEL, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_MODEL)])
def test_model_config_rejects_bad_options(name, overrides, match):
  with pytest.raises(ValueError, match="ModelConfig: .*" + match):
    models.config(name, **overrides)


def test_model_config_good_point_options():
  cfg = models.config("osdn-apf-tiny", point_options={"apf_anchor": "init", "eta": 0.0, "d_max": None})
  assert cfg.point.opts["eta"] == 0.0 and cfg.point.opts["d_max"] is None and cfg.mixer.point == cfg.point


@pytest.mark.parametrize("model,options,match", [
    ("osdn-tiny", dict(d_min=2.0, d_max=1.0), r"DGPS point 'osdn': `d_min` \(2.0\) must be ≤ `d_max` \(1.0\)"),
    ("osdn-apf-tiny", dict(apf_anchor="one"), "`apf_anchor` must be 'zero' or 'init'"),
    ("pdn-tiny", dict(x=math.nan), "`x` must be a finite number ≥ 1"),
    ("gdn-tiny", dict(eta=1.0), "unknown options"),
])
def test_train_config_surfaces_point_option_errors(model, options, match):
  c = configs.get_config("tiny")
  c.model = model
  c.point_options = ml_collections.ConfigDict(options)
  with pytest.raises(ValueError, match="train config: `point_options` of .*" + match):
    configs.validate(c)


def test_train_config_point_options_must_be_a_mapping():
  c = configs.get_config("tiny")
  with c.unlocked():
    del c["point_options"]
    c.point_options = "x=2.0"
  with pytest.raises(ValueError, match="`point_options` must be a mapping"):
    configs.validate(c)
