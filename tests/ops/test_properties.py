"""The core properties, each run under jit and without it (chex variants: the function under test goes through
`self.variant`) on problems that hypothesis draws:

1. the chunked XLA solves (online and offline; every decay; grouped value heads; asymmetric write keys; initial
   states; any T, odd and shorter than a chunk; every chunk size; fp32, bf16 and fp64 inputs; strong and weak
   decays, wide write scalings, small gains) against the fp64 token-serial oracle: outputs, final states and
   every input gradient, at docs/design.md §4's tolerances, in the dtypes the contract fixes;
2. a run split in two and resumed from the first part's final state equals the whole run (values and gradients);
3. zero-padding T (β = 0, g = 0 on the padding) is invisible (values and gradients);
4. the preconditioners' fast forms (PDN's write key, ATQ's query, OSDN's write key with and without the clip,
   with and without APF retention) against their token-serial references in fp64, and their chaining through
   their final states;
5. the Pallas delta-rule kernels (interpret mode, through `ops.delta_rule(implementation="pallas")`) against the
   fp64 oracle on small drawn problems, packed rows and extreme gates included.

Every case is one `chex.TestCase` method per variant (and per decay / solve / preconditioner where those are
parameters); hypothesis draws the rest inside it with the example count `examples(base)` of the active profile.
The module is marked `hypothesis`, so CI's slow step reruns it under the "thorough" profile. `make test` runs every
case under jit and one case per class without it (`_eager_in_the_quick_suite`); the slow step runs them all.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings, strategies as st

from osdn_jax import ops
from osdn_jax.dgps import precond
from osdn_jax.testing import assert_trees_close, contract_dtypes, examples, random_problem, vjp_all

pytestmark = pytest.mark.hypothesis

DECAYS = ("none", "scalar", "channel")
CHUNKS = (16, 32, 64, 128)
F64 = jnp.float64
EXACT = (1e-11, 1e-13)         # fp64 against fp64: the same algebra, round-off apart
SOLVE_DECAYS = [(f"{s}_{d}", s, d) for s in ("online", "offline") for d in DECAYS]


def _solve(solve, impl, **kw):
  """fn(**problem arrays) → (o, final state) through the public API (offline: no write key)."""
  def fn(q, k, v, beta, k_write, log_decay, initial_state):
    common = dict(log_decay=log_decay, initial_state=initial_state, output_final_state=True,
                  implementation=impl, **kw)
    if solve == "online":
      return ops.delta_rule(q, k, v, beta, k_write=k_write, **common)
    return ops.linear_attention(q, k, v, beta=beta, **common)
  return fn


def _oracle(problem, solve, dtype, **kw):
  """The fp64 token-serial oracle on the problem's values rounded to `dtype` (what the solve under test saw)."""
  ref = problem.rounded(dtype) if dtype != F64 else problem
  return vjp_all(_solve(solve, "reference", **kw), ref.arrays(F64, F64, F64))


def _first(value, strategy):
  """`strategy`, but `value` in hypothesis's first (simplest) example."""
  return st.just(value) | strategy


@st.composite
def problems(draw, *, decay, solve=None, dtypes=(jnp.float32,), min_t=1, max_t=100, gates=True):
  """(solve, problem, chunk, dtype): the solve (when not given), shapes from small sets (MHA and grouped value
  heads), any T in [min_t, max_t], every chunk size, write keys shared or on the key / value heads (online), with
  or without an initial state; with `gates`, log-decay biases from strong to weak, write-scale spreads up to 1 and
  gains scaled into [0, 1]. The simplest draw is a rich case: grouped heads, value-head write keys, an initial
  state, T = 63 (odd, not a multiple of the chunk), chunk 16."""
  solve = solve or draw(st.sampled_from(("online", "offline")))
  H, HV = draw(st.sampled_from(((2, 4), (1, 1), (2, 2), (1, 2))))
  k_write = draw(st.sampled_from(("value", "none", "key"))) if solve == "online" else "none"
  extra = {}
  if gates:
    extra = dict(decay_bias=draw(_first(3.0, st.floats(-2.0, 8.0))), write_spread=draw(_first(0.3, st.floats(0.0, 1.0))))
  p = random_problem(draw(st.integers(0, 2**31 - 1)), B=draw(st.integers(1, 2)),
                     T=draw(_first(min(max(63, min_t), max_t), st.integers(min_t, max_t))), H=H, HV=HV,
                     K=draw(st.sampled_from((8, 16))), V=draw(st.sampled_from((8, 16))), decay=decay,
                     k_write=k_write, initial_state=draw(st.sampled_from((True, False))), **extra)
  if gates:
    p.beta = p.beta * draw(st.sampled_from((1.0, 0.5, 0.0)) | st.floats(0.0, 1.0))
  return solve, p, draw(st.sampled_from(CHUNKS)), draw(st.sampled_from(dtypes))


def _run_examples(base, strategy, check):
  """Runs check(drawn) on `examples(base)` problems drawn from `strategy` (hypothesis's first is its simplest)."""
  settings(max_examples=examples(base))(given(strategy)(check))()


def _eager_in_the_quick_suite(*keep):
  """A class decorator: marks the class's `__without_jit` variants slow except the methods named in `keep` (every
  case runs under jit in `make test`; `keep` runs one of them without jit there too)."""
  def mark(cls):
    names = [n for n in dir(cls) if n.startswith("test") and n.endswith("__without_jit")]
    assert set(keep) <= set(names), (cls.__name__, sorted(set(keep) - set(names)))
    for name in names:
      if name not in keep:
        setattr(cls, name, pytest.mark.slow(getattr(cls, name)))
    return cls
  return mark


def _jit_vjp(fn, arrays):
  """`vjp_all(fn, arrays)` as one compiled program: for the side a property compares against (the function under
  test goes through `self.variant`)."""
  return jax.jit(lambda a: vjp_all(fn, a))(arrays)


@_eager_in_the_quick_suite("test_matches_the_oracle_online_channel__without_jit")
class ChunkedSolveTest(chex.TestCase):
  """Property 1: the chunked XLA solves against the fp64 token-serial oracle."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*SOLVE_DECAYS)
  def test_matches_the_oracle(self, solve, decay):
    """Outputs, final states and every input gradient within §4's tolerance of the oracle fed the same
    (rounded) values; o in the inputs' dtype, S in fp32 (fp64 for fp64 inputs), gradients in their inputs'."""
    def check(drawn):
      _, p, chunk, dtype = drawn
      arrays = p.arrays(dtype)
      got = self.variant(lambda a: vjp_all(_solve(solve, "xla", chunk_size=chunk), a))(arrays)
      assert_trees_close(got, _oracle(p, solve, dtype), dtype, dtypes=contract_dtypes(arrays))
    _run_examples(2, problems(solve=solve, decay=decay, dtypes=(jnp.float32, jnp.bfloat16, F64)), check)


def _cut(x, sl):
  return None if x is None else x[:, sl]


@_eager_in_the_quick_suite("test_zero_padding_is_invisible_scalar__without_jit")
class SolveStructureTest(chex.TestCase):
  """Properties 2 and 3: chaining through the final state, and zero padding (both solves drawn; the fixed cases
  without gradients: tests/ops/test_api.py::test_chaining_two_halves,
  tests/ops/test_chunked.py::test_padding_is_invisible).
  """

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*[(d, d) for d in DECAYS])
  def test_two_halves_through_the_final_state_equal_one_run(self, decay):
    """Running [0, c) and then [c, T) from its final state equals one run of [0, T): values and the gradients
    of every input (through the carried state too)."""
    def check(drawn):
      (solve, p, chunk, _), frac = drawn
      cut = max(1, min(p.q.shape[1] - 1, int(frac * p.q.shape[1])))
      run = _solve(solve, "xla", chunk_size=chunk)

      def halves(**a):
        first = {n: (_cut(x, slice(0, cut)) if n != "initial_state" else x) for n, x in a.items()}
        o1, s1 = run(**first)
        o2, s2 = run(**dict({n: _cut(x, slice(cut, None)) for n, x in a.items()}, initial_state=s1))
        return jnp.concatenate([o1, o2], axis=1), s2

      arrays = p.arrays(jnp.float32)
      got = self.variant(lambda a: vjp_all(halves, a))(arrays)
      assert_trees_close(got, _jit_vjp(run, arrays), jnp.float32, dtypes=contract_dtypes(arrays))
    _run_examples(2, st.tuples(problems(decay=decay, min_t=2, gates=False), _first(0.45, st.floats(0.05, 0.95))),
                  check)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*[(d, d) for d in DECAYS])
  def test_zero_padding_is_invisible(self, decay):
    """The inputs zero-padded by P tokens (β = 0, g = 0 and zero keys there, which leave the state as it is),
    the outputs sliced back to T: the same outputs, final state and input gradients as the unpadded run."""
    def check(drawn):
      (solve, p, chunk, _), extra = drawn
      run = _solve(solve, "xla", chunk_size=chunk)

      def padded(**a):
        pad = lambda x: None if x is None else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
        o, s = run(**{n: (pad(x) if n != "initial_state" else x) for n, x in a.items()})
        return o[:, :p.q.shape[1]], s

      arrays = p.arrays(jnp.float32)
      got = self.variant(lambda a: vjp_all(padded, a))(arrays)
      assert_trees_close(got, _jit_vjp(run, arrays), jnp.float32, dtypes=contract_dtypes(arrays))
    _run_examples(2, st.tuples(problems(decay=decay, gates=False), _first(37, st.integers(1, 140))), check)


# -------------------------------------------------------------------------------------------------------------
# Property 4: the preconditioners.
# -------------------------------------------------------------------------------------------------------------
def _unit(x):
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@st.composite
def precond_problems(draw, which):
  """fp64 arrays for one preconditioner (keys [2, T, H, K] unit or with zero tokens, gates, an initial state
  or none) and its static options: PDN's x and center, ATQ's λ, OSDN's η, d_init, bounds (both, upper only,
  none) and APF anchor; β = 0 tokens and retentions of exactly 0 and 1 with `extreme`. The simplest draw: T = 40,
  grouped gain heads, extreme gates, an initial state, PDN's x = 1.7, unbounded OSDN (the exact chunked form)."""
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  # Few distinct shapes: without jit every primitive compiles once per shape, so examples share those compiles.
  B, T, K = 2, draw(st.sampled_from((40, 2, 9, 77))), draw(st.sampled_from((8, 16)))
  H, G = draw(st.sampled_from(((1, 2), (1, 1), (2, 2), (2, 4))))     # G (OSDN's gain heads) a multiple of H
  extreme = draw(st.sampled_from((True, False)))
  sig = lambda x: 1.0 / (1.0 + np.exp(-x))
  f = lambda x: jnp.asarray(x, F64)
  k = _unit(rng.normal(size=(B, T, H, K)))
  if extreme:
    k[:, 3::11] = 0.0
  state = draw(st.sampled_from((True, False)))
  if which in ("pdn", "atq"):
    beta, g = sig(rng.normal(size=(B, T, H))), -np.logaddexp(0.0, -(rng.normal(size=(B, T, H)) + 2.0))
    if extreme:
      beta[:, 1::7], g[:, 2::9] = 0.0, 0.0
    arrays = dict(k=f(k), beta=f(beta), log_decay=f(g), initial_state=f(rng.random((B, H, K))) if state else None)
    if which == "pdn":
      arrays["center"] = f(rng.normal(size=(H,)) * 0.3)
      return arrays, dict(x=draw(st.sampled_from((1.7, 1.0, 1.5, 3.0))))
    arrays["q"] = f(rng.normal(size=(B, T, H, K)))
    return arrays, dict(lam=draw(st.sampled_from((0.5, 1.0, 2.0))))
  beta = sig(rng.normal(size=(B, T, G)) + 0.5)
  if extreme:
    beta[:, ::9] = 0.0
  arrays = dict(k=f(k), beta=f(beta), initial_state=f(0.5 + rng.random((B, G, K))) if state else None)
  if which == "osdn-apf":
    r = sig(rng.normal(size=(B, T, G)) + 3.0)
    if extreme:
      r[:, 5::13], r[:, 6::13] = 0.0, 1.0
    arrays["retention"] = f(r)
  lo, hi = draw(st.sampled_from(((None, None), (0.0, 8.0), (0.0, 1.6), (None, 1.4))))
  options = dict(eta=draw(st.sampled_from((0.5, 1.0, 4.0, 12.0))), d_init=draw(st.sampled_from((0.9, 1.0, 1.5))),
                 d_min=lo, d_max=hi, apf_anchor=draw(st.sampled_from(("zero", "init"))),
                 chunk_size=draw(st.sampled_from(CHUNKS)))
  return arrays, options


def _precond(which, impl, options):
  """fn(**arrays) → (written key or query, final state) for `which` run by `impl`: "fast" (implementation "xla")
  or "reference" (the token-serial forms: dgps/naive.py's moment for PDN / ATQ, OSDN's token-serial d-pass)."""
  impl = "xla" if impl == "fast" else impl
  if which == "pdn":
    return lambda k, beta, log_decay, center, initial_state: precond.pdn_write_key(
        k, beta, log_decay, center, initial_state=initial_state, implementation=impl, **options)
  if which == "atq":
    return lambda q, k, beta, log_decay, initial_state: precond.atq_query(
        q, k, beta, log_decay, initial_state=initial_state, implementation=impl, **options)
  return lambda k, beta, initial_state, retention=None: precond.osdn_write_key(
      k, beta, retention=retention, initial_state=initial_state, implementation=impl, **options)


PRECONDITIONERS = [("pdn", "pdn"), ("atq", "atq"), ("osdn", "osdn"), ("osdn_apf", "osdn-apf")]


@_eager_in_the_quick_suite("test_fast_form_matches_the_reference_pdn__without_jit")
class PreconditionerTest(chex.TestCase):
  """Property 4: the preconditioner passes (fp64 against fp64: both forms are exact algebra)."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*PRECONDITIONERS)
  def test_fast_form_matches_the_reference(self, which):
    """The associative-scan moment (PDN, ATQ) and OSDN's d-pass by "xla" (the exact chunked form when
    unbounded, the scan when clipped) against the token-serial references: the written key (or query), the
    final state and the gradient of every input, finite; PDN's gradients reach every input."""
    def check(drawn):
      arrays, options = drawn
      got = self.variant(lambda a: vjp_all(_precond(which, "fast", options), a))(arrays)
      want = _jit_vjp(_precond(which, "reference", options), arrays)
      assert_trees_close(got, want, F64, dtypes={n: F64 for n in want}, tol=EXACT)
      if which == "pdn" and options["x"] != 1.0:       # x = 1 writes k itself: nothing reaches the gates
        assert all(float(jnp.max(jnp.abs(got[n]))) > 0 for n, x in arrays.items() if x is not None), options
    _run_examples(2, precond_problems(which), check)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*PRECONDITIONERS)
  def test_two_halves_through_the_final_state_equal_one_run(self, which):
    """The fast form run on [0, c) and then on [c, T) from its final state equals one run: values and every
    input gradient."""
    def check(drawn):
      (arrays, options), frac = drawn
      t = arrays["k"].shape[1]
      cut = max(1, min(t - 1, int(frac * t)))
      run = _precond(which, "fast", options)

      def halves(**a):
        y1, s1 = run(**{n: (_cut(x, slice(0, cut)) if n not in ("initial_state", "center") else x)
                        for n, x in a.items()})
        y2, s2 = run(**{n: (_cut(x, slice(cut, None)) if n not in ("initial_state", "center") else x)
                        for n, x in dict(a, initial_state=s1).items()})
        return jnp.concatenate([y1, y2], axis=1), s2

      # Without an initial state the first half starts from the preconditioner's default (zero moment, d_init).
      got = self.variant(lambda a: vjp_all(halves, a))(arrays)
      assert_trees_close(got, _jit_vjp(run, arrays), F64, tol=EXACT)
    # A few cut points (as few T): without jit, examples then share the compiles of each half's primitives.
    _run_examples(2, st.tuples(precond_problems(which), st.sampled_from((0.5, 0.25, 0.75))), check)


# -------------------------------------------------------------------------------------------------------------
# Property 5: the Pallas delta rule (interpret mode on CPU).
# -------------------------------------------------------------------------------------------------------------
@st.composite
def pallas_problems(draw):
  """(problem, chunk, segment ids or None, dtype): random shapes and features, packed rows where `cuts` fall
  inside T (per-segment initial states), and with `extreme` log-decays of −1e3 and exactly 0, β ∈ {0, 1} rows
  and zero keys. The simplest draw: per-channel decay, grouped heads, value-head write keys, a state, T = 45, fp32,
  unpacked."""
  H, HV = draw(st.sampled_from(((2, 4), (1, 1), (1, 4), (2, 2))))
  decay = draw(st.sampled_from(("channel", "none", "scalar")))
  T, state = draw(_first(45, st.integers(1, 80))), draw(st.sampled_from((True, False)))
  seed = draw(st.integers(0, 2**31 - 1))
  p = random_problem(seed, B=2, T=T, H=H, HV=HV, K=draw(st.sampled_from((8, 24, 32))),
                     V=draw(st.sampled_from((8, 40))), decay=decay,
                     k_write=draw(st.sampled_from(("value", "none", "key"))), initial_state=state)
  if draw(st.booleans()):
    if p.log_decay is not None:
      p.log_decay[:, ::7] = -1e3
      p.log_decay[:, 1::5] = 0.0
    p.beta[:, ::3] = 1.0
    p.beta[:, 2::4] = 0.0
    p.k[:, 3::6] = 0.0
  cuts = sorted(c for c in draw(st.lists(st.integers(1, 79), max_size=3, unique=True)) if c < T)
  sids = None
  if cuts:
    row = np.searchsorted(np.asarray(cuts), np.arange(T), side="right").astype(np.int32)
    sids = np.stack([row, row])
    if state:
      p.initial_state = np.random.default_rng(seed).normal(size=(2 * (len(cuts) + 1), HV, p.k.shape[-1],
                                                                   p.v.shape[-1])) / np.sqrt(p.k.shape[-1])
  return p, draw(st.sampled_from((16, 32, 64))), sids, draw(st.sampled_from((jnp.float32, jnp.bfloat16)))


@_eager_in_the_quick_suite()
class PallasDeltaRuleTest(chex.TestCase):
  """Property 5: the Pallas delta-rule kernels against the fp64 oracle."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_random_problems_against_the_oracle(self):
    """Random shapes and features through `ops.delta_rule(implementation="pallas")` (fp32 or bf16) against the
    fp64 oracle on the same rounded values: outputs, final states and every input gradient, in the contract's
    dtypes."""
    def check(drawn):
      p, chunk, sids, dtype = drawn
      arrays = p.arrays(dtype)
      got = self.variant(lambda a: vjp_all(_solve("online", "pallas", chunk_size=chunk, segment_ids=sids), a))(
          arrays)
      want = _oracle(p, "online", dtype, segment_ids=sids)
      assert_trees_close(got, want, dtype, dtypes=contract_dtypes(arrays))
    _run_examples(3, pallas_problems(), check)
