"""Test helpers shared by the suites of every implementation: random inputs, the comparator, tolerances, and the
example counts of the hypothesis tests.

The comparator is docs/design.md §4's: rms(x − y) ≤ rtol · rms(y) + atol, with y the reference. `close` is the
criterion as a predicate (it never raises: the mutation tests assert that it fails); `assert_trees_close` asserts it
after chex's checks of structure, shapes, finiteness and (where the caller knows the contract) dtypes. chex and
pytest are imported inside the functions that use them: importing this module (experiments/tour.py does) pulls in
nothing beyond jax and numpy.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

# docs/design.md §4: (rtol, atol) per quantity. bf16 references are fp64 on the same bf16-rounded inputs.
FP32_TOL = (1e-5, 1e-6)
BF16_TOL = {"o": 1e-2, "S": 1e-2, "q": 1.5e-2, "k": 1.5e-2, "k_write": 1.5e-2, "v": 1.5e-2,
            "initial_state": 1.5e-2, "beta": 3e-2, "log_decay": 3e-2}
BF16_ATOL = 1e-5


def needs_corpus():
  """A pytest mark that skips a test reading the text corpus where it is not installed (`make data`)."""
  import pytest
  from osdn_jax.data.sources import corpus_files
  try:
    corpus_files()
    missing = False
  except FileNotFoundError:
    missing = True
  return pytest.mark.skipif(missing, reason="the text corpus is not installed: run `make data`")


def rel_rms(x, y) -> float:
  """rms(x − y) / rms(y) in fp64 (rms(y) = 0 gives rms(x − y))."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  den = np.sqrt(np.mean(y ** 2))
  num = np.sqrt(np.mean((x - y) ** 2))
  return float(num / den) if den > 0 else float(num)


def close(x, y, rtol: float, atol: float) -> bool:
  """The criterion as a predicate: x finite, of y's shape, and rms(x − y) ≤ rtol · rms(y) + atol."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.shape != y.shape or not np.all(np.isfinite(x)):
    return False
  return bool(np.sqrt(np.mean((x - y) ** 2)) <= rtol * np.sqrt(np.mean(y ** 2)) + atol)


def tolerance(name: str, dtype) -> tuple[float, float]:
  if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return BF16_TOL[name], BF16_ATOL
  return FP32_TOL


def contract_dtypes(arrays: dict) -> dict:
  """The dtypes the solves' contract fixes for `vjp_all`'s results on `arrays`: the output o in the inputs' dtype
  (q's), the final state S in fp32 (fp64 for fp64 inputs), and every gradient in its input's dtype."""
  q = jnp.dtype(arrays["q"].dtype)
  out = {n: jnp.dtype(x.dtype) for n, x in arrays.items() if x is not None}
  out.update(o=q, S=jnp.promote_types(jnp.float32, q))
  return out


def _chex_checks(got: dict, want: dict, dtypes: dict | None):
  """chex: the same names and shapes, every compared array finite (result and reference), dtypes as given."""
  import chex   # lazily: see the module docstring
  missing = sorted(set(want) - set(got))
  assert not missing, f"no result for {missing}"
  got = {n: got[n] for n in want}
  chex.assert_trees_all_equal_shapes(got, want)
  chex.assert_tree_all_finite(got)
  chex.assert_tree_all_finite(want)
  for name, dt in (dtypes or {}).items():
    if name in got:
      chex.assert_type(got[name], dt)


def assert_trees_close(got: dict, want: dict, dtype, *, dtypes: dict | None = None,
                       tol: tuple[float, float] | None = None) -> dict:
  """Asserts every entry of `got` is close to `want` at the tolerance of its name; returns the errors.

  Entries of `want` that are None are skipped. chex checks first that every compared name has a result of the
  reference's shape, that results and references are finite, and that each result has the dtype `dtypes` maps
  its name to (e.g. `contract_dtypes(arrays)`; names not in the map are not dtype-checked). The tolerance is
  §4's for `dtype` (the inputs' dtype); `tol` = (rtol, atol) replaces it where both sides are exact algebra
  (e.g. fp64 against fp64)."""
  want = {n: w for n, w in want.items() if w is not None}
  _chex_checks(got, want, dtypes)
  errors, bad = {}, []
  for name, ref in want.items():
    rtol, atol = tol or tolerance(name, dtype)
    errors[name] = rel_rms(got[name], ref)
    if not close(got[name], ref, rtol, atol):
      bad.append(f"{name}: rel rms {errors[name]:.3g} > rtol {rtol:g} (atol {atol:g})")
  assert not bad, "; ".join(bad)
  return errors


def assert_close_to_oracles(got: dict, want64: dict, want32: dict, tol: float) -> dict:
  """Asserts every entry of `got` (fp32 results) is close to the fp64 oracle `want64` and to the fp32 oracle
  `want32` (the same computation in fp32, the kernels' contract) where a serial recurrence with a clip or a bound
  can round a value to either side of it: rel_rms to fp64 ≤ max(tol, 2·noise) and to fp32 ≤ max(tol, noise), noise
  being rel_rms(want32, want64). chex checks shapes, finiteness and the fp32 dtype first. Returns the errors to
  fp64."""
  _chex_checks(got, want64, {n: jnp.float32 for n in want64})
  errors, bad = {}, []
  for name, w64 in want64.items():
    e64, e32, noise = rel_rms(got[name], w64), rel_rms(got[name], want32[name]), rel_rms(want32[name], w64)
    errors[name] = e64
    if not (e64 <= max(tol, 2 * noise) and e32 <= max(tol, noise)):
      bad.append(f"{name}: rel rms {e64:.3g} to fp64, {e32:.3g} to fp32 (fp32 to fp64: {noise:.3g})")
  assert not bad, "; ".join(bad)
  return errors


# Registry points that between them take every value of every DGPS axis (decay, gain, preconditioner, solve):
# `make test` runs these where a test would run every point; CI's slow step runs the others
# (tests/dgps/test_points.py checks the cover).
COVERING_POINTS = ("kda", "pgdn", "osdn", "osdn-apf-kda", "dn-fixed-d", "retnet", "pmamba2", "mesa", "longhorn",
                   "nlms")


def every_point(names):
  """pytest params for a test over every registry point: COVERING_POINTS as they are, the others marked slow."""
  import pytest   # lazily: see the module docstring
  return [n if n in COVERING_POINTS else pytest.param(n, marks=pytest.mark.slow) for n in names]


class Batches:
  """Results of parametrised test cases computed a group at a time: the first `get(case)` of a group calls
  `compute(cases)` once for all of the group's cases (e.g. one jitted program for all of them: fewer, larger
  compiles) and caches what it returns (a sequence, one result per case, in order); each case still asserts in
  its own test item. `group_of(case)` names the case's group; `cases` lists every case. Meant to live in a
  module-scoped fixture (tests/conftest.py keeps a module's tests on one xdist worker, which computes each group
  once)."""

  def __init__(self, cases, group_of, compute):
    self._groups = {}
    for case in cases:
      self._groups.setdefault(group_of(case), []).append(case)
    self._group_of, self._compute, self._done = group_of, compute, {}

  def get(self, case):
    group = self._group_of(case)
    if group not in self._done:
      members = self._groups[group]
      results = self._compute(members)
      assert len(results) == len(members), (group, len(results), len(members))
      self._done[group] = dict(zip(members, results))
    return self._done[group][case]


# Hypothesis profiles, registered by tests/conftest.py and selected by the HYPOTHESIS_PROFILE environment variable:
# every hypothesis test sets its example count with `examples(base)`, its base count scaled by the profile.
HYPOTHESIS_SCALE = {"default": 1, "thorough": 5}


def hypothesis_profile() -> str:
  """The active profile's name: HYPOTHESIS_PROFILE, "default" when unset."""
  name = os.environ.get("HYPOTHESIS_PROFILE", "default") or "default"
  if name not in HYPOTHESIS_SCALE:
    raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: expected one of {sorted(HYPOTHESIS_SCALE)}")
  return name


def examples(base: int) -> int:
  """A hypothesis test's example count: `base` under the "default" profile, a multiple of it under "thorough"."""
  return base * HYPOTHESIS_SCALE[hypothesis_profile()]


@dataclasses.dataclass
class Problem:
  """One random solve problem: q, k [B,T,H,K]; v [B,T,HV,V]; beta [B,T,HV]; optional k_write, log_decay,
  initial_state. Arrays are numpy fp64 so the same values can be cast to any dtype."""
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  beta: np.ndarray
  k_write: np.ndarray | None
  log_decay: np.ndarray | None
  initial_state: np.ndarray | None

  def arrays(self, dtype, gate_dtype=jnp.float32, state_dtype=jnp.float32) -> dict:
    """The problem's arrays as jax arrays: q, k, k_write, v in `dtype`, gates and state in their own."""
    def cast(x, dt):
      return None if x is None else jnp.asarray(x, dt)
    return dict(q=cast(self.q, dtype), k=cast(self.k, dtype), v=cast(self.v, dtype),
                beta=cast(self.beta, gate_dtype), k_write=cast(self.k_write, dtype),
                log_decay=cast(self.log_decay, gate_dtype), initial_state=cast(self.initial_state, state_dtype))

  def rounded(self, dtype) -> "Problem":
    """The same problem with q, k, k_write, v rounded to `dtype` (so an fp64 reference sees what bf16 saw)."""
    r = lambda x: None if x is None else np.asarray(jnp.asarray(x, dtype), np.float64)
    return dataclasses.replace(self, q=r(self.q), k=r(self.k), v=r(self.v), k_write=r(self.k_write))


def _unit(x):
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def random_problem(seed: int, *, B=2, T=64, H=2, HV=None, K=16, V=32, decay="scalar", k_write="none",
                   initial_state=True, decay_bias=3.0, write_spread=0.3) -> Problem:
  """L2-normalised q, k; β = σ(N(0,1)); log-decays logσ(N(0,1) + decay_bias) (per head or per channel).

  k_write: "none" (k̃ = k), "key" ([B,T,H,K]) or "value" ([B,T,HV,K]): k ⊙ m with log m ~ N(0, write_spread²)
  clipped to ±log 1.5, as a diagonal preconditioner would write.
  """
  rng = np.random.default_rng(seed)
  HV = HV or H
  q = _unit(rng.normal(size=(B, T, H, K)))
  k = _unit(rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, HV, V))
  beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(B, T, HV))))
  kw = None
  if k_write != "none":
    heads = H if k_write == "key" else HV
    m = np.exp(np.clip(write_spread * rng.normal(size=(B, T, heads, K)), -np.log(1.5), np.log(1.5)))
    kw = np.repeat(k, heads // H, axis=2) * m
  g = None
  if decay != "none":
    shape = (B, T, HV) if decay == "scalar" else (B, T, HV, K)
    z = rng.normal(size=shape) + decay_bias
    g = -np.logaddexp(0.0, -z)    # log σ(z)
  s0 = rng.normal(size=(B, HV, K, V)) / np.sqrt(K) if initial_state else None
  return Problem(q, k, v, beta, kw, g, s0)


def random_d_pass_inputs(seed: int, B: int = 2, T: int = 70, G: int = 4, K: int = 20, segments: int = 0) -> dict:
  """Inputs of OSDN's d-pass that reach its bounds: u = k², n = ‖k‖² of spiky unit keys (normal³: large steps on
  few channels), β = σ(z + ½) with β = 0 at every 11th token (a clipped d then stays exactly at its bound: the
  clip's ½ gradient at a tie), APF retention r = σ(z + 4), d1 ∈ [0.5, 2] ([segments, G, K] when packed, else
  [B, G, K]), d_init "d0" [G, K] ∈ [0.8, 1.2]; fp32."""
  rng = np.random.default_rng(seed)
  k = _unit(rng.normal(size=(B, T, G, K)) ** 3)
  sig = lambda x: 1 / (1 + np.exp(-x))
  beta = sig(rng.normal(size=(B, T, G)) + 0.5)
  beta[:, 7::11] = 0.0
  f = lambda x: jnp.asarray(x, jnp.float32)
  u = f(k * k)
  return dict(u=u, n=jnp.maximum(jnp.sum(u, -1), 1e-12), beta=f(beta), r=f(sig(rng.normal(size=(B, T, G)) + 4)),
              d1=f(0.5 + 1.5 * rng.random(size=(segments or B, G, K))), d0=f(0.8 + 0.4 * rng.random(size=(G, K))))


def vjp_all(fn, arrays: dict, seed: int = 1, outputs: tuple[str, ...] = ("o", "S")) -> dict:
  """Runs fn(**arrays) → a tuple of arrays (the solves' (o, S)) and pulls random cotangents back to every array input.

  Returns {each output under its name in `outputs`, and one gradient per non-None input, under the input's name}.
  """
  names = [n for n, x in arrays.items() if x is not None]
  primals = [arrays[n] for n in names]

  def f(*xs):
    return tuple(fn(**dict(arrays, **dict(zip(names, xs)))))

  outs, pull = jax.vjp(f, *primals)
  assert len(outs) == len(outputs), (len(outs), outputs)
  rng = np.random.default_rng(seed)
  # Cotangents rounded to bf16 values, so that runs in any dtype pull back exactly the same ones.
  draw = lambda x: jnp.asarray(jnp.asarray(rng.normal(size=x.shape), jnp.bfloat16), x.dtype)
  grads = pull(tuple(draw(o) for o in outs))
  return dict(zip(outputs, outs), **dict(zip(names, grads)))


def values_and_grads(fn, args, seed: int = 1) -> tuple:
  """`vjp_all` for a function of positional arguments, as one jitted program: fn(*args) → an array or a tuple of
  arrays; returns (its outputs..., the gradient w.r.t. every non-None argument, in order) under the random
  cotangents `vjp_all` draws from `seed` (the same for every function of outputs of those shapes)."""
  names = [f"arg{i}" for i in range(len(args))]
  single = not isinstance(jax.eval_shape(fn, *args), (tuple, list))
  count = 1 if single else len(jax.eval_shape(fn, *args))
  outputs = tuple(f"out{i}" for i in range(count))

  def call(**a):
    out = fn(*(a[n] for n in names))
    return (out,) if single else tuple(out)

  got = jax.jit(lambda a: vjp_all(call, a, seed, outputs))(dict(zip(names, args)))
  return tuple(got[o] for o in outputs) + tuple(got[n] for n, x in zip(names, args) if x is not None)


def random_point_inputs(point, dims, seed: int, *, B=2, T=45, dtype=jnp.float32):
  """Random projected inputs and initial parameters for a DGPS point: (q, k, v, features, params)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  # Features as a freshly initialised layer would project them: N(0, 1) plus the projection's initial bias.
  features = {w: {n: f(B, T, *ft.resolve(dims)) + (ft.bias or 0.0) for n, ft in fs.items()}
              for w, fs in point.features().items()}
  q, k = f(B, T, dims.heads, dims.key_dim), f(B, T, dims.heads, dims.key_dim)
  v = f(B, T, dims.value_heads, dims.value_dim)
  params = point.init_params(jax.random.key(seed), dims)
  return q, k, v, features, params


def override(config, changes: dict):
  """`config` (a nested mapping, e.g. a train ConfigDict) with each "a.b.c" field of `changes` set; returns it."""
  for key, value in changes.items():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config
