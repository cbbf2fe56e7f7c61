"""The ops the benchmark runner measures: their inputs, implementations, and the function each implementation runs.

An `Op` says how to draw fresh random host inputs for a shape (B, T, H, K = V), which of them are "wide" (cast to
the benchmark dtype: q, k, v and write keys; gates and states stay fp32), which are differentiated, which
implementations it has, and `build(impl, variant)`: a function x → tuple of outputs (x the dict of device
arrays). End-to-end ops run the preconditioner's first pass and the solve; component ops one library call each.

A `Variant` is "default" or "<family>:<field=value>+<field=value>..." over the launch parameters of one kernel
family (`FAMILIES`); it applies to the pallas implementation of the ops that call that family (`Op.families`).
Every variant goes through the public API, its config as the call's `kernel_config` (the family's calls only: a
delta_rule variant's config reaches the solve, an osdn variant's the d-pass and its guard, a precond_key variant's
PDN's key and ATQ's query).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from osdn_jax import ops
from osdn_jax.dgps import mesa, precond
from osdn_jax.ops import packing

SHAPES = {"main": (4, 4096, 16, 128), "long": (1, 32768, 8, 128), "small": (2, 1024, 4, 64),
          "wide": (2, 2048, 8, 256), "tiny": (1, 64, 2, 16)}
REFERENCE_MAX_T = 4096        # the token-serial solves are timed up to this T
SEGMENTS = 8                  # segments per row of the packed components (fewer where random cuts coincide)
CENTER = -0.2                 # PDN's center c in the end-to-end ops
FAMILIES = ("delta_rule", "osdn", "precond_key")
IMPLS = ("reference", "xla", "pallas", "fla")
D_PASS = dict(eta=1.0, d_min=0.0, d_max=8.0, apf_anchor="init")   # the d_pass component: APF "init", clip [0, 8]


def parse_shape(text: str) -> tuple[int, int, int, int]:
  """A name of SHAPES or "BxTxHxK" (e.g. "4x4096x16x64") → (B, T, H, K)."""
  if text in SHAPES:
    return SHAPES[text]
  try:
    dims = tuple(int(v) for v in text.split("x"))
  except ValueError:
    dims = ()
  if len(dims) != 4 or min(dims) < 1:
    raise ValueError(f"shape {text!r}: expected one of {list(SHAPES)} or 'BxTxHxK'")
  return dims


# ---------------------------------------------------------------------------------------------------------
# Variants.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
  """"default" (family None, config None) or one kernel family's Config with fields overridden."""
  name: str
  family: str | None = None
  config: Any = None

  @property
  def default(self) -> bool:
    return self.family is None


DEFAULT = Variant("default")


def family_config(family: str, items=()):
  """The family's default Config (as the kernel picks it on this backend: `default_config`) with `items` applied
  (`Config.override`: "field=value", for delta_rule "group.field=value")."""
  from pallas_kernels.arrays import default_interpret, device_kind
  if family == "delta_rule":
    from pallas_kernels.gpu import delta_rule as module
  elif family == "osdn":
    from pallas_kernels.gpu import osdn as module
  elif family == "precond_key":
    from pallas_kernels.gpu import precond_key as module
  else:
    raise ValueError(f"unknown kernel family {family!r}: one of {FAMILIES}")
  return module.default_config(None, device_kind(default_interpret(None))).override(*items)


def parse_kernel_variant(text: str) -> Variant:
  """"default" or "<family>:<field=value>+..." → Variant. ValueError naming the variant and the bad field."""
  text = text.strip()
  if text in ("", "default"):
    return DEFAULT
  family, sep, rest = text.partition(":")
  items = [s for s in rest.split("+") if s.strip()]
  if not sep or family not in FAMILIES or not items:
    raise ValueError(f"variant {text!r}: expected 'default' or '<family>:<field=value>+...' with family one of "
                     f"{FAMILIES}")
  try:
    config = family_config(family, items)
  except (ValueError, TypeError) as e:      # TypeError: a value of the wrong kind reaching a field's check
    raise ValueError(f"variant {text!r}: {e}") from None
  return Variant(text, family, config)


# ---------------------------------------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------------------------------------
def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _sig(x):
  return 1 / (1 + np.exp(-x))


def _logsig(x):
  return -np.logaddexp(0, -x)


def _f32(x):
  return {n: a.astype(np.int32 if n == "segment_ids" else np.float32) for n, a in x.items()}


def _end_to_end_inputs(decay: str, extra: str | None):
  """Inputs of an end-to-end op: unit q, k; v ~ N(0, 1); β = σ(N); log-decays logσ(N + 4) (none, per head or
  per channel); PDN gates βᴾ = σ(N), gᴾ = logσ(N + 4); APF retention r = σ(N + 8)."""
  def inputs(shape, seed=0):
    b, t, h, d = shape
    rng = np.random.default_rng(seed)
    x = dict(q=_unit(rng.normal(size=(b, t, h, d))), k=_unit(rng.normal(size=(b, t, h, d))),
             v=rng.normal(size=(b, t, h, d)), beta=_sig(rng.normal(size=(b, t, h))))
    if decay == "scalar":
      x["g"] = _logsig(rng.normal(size=(b, t, h)) + 4)
    if decay == "channel":
      x["g"] = _logsig(rng.normal(size=(b, t, h, d)) + 4)
    if extra == "pdn":
      x["beta_p"] = _sig(rng.normal(size=(b, t, h)))
      x["g_p"] = _logsig(rng.normal(size=(b, t, h)) + 4)
    if extra == "apf":
      x["r"] = _sig(rng.normal(size=(b, t, h)) + 8)
    return _f32(x)
  return inputs


def _component_inputs(names):
  """Inputs of a component op, `names` of one draw: random segment cuts (SEGMENTS per row), unit q, k; write
  keys kw = unit ⊙ e^{0.3 clip(N, ±1)}; v ~ N(0, 1); β = σ(N); log-decays g (per head), gc (per channel)
  logσ(N + 4); PDN/ATQ gates βᴾ = σ(N), gᴾ = logσ(N + 4); retention r = σ(N + 3); per-segment states
  S0 ~ N(0, 1/K), d0 ∈ [0.5, 1.5); A0 ∈ [0, 1); per-head centres c ∈ [−0.5, 0.3]; MesaNet's λ = 0.25 + softplus(N)
  [H, K] and key Gram H0 = X Xᵀ / (5K) [B, H, K, K], X ~ N(0, 1)."""
  def inputs(shape, seed=0):
    b, t, h, d = shape
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, t), size=(b, min(SEGMENTS, t) - 1), replace=True), axis=1)
    ids = (np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1)          # [B, T]
    n = packing.num_segments(ids)
    x = dict(q=_unit(rng.normal(size=(b, t, h, d))), k=_unit(rng.normal(size=(b, t, h, d))),
             kw=_unit(rng.normal(size=(b, t, h, d))) * np.exp(0.3 * np.clip(rng.normal(size=(b, t, h, d)), -1, 1)),
             v=rng.normal(size=(b, t, h, d)), beta=_sig(rng.normal(size=(b, t, h))),
             g=_logsig(rng.normal(size=(b, t, h)) + 4), gc=_logsig(rng.normal(size=(b, t, h, d)) + 4),
             beta_p=_sig(rng.normal(size=(b, t, h))), g_p=_logsig(rng.normal(size=(b, t, h)) + 4),
             r=_sig(rng.normal(size=(b, t, h)) + 3), S0=rng.normal(size=(n, h, d, d)) / np.sqrt(d),
             d0=0.5 + rng.random(size=(n, h, d)), A0=rng.random(size=(b, h, d)), center=np.linspace(-0.5, 0.3, h),
             segment_ids=ids)
    if "H0" in names:
      gram = rng.normal(size=(b, h, d, d))
      x.update(lam=0.25 + np.log1p(np.exp(rng.normal(size=(h, d)))),
               H0=np.einsum("bhij,bhkj->bhik", gram, gram) / (5 * d))
    return _f32({k: x[k] for k in names})
  return inputs


def _state_inputs(decay: str):
  """Inputs of an unpacked solve with states: unit q, k; v ~ N(0, 1); β = σ(N); S0 ~ N(0, 1/K); log-decays
  logσ(N + 4) (none, per head or per channel)."""
  def inputs(shape, seed=0):
    b, t, h, d = shape
    rng = np.random.default_rng(seed)
    x = dict(q=_unit(rng.normal(size=(b, t, h, d))), k=_unit(rng.normal(size=(b, t, h, d))),
             v=rng.normal(size=(b, t, h, d)), beta=_sig(rng.normal(size=(b, t, h))),
             S0=rng.normal(size=(b, h, d, d)) / np.sqrt(d))
    if decay != "none":
      x["g"] = _logsig(rng.normal(size=(b, t, h) + ((d,) if decay == "channel" else ())) + 4)
    return _f32(x)
  return inputs


def _d_pass_inputs(retention: bool):
  """The d-pass's inputs from unit keys k: u = k ⊙ k, n = max(‖k‖², 1e-12); β = σ(N); r = σ(N + 4) (with a
  retention); d1 and d_init ones."""
  def inputs(shape, seed=0):
    b, t, g, kd = shape
    rng = np.random.default_rng(seed)
    k = _unit(rng.normal(size=(b, t, g, kd)))
    u = k * k
    x = dict(u=u, n=np.maximum(u.sum(-1), 1e-12), beta=_sig(rng.normal(size=(b, t, g))),
             r=_sig(rng.normal(size=(b, t, g)) + 4), d1=np.ones((b, g, kd)), d_init=np.ones((g, kd)))
    if not retention:
      del x["r"]
    return _f32(x)
  return inputs


# ---------------------------------------------------------------------------------------------------------
# The calls, with a variant's config where it applies.
# ---------------------------------------------------------------------------------------------------------
def _config(variant, family: str):
  """The variant's config for the calls of `family` (None for the others: their kernels' defaults)."""
  return variant.config if variant.family == family else None


def _solve(impl, variant, q, k, v, beta, *, segment_ids=None, output_final_state=False, **kw):
  """`ops.delta_rule` with a delta_rule variant's config."""
  return ops.delta_rule(q, k, v, beta, segment_ids=segment_ids, output_final_state=output_final_state,
                        implementation=impl, kernel_config=_config(variant, "delta_rule"), **kw)


def _precond(impl, variant, transform, k, beta_p, g_p, *, q=None, center=None, initial_state=None):
  """`precond.pdn_write_key` / `atq_query` with a precond_key variant's config."""
  config = _config(variant, "precond_key")
  if transform == "pdn":
    return precond.pdn_write_key(k, beta_p, g_p, center, initial_state=initial_state, implementation=impl,
                                 kernel_config=config)
  return precond.atq_query(q, k, beta_p, g_p, initial_state=initial_state, implementation=impl,
                           kernel_config=config)


def _end_to_end(first_pass: str | None):
  """x → (o,): the preconditioner's first pass (none, PDN, OSDN with retention r when given) and the solve."""
  def make(impl, variant):
    def f(x):
      k_write = None
      if first_pass == "pdn":
        center = jnp.full((x["k"].shape[2],), CENTER, jnp.float32)
        k_write, _ = _precond(impl, variant, "pdn", x["k"], x["beta_p"], x["g_p"], center=center)
      elif first_pass == "osdn":
        k_write, _ = precond.osdn_write_key(x["k"], x["beta"], retention=x.get("r"), implementation=impl,
                                            kernel_config=_config(variant, "osdn"))
      o, _ = _solve(impl, variant, x["q"], x["k"], x["v"], x["beta"], k_write=k_write, log_decay=x.get("g"))
      return (o,)
    return f
  return make


def _packed(impl, variant):
  def f(x):
    return _solve(impl, variant, x["q"], x["k"], x["v"], x["beta"], k_write=x["kw"], log_decay=x["g"],
                  initial_state=x["S0"], segment_ids=x["segment_ids"], output_final_state=True)
  return f


def _offline(impl, variant):
  def f(x):
    return ops.linear_attention(x["q"], x["k"], x["v"], beta=x["beta"], log_decay=x["gc"], output_final_state=True,
                                implementation=impl, kernel_config=_config(variant, "delta_rule"))
  return f


def _mesa_query(impl, variant):
  del variant
  def f(x):
    return mesa.mesa_query(x["q"], x["k"], x["beta"], x["g"], lam=x["lam"], initial_state=x["H0"],
                           implementation=impl)
  return f


def _pdn_key(impl, variant):
  def f(x):
    return _precond(impl, variant, "pdn", x["k"], x["beta_p"], x["g_p"], center=x["center"],
                    initial_state=x["A0"])
  return f


def _atq_query(impl, variant):
  def f(x):
    return _precond(impl, variant, "atq", x["k"], x["beta_p"], x["g_p"], q=x["q"], initial_state=x["A0"])
  return f


def _with_states(impl, variant):
  def f(x):
    return _solve(impl, variant, x["q"], x["k"], x["v"], x["beta"], log_decay=x.get("g"), initial_state=x["S0"],
                  output_final_state=True)
  return f


def _d_pass(impl, variant):
  def f(x):
    args = (x["u"], x["n"], x["beta"], x.get("r"), x["d1"], x["d_init"])
    return precond.osdn_d_pass(*args, implementation=impl, kernel_config=_config(variant, "osdn"), **D_PASS)
  return f


def _osdn_packed(impl, variant):
  def f(x):
    return precond.osdn_write_key(x["k"], x["beta"], retention=x["r"], initial_state=x["d0"],
                                  segment_ids=x["segment_ids"], implementation=impl,
                                  kernel_config=_config(variant, "osdn"))
  return f


# ---------------------------------------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Op:
  """One measured op. `inputs(shape, seed)` → {name: host numpy array} (fp32; segment_ids int32); `wide`: the
  inputs cast to the benchmark dtype; `diff`: the inputs differentiated in fwdbwd; `outputs`: names of the
  tuple `build(impl, variant)(x)` returns; `families`: the kernel families whose variants apply to its pallas
  implementation; `fla`: FLA's op, when FLA has one; `reference_max_t`: the longest T "reference" runs at
  (None: any). Every op has "xla", the baseline of the ratios without FLA and of the accuracy check."""
  name: str
  doc: str
  inputs: Callable[..., dict]
  wide: tuple[str, ...]
  diff: tuple[str, ...]
  outputs: tuple[str, ...]
  impls: tuple[str, ...]
  make: Callable[[str, Variant], Callable[[dict], tuple]]
  families: tuple[str, ...] = ()
  fla: str | None = None
  reference_max_t: int | None = REFERENCE_MAX_T

  def takes(self, impl: str, variant: Variant = DEFAULT) -> bool:
    """Whether `impl` with `variant` is an implementation of this op (variants: pallas, its families)."""
    if impl not in self.impls:
      return False
    return variant.default or (impl == "pallas" and variant.family in self.families)

  def runs_at(self, impl: str, shape) -> bool:
    return impl != "reference" or self.reference_max_t is None or shape[1] <= self.reference_max_t

  def build(self, impl: str, variant: Variant = DEFAULT) -> Callable[[dict], tuple]:
    """x → tuple of outputs (named `outputs`) for `impl` ("reference", "xla", "pallas"; FLA is `benchmarks.fla`)."""
    if impl == "fla" or not self.takes(impl, variant):
      raise ValueError(f"{self.name}: no implementation {impl!r} with variant {variant.name!r} (implementations "
                       f"{self.impls}; variants of {self.families or 'no kernel family'})")
    return self.make(impl, variant)


_E2E = ("reference", "xla", "pallas", "fla")


def _e2e(name, doc, decay, first_pass=None, retention=False, fla=None):
  extra = "pdn" if first_pass == "pdn" else ("apf" if retention else None)
  names = ("q", "k", "v", "beta") + (("g",) if decay != "none" else ()) + (
      ("beta_p", "g_p") if extra == "pdn" else ()) + (("r",) if retention else ())
  return Op(name, doc, _end_to_end_inputs(decay, extra), wide=("q", "k", "v"), diff=names, outputs=("o",),
            impls=_E2E if fla else _E2E[:-1], make=_end_to_end(first_pass),
            families=("delta_rule",) + {"pdn": ("precond_key",), "osdn": ("osdn",)}.get(first_pass, ()), fla=fla)


def _component(name, doc, names, wide, outputs, make, families=(), reference_max_t=REFERENCE_MAX_T, inputs=None):
  diff = tuple(n for n in names if n != "segment_ids")
  return Op(name, doc, inputs or _component_inputs(names), wide=wide, diff=diff, outputs=outputs,
            impls=("reference", "xla", "pallas"), make=make, families=families, reference_max_t=reference_max_t)


OPS = {op.name: op for op in (
    _e2e("dn", "DeltaNet: the online solve, no decay", "none", fla="chunk_delta_rule"),
    _e2e("gdn", "Gated DeltaNet: per-head decay", "scalar", fla="chunk_gated_delta_rule"),
    _e2e("kda", "KDA: per-channel decay", "channel", fla="chunk_kda"),
    _e2e("pdn", "PDN write key + DeltaNet", "none", "pdn", fla="chunk_precond_gated_delta_rule (g = 0)"),
    _e2e("pgdn", "PDN write key + Gated DeltaNet", "scalar", "pdn", fla="chunk_precond_gated_delta_rule"),
    _e2e("pkda", "PDN write key + KDA", "channel", "pdn", fla="chunk_precond_kda"),
    _e2e("osdn", "OSDN write key (clip [0, 8]) + DeltaNet", "none", "osdn"),
    _e2e("osdn-apf", "OSDN write key with APF retention (clip [0, 8]) + DeltaNet", "none", "osdn", retention=True),
    *(_component(f"{name}_state", f"ops.delta_rule with an initial state and the final state, {doc}",
                 ("q", "k", "v", "beta", "S0") + (("g",) if decay != "none" else ()), ("q", "k", "v"), ("o", "S"),
                 _with_states, families=("delta_rule",), inputs=_state_inputs(decay))
      for name, decay, doc in (("dn", "none", "no decay"), ("gdn", "scalar", "per-head decay"),
                               ("kda", "channel", "per-channel decay"))),
    _component("packed", "ops.delta_rule packed: random segments, per-segment initial states, per-head decay, "
               "separate write keys", ("q", "k", "kw", "v", "beta", "g", "S0", "segment_ids"),
               ("q", "k", "kw", "v"), ("o", "S"), _packed, families=("delta_rule",)),
    _component("offline", "ops.linear_attention, per-channel decay", ("q", "k", "v", "beta", "gc"),
               ("q", "k", "v"), ("o", "S"), _offline, families=("delta_rule",)),
    _component("pdn_key", "precond.pdn_write_key with initial state, per-head center",
               ("k", "beta_p", "g_p", "A0", "center"), ("k",), ("k_write", "A_T"), _pdn_key,
               families=("precond_key",)),
    _component("atq_query", "precond.atq_query with initial state", ("q", "k", "beta_p", "g_p", "A0"),
               ("q", "k"), ("q_tilde", "A_T"), _atq_query, families=("precond_key",)),
    # Clipped, the XLA path of the d-pass is the token-serial scan, as the reference (any T).
    _component("d_pass", "precond.osdn_d_pass: APF retention, anchor 'init', clip [0, 8] (fp32)",
               ("u", "n", "beta", "r", "d1", "d_init"), (), ("ds", "d_last"), _d_pass, families=("osdn",),
               reference_max_t=None, inputs=_d_pass_inputs(True)),
    _component("d_pass_r1", "precond.osdn_d_pass without retention (r ≡ 1, vanilla OSDN), clip [0, 8] (fp32)",
               ("u", "n", "beta", "d1", "d_init"), (), ("ds", "d_last"), _d_pass, families=("osdn",),
               reference_max_t=None, inputs=_d_pass_inputs(False)),
    # MesaNet's pass has no kernel: reference and xla only.
    dataclasses.replace(_component("mesa_query", "dgps.mesa.mesa_query: (H_t + Λ)⁻¹ q_t by 30 CG steps, per-head "
                                   "decay, initial state", ("q", "k", "beta", "g", "lam", "H0"), ("q", "k"),
                                   ("q_tilde", "H_T"), _mesa_query), impls=("reference", "xla")),
    _component("osdn_packed", "precond.osdn_write_key packed: APF retention, per-segment initial d, clip [0, 8]",
               ("k", "beta", "r", "d0", "segment_ids"), ("k",), ("k_write", "d_last"), _osdn_packed,
               families=("osdn",), reference_max_t=None),
)}
END_TO_END = ("dn", "gdn", "kda", "pdn", "pgdn", "pkda", "osdn", "osdn-apf")
COMPONENTS = tuple(n for n in OPS if n not in END_TO_END)
