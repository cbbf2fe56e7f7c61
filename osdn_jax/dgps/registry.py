"""The DGPS registry: every named point is a composition of one function per axis (Decay, Gain, Preconditioner,
Solve), and an unnamed point is composed from axis names the same way.

A point runs on *projected* per-token inputs: q, k [B, T, H, K], v [B, T, HV, V] and the features each axis
asks for (`Point.feature_shapes(dims)`: e.g. the gain's logit b [B, T, HV], the scalar decay's a [B, T, HV]),
with the parameters of `Point.init_params`. A layer projects the features from its input; a notebook can pass
random arrays. Every feature and parameter must be given under its name with exactly its shape (no broadcasting:
a [B, T, 1] decay for [B, T, HV] is a ValueError; names the point does not take are not read), and the options
are range-checked when the point is built (`dgps.checks`).

    point = dgps.get("pgdn")                       # or dgps.compose(decay="scalar", precond="pdn")
    dims = dgps.Dims(heads=4, value_heads=4, key_dim=64, value_dim=64)
    params = point.init_params(jax.random.key(0), dims)
    o, state = point(q, k, v, features, params, output_final_state=True)

Every axis value is an `Axis` (a `Solve` for the solve axis) that declares what it needs and what it sets; the
point decides nothing by an axis value's name. A new value is `register_axis(kind, name, Axis(...))` (or passed to
`compose` as an object), and `docs/design.md` ("Your own axis value") walks through one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from osdn_jax.dgps import checks
from osdn_jax.dgps import decay as decay_fns
from osdn_jax.dgps import gain as gain_fns
from osdn_jax.dgps import mesa as mesa_fns
from osdn_jax.dgps import precond as precond_fns
from osdn_jax.dgps import solve as solve_fns
from osdn_jax.ops import context as context_ops


@dataclasses.dataclass(frozen=True)
class Dims:
  """H key heads, HV = g·H value heads, key and value head dimensions (positive ints)."""
  heads: int
  value_heads: int
  key_dim: int
  value_dim: int

  def __post_init__(self):
    checks.dims("Dims", heads=self.heads, value_heads=self.value_heads, key_dim=self.key_dim,
                value_dim=self.value_dim)
    if self.value_heads % self.heads:
      raise ValueError(f"Dims: `value_heads` ({self.value_heads}) must be a multiple of `heads` ({self.heads})")


@dataclasses.dataclass(frozen=True)
class Feature:
  """A per-token input an axis needs, projected from the layer input.

  shape: per-token shape in symbols "H", "HV", "K". bias: the projection's initial bias (None: no bias), or a
  function of the point's options giving it. low_rank: a KDA-style low-rank projection (for per-channel gates).
  """
  shape: tuple[str, ...]
  bias: float | None | Callable[[Mapping[str, Any]], float | None] = None
  low_rank: bool = False

  def resolve(self, dims: Dims) -> tuple[int, ...]:
    return _resolve(self.shape, {"H": dims.heads, "HV": dims.value_heads, "K": dims.key_dim})


def _resolve(symbols: tuple[str, ...], sizes: Mapping[str, int]) -> tuple[int, ...]:
  return tuple(sizes[s] for s in symbols)


@dataclasses.dataclass
class Context:
  """What an axis value's `apply` receives: q, k [B, T, H, K] (l2-normalised when the point normalises them),
  v [B, T, HV, V], its own features {name: [B, T, ...]} and parameters {name: array} (the shapes it declared), the
  point's options (every axis's, plus "solve": the solve's name), the gain β [B, T, HV] and the log-decay (None,
  [B, T, HV] or [B, T, HV, K]) for the preconditioner (β None for an offline solve without a gain), its carried
  state (a stateful preconditioner: [B, G, K] or [B, G, K, K] (`State.matrix`), or [N, ...] per segment when
  `segment_ids` [B, T] packs several sequences into a row; None: start from `State.init`), the implementation its
  pass should run (one of `ops.dispatch.IMPLEMENTATIONS`), and what the point's solve reads (`Solve.reads`)."""
  q: Any
  k: Any
  v: Any
  features: Mapping[str, Any]
  params: Mapping[str, Any]
  options: Mapping[str, Any]
  beta: Any = None
  state: Any = None          # the preconditioner's carried state, if any ([N, G, K] per segment when packed)
  log_decay: Any = None      # the decay axis's log-decay, for the preconditioner (None: no decay)
  implementation: str = "auto"   # of the preconditioner's pass: one of `ops.dispatch.IMPLEMENTATIONS`
  segment_ids: Any = None    # [B, T] packed sequences (`osdn_jax.ops.packing`)
  reads: tuple[str, ...] = ()    # what the point's solve reads: ("k_write",) online, ("q_tilde",) offline


@dataclasses.dataclass(frozen=True)
class State:
  """The state a preconditioner carries from token to token: one K-vector (matrix: a K×K matrix) per head of each
  sequence.

  heads: "H" (one per key head) or "HV" (one per value head), so the state is [B, heads, K] ([N, heads, K], one
  per segment, when packed), or [B, heads, K, K] with matrix=True. init(options): the value every entry of a fresh
  state holds. carry: how the state
  entering each shard of a context-parallel run is formed (`osdn_jax.ops.context`): "diagonal" when the pass is
  affine and diagonal in its entering state (final = a ⊙ entering + b per channel; the shards' maps are
  composed), "rerun" when each shard runs again from the state the previous shard ends with (a ring), None when
  the value cannot run context-parallel (a ValueError there). Packing and decoding need nothing more: `apply`
  receives the entering state and `segment_ids`, and returns the state after the last token."""
  heads: str = "H"
  init: Callable[[Mapping[str, Any]], float] = lambda options: 0.0
  carry: str | None = None
  matrix: bool = False

  def shape(self, rows: int | None, heads: int, key_dim: int) -> tuple:
    """The state's shape for `rows` sequences of `heads` heads: (rows, heads, K) or (rows, heads, K, K)."""
    return (rows, heads, key_dim) + ((key_dim,) if self.matrix else ())

  def layout(self, lead: str) -> str:
    return f"[{lead}, {self.heads}, K{', K' if self.matrix else ''}]"

  def __post_init__(self):
    if self.heads not in ("H", "HV"):
      raise ValueError(f"dgps.State: `heads` must be 'H' or 'HV', got {self.heads!r}")
    if self.carry not in CARRIES:
      raise ValueError(f"dgps.State: `carry` must be one of {CARRIES}, got {self.carry!r}")
    if not isinstance(self.matrix, (bool, np.bool_)):
      raise ValueError(f"dgps.State: `matrix` must be a bool, got {self.matrix!r}")


CARRIES = ("diagonal", "rerun", None)
SETS = ("log_decay", "beta", "k_write", "q_tilde")


@dataclasses.dataclass(frozen=True, eq=False)
class Axis:
  """One value of the decay, gain or preconditioner axis: what it needs, what it sets, and how.

  apply(Context) returns, for a decay, the log-decay ([B, T, HV] scalar or [B, T, HV, K] per channel, ≤ 0) or
  None (no decay); for a gain, β [B, T, HV] or None; for a preconditioner, ({"k_write": [B, T, H or HV, K]} or
  {"q_tilde": [B, T, H or HV, K]} or {}, its final state or None).
  sets: the solve inputs it sets — "log_decay" (a decay), "beta" (a gain), "k_write" (the write key of the
  online solve), "q_tilde" (the read query of the offline solve); a preconditioner that sets one only its solve
  reads composes only with that solve (a ValueError otherwise).
  features: {name: Feature} projected per token from the layer input. params: {name: shape in symbols "H", "HV",
  "K"} of what init(key, dims, options) returns (fp32). defaults: its options and their default values;
  check(owner, options): a ValueError for an option out of range; derive(options): options computed from others
  (e.g. a bias chosen by an anchor). state: a `State` for a preconditioner that carries one, else None.
  context_parallel: False for a value that cannot run on a shard of a row (a token-serial reference).
  Compared and hashed by identity."""
  apply: Callable[[Context], Any]
  features: Mapping[str, Feature] = dataclasses.field(default_factory=dict)
  init: Callable[[Any, Dims, Mapping[str, Any]], dict] = lambda key, dims, opts: {}
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  params: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  check: Callable[[str, Mapping[str, Any]], None] = lambda owner, opts: None
  sets: tuple[str, ...] = ()
  state: State | None = None
  derive: Callable[[dict], dict] | None = None
  context_parallel: bool = True
  doc: str = ""

  def __post_init__(self):
    if not callable(self.apply):
      raise ValueError(f"dgps.Axis: `apply` must be a function of a dgps.Context, got {self.apply!r}")
    bad = [x for x in self.sets if x not in SETS]
    if bad or isinstance(self.sets, str):
      raise ValueError(f"dgps.Axis: `sets` must be a tuple of {SETS}, got {self.sets!r}")
    if self.state is not None and not isinstance(self.state, State):
      raise ValueError(f"dgps.Axis: `state` must be a dgps.State or None, got {self.state!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Solve:
  """One value of the solve axis. reads: the preconditioned input it consumes ("k_write": the online solve
  writes with it; "q_tilde": the offline solve reads with it). run(q, k, v, beta, **kw) and step(q, k, v, beta,
  state, **kw) have the signatures of `dgps.solve.solve` and `dgps.solve.step` after their `kind`; a solve with
  options (`defaults`, range-checked by check(owner, options)) receives them as keyword arguments of both."""
  reads: tuple[str, ...]
  run: Callable[..., Any]
  step: Callable[..., Any]
  doc: str = ""
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  check: Callable[[str, Mapping[str, Any]], None] = lambda owner, opts: None


def _shape3(c: Context):
  return c.v.shape[:3]


# ---------------------------------------------------------------------------------------------------------
# Axis tables. A new axis value is one entry here; a new point is one line in POINTS.
# ---------------------------------------------------------------------------------------------------------
_DECAY = ("log_decay",)
DECAYS = {
    "none": Axis(lambda c: None, doc="no decay"),
    "scalar": Axis(lambda c: decay_fns.gate(c.features["a"], c.params["A_log"], c.params["dt_bias"]),
                   features={"a": Feature(("HV",))},
                   init=lambda key, d, o: decay_fns.init_gate(key, (d.value_heads,)),
                   params={"A_log": ("HV",), "dt_bias": ("HV",)}, sets=_DECAY,
                   doc="a data-dependent decay per head (Mamba-2's gate)"),
    "channel": Axis(lambda c: decay_fns.gate(c.features["a"], c.params["A_log"], c.params["dt_bias"]),
                    features={"a": Feature(("HV", "K"), low_rank=True)},
                    init=lambda key, d, o: decay_fns.init_gate(key, (d.value_heads, d.key_dim)),
                    params={"A_log": ("HV",), "dt_bias": ("HV", "K")}, sets=_DECAY,
                    doc="a data-dependent decay per key channel (KDA's, GLA's)"),
    "constant": Axis(lambda c: decay_fns.retnet(*_shape3(c)), sets=_DECAY, doc="RetNet's fixed decay per head"),
    "sigmoid": Axis(lambda c: decay_fns.log_sigmoid(c.features["a"]), features={"a": Feature(("HV",), bias=0.0)},
                    sets=_DECAY, doc="MesaNet's forget gate: the decay factor σ(a) per head"),
}

_GAIN_LOGIT = {"b": Feature(("HV",))}
_GAIN = ("beta",)
GAINS = {
    "sigmoid": Axis(lambda c: gain_fns.sigmoid(c.features["b"]), features=_GAIN_LOGIT, sets=_GAIN,
                    doc="β = σ(b)"),
    "sigmoid2": Axis(lambda c: gain_fns.sigmoid2(c.features["b"]), features=_GAIN_LOGIT, sets=_GAIN,
                     doc="β = 2σ(b)"),
    "one": Axis(lambda c: jnp.ones(_shape3(c), c.k.dtype) if "k_write" in c.reads else None,
                sets=_GAIN, doc="β = 1 (none for the offline solve)"),
    "nlms": Axis(lambda c: gain_fns.nlms(c.features["b"], c.k), features=_GAIN_LOGIT, sets=_GAIN,
                 doc="β = σ(b)/(‖k‖² + ε)"),
    "longhorn": Axis(lambda c: gain_fns.longhorn(c.features["b"], c.k), features=_GAIN_LOGIT, sets=_GAIN,
                     doc="β = σ(b)/(1 + σ(b)‖k‖²)"),
}


def _second_moment_gates(c: Context):
  """βᴾ = σ(bᴾ), gᴾ = −exp(A_logᴾ) softplus(aᴾ + dt_biasᴾ): the PDN/ATQ second moment's own (untied) gates."""
  return jax.nn.sigmoid(c.features["b"]), decay_fns.gate(c.features["a"], c.params["A_log"], c.params["dt_bias"])


def _pdn(c: Context):
  k_write, A = precond_fns.pdn_write_key(c.k, *_second_moment_gates(c), c.params["center"], x=c.options["x"],
                                         eps=c.options["eps"], initial_state=c.state, segment_ids=c.segment_ids,
                                         implementation=c.implementation)
  return dict(k_write=k_write), A


def _atq(c: Context):
  q_tilde, A = precond_fns.atq_query(c.q, c.k, *_second_moment_gates(c), lam=c.options["lam"],
                                     initial_state=c.state, segment_ids=c.segment_ids,
                                     implementation=c.implementation)
  return dict(q_tilde=q_tilde), A


def osdn_retention(features):
  """OSDN-APF's retention r = σ(W_r x + b_r) [B, T, HV] from the preconditioner's features; None without APF."""
  return jax.nn.sigmoid(features["r"]) if "r" in features else None


def _osdn(c: Context):
  o = c.options
  k_write, d = precond_fns.osdn_write_key(
      c.k, c.beta, retention=osdn_retention(c.features), eta=o["eta"], d_init=o["d_init"], d_min=o["d_min"],
      d_max=o["d_max"], guard=o["guard"], apf_anchor=o["apf_anchor"], initial_state=c.state,
      implementation=c.implementation, segment_ids=c.segment_ids)
  return dict(k_write=k_write), d


def has_osdn_pass(point) -> bool:
  """Whether `point`'s preconditioner is OSDN's d-pass (with or without APF), whatever it is registered as."""
  return point.axis("precond").apply is _osdn


def _fixed(c: Context):
  k_write, _ = precond_fns.fixed_write_key(c.k, c.beta, jnp.exp(c.params["log_d"]), guard=c.options["guard"])
  return dict(k_write=k_write), None


def _exact(c: Context):
  if c.segment_ids is not None:
    raise ValueError("precond 'exact' (a token-serial reference) does not take `segment_ids`")
  if "q_tilde" in c.reads:
    beta = jnp.ones(_shape3(c), c.k.dtype) if c.beta is None else c.beta
    q_tilde, P = precond_fns.exact_query(c.q, c.k, beta, lam=c.options["lam"])
    return dict(q_tilde=q_tilde), None
  k_write, P = precond_fns.exact_write_key(c.k, c.beta, lam=c.options["lam"])
  return dict(k_write=k_write), None


def _mesa(c: Context):
  o = c.options
  beta = jnp.ones(_shape3(c), c.k.dtype) if c.beta is None else c.beta
  q_tilde, H = mesa_fns.mesa_query(c.q, c.k, beta, c.log_decay, lam=mesa_fns.lam_from_param(c.params["lam_raw"],
                                                                                            o["lam_min"]),
                                   initial_state=c.state, cg_steps=o["cg_steps"], cg_tol=o["cg_tol"],
                                   segment_ids=c.segment_ids, implementation=c.implementation)
  return dict(q_tilde=q_tilde), H


def has_mesa_pass(point) -> bool:
  """Whether `point`'s preconditioner is MesaNet's CG solve on the query, whatever it is registered as."""
  return point.axis("precond").apply is _mesa


def _second_moment_init(key, d: Dims, o):
  params = decay_fns.init_gate(key, (d.heads,))
  params["center"] = jnp.full((d.heads,), o["center_init"], jnp.float32)
  return params


_OSDN = dict(eta=1.0, d_init=1.0, d_min=0.0, d_max=8.0, guard=2.0, apf_anchor="zero")
_APF_BIAS = {"zero": 8.0, "init": 2.0}   # σ(8) ≈ 0.9997 keeps d near d_init at the start (docs/design.md §1)
_GATES = {"A_log": ("H",), "dt_bias": ("H",)}
_LAM = lambda owner, o: checks.lam(owner, o["lam"])
_OSDN_NAMES = (*_OSDN, "apf_bias")
_CHECK_OSDN = lambda owner, o: checks.osdn(owner, **{n: o[n] for n in _OSDN_NAMES if n in o})

_SECOND_MOMENT = State(heads="H", init=lambda o: 0.0, carry="diagonal")
_KEY_GRAM = State(heads="HV", init=lambda o: 0.0, carry="diagonal", matrix=True)   # MesaNet's H (e^{Σg} H_0 + N)
_MESA = dict(lam_min=0.25, lam_init=1.0, cg_steps=mesa_fns.CG_STEPS, cg_tol=mesa_fns.CG_TOL)
_OSDN_D = State(heads="HV", init=lambda o: o["d_init"], carry="rerun")
_apf_bias = lambda o: dict(o, apf_bias=_APF_BIAS[o["apf_anchor"]] if o["apf_bias"] is None else o["apf_bias"])

PRECONDS = {
    "identity": Axis(lambda c: ({}, None), doc="no preconditioner"),
    "pdn": Axis(_pdn, features={"a": Feature(("H",)), "b": Feature(("H",))}, init=_second_moment_init,
                defaults=dict(x=1.5, eps=1e-6, center_init=-0.2), params=dict(_GATES, center=("H",)),
                check=lambda owner, o: checks.pdn(owner, x=o["x"], eps=o["eps"], center_init=o["center_init"]),
                sets=("k_write",), state=_SECOND_MOMENT,
                doc="PDN: the decayed second moment of the keys, log-transformed and squashed into [1/x, x]"),
    "atq": Axis(_atq, features={"a": Feature(("H",)), "b": Feature(("H",))},
                init=lambda key, d, o: decay_fns.init_gate(key, (d.heads,)), defaults=dict(lam=1.0), params=_GATES,
                check=_LAM, sets=("q_tilde",), state=_SECOND_MOMENT,
                doc="the second moment's diagonal inverse applied to the query of the offline solve"),
    "osdn": Axis(_osdn, defaults=_OSDN, check=_CHECK_OSDN, sets=("k_write",), state=_OSDN_D,
                 doc="OSDN: the write scale d learned online by hypergradient descent"),
    "osdn-apf": Axis(_osdn, features={"r": Feature(("HV",), bias=lambda o: o["apf_bias"])},
                     defaults=dict(_OSDN, apf_bias=None), check=_CHECK_OSDN, derive=_apf_bias, sets=("k_write",),
                     state=_OSDN_D, doc="OSDN with a learned per-token retention of d (APF)"),
    "fixed": Axis(_fixed, init=lambda key, d, o: {
        "log_d": jnp.full((d.value_heads, d.key_dim), jnp.log(o["d_init"]), jnp.float32)},
                  defaults=dict(d_init=1.0, guard=2.0), params={"log_d": ("HV", "K")},
                  check=lambda owner, o: checks.fixed(owner, d_init=o["d_init"], guard=o["guard"]),
                  sets=("k_write",), doc="a learned constant write scale per channel (guarded like OSDN's)"),
    "mesa": Axis(_mesa, init=lambda key, d, o: {"lam_raw": mesa_fns.lam_param_init(
        (d.value_heads, d.key_dim), o["lam_init"], o["lam_min"])}, defaults=_MESA, params={"lam_raw": ("HV", "K")},
                 check=lambda owner, o: checks.mesa(owner, **{n: o[n] for n in _MESA}), sets=("q_tilde",),
                 state=_KEY_GRAM,
                 doc="MesaNet: (H_t + Λ)⁻¹ applied to the query by conjugate gradients, H_t the decayed, gained key "
                     "Gram of the solve's own gates"),
    "exact": Axis(_exact, defaults=dict(lam=1.0), check=_LAM, sets=("k_write", "q_tilde"), context_parallel=False,
                  doc="the exact (full-matrix) preconditioner, token-serial: a reference"),
}

SOLVES = {
    "online": Solve(reads=("k_write",), run=functools.partial(solve_fns.solve, "online"),
                    step=functools.partial(solve_fns.step, "online"), doc="the delta rule"),
    "offline": Solve(reads=("q_tilde",), run=functools.partial(solve_fns.solve, "offline"),
                     step=functools.partial(solve_fns.step, "offline"), doc="(decayed) linear attention"),
}
AXES = {"decay": DECAYS, "gain": GAINS, "precond": PRECONDS, "solve": SOLVES}
_BUILTIN_AXES = {kind: frozenset(table) for kind, table in AXES.items()}
_APPLIED = ("decay", "gain", "precond")
_OPTIONED = _APPLIED + ("solve",)      # the axes that declare options


def _l2norm(x, eps=1e-6):
  x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Point:
  """One point of the DGPS space: a value per axis, each a registered name or an `Axis` (`Solve`) object.
  `options` override the axes' defaults (e.g. x=2.0 for PDN, eta=0.5; every axis's options in one namespace);
  unknown names, values out of range (each axis's `check`) and compositions that cannot work (a preconditioner
  that sets an input its solve does not read) are a ValueError here."""
  name: str
  decay: str | Axis
  gain: str | Axis
  precond: str | Axis
  solve: str | Solve
  normalize_qk: bool = True
  options: tuple[tuple[str, Any], ...] = ()
  doc: str = ""

  def __post_init__(self):
    if not isinstance(self.name, str):
      raise ValueError(f"DGPS point: `name` must be a str, got {self.name!r}")
    owner = f"DGPS point {self.name!r}"
    for kind in AXES:
      value, want = getattr(self, kind), Solve if kind == "solve" else Axis
      if isinstance(value, want):
        continue
      if not isinstance(value, str) or value not in AXES[kind]:
        raise ValueError(f"{owner}: unknown `{kind}` {value!r}; one of {sorted(AXES[kind])}, or a dgps."
                         f"{want.__name__}")
    precond, solve = self.axis("precond"), self.axis("solve")
    unread = [x for x in precond.sets if x not in solve.reads]
    if precond.sets and len(unread) == len(precond.sets):
      what = {"k_write": "the write key", "q_tilde": "the read query"}
      raise ValueError(f"{owner}: precond {self.axis_name('precond')!r} sets "
                       f"{' and '.join(what.get(x, x) for x in precond.sets)}, which the "
                       f"{self.axis_name('solve')!r} solve does not read (it reads "
                       f"{', '.join(what.get(x, x) for x in solve.reads)}); compose it with another solve")
    if not isinstance(self.normalize_qk, (bool, np.bool_)):
      raise ValueError(f"{owner}: `normalize_qk` must be a bool, got {self.normalize_qk!r}")
    try:
      given = dict(self.options)
    except (TypeError, ValueError):
      raise ValueError(f"{owner}: `options` must be (name, value) pairs, got {self.options!r}") from None
    defaults = self._defaults(owner)
    unknown = set(given) - set(defaults) - {"solve"}
    if unknown:
      axes = ", ".join(f"{kind} {self.axis_name(kind)!r}" for kind in AXES)
      raise ValueError(f"{owner}: unknown options {sorted(unknown)} for its axes ({axes}); known: "
                       f"{sorted(defaults)}")
    # `solve` is an axis; as an option (a round trip of `opts`) it may only repeat the point's own.
    if given.get("solve", self.axis_name("solve")) != self.axis_name("solve"):
      raise ValueError(f"{owner}: `solve` is the point's axis ({self.axis_name('solve')!r}), not an option; got "
                       f"solve={given['solve']!r} (compose the point with dgps.compose(solve=...))")
    for kind in _OPTIONED:
      self.axis(kind).check(owner, dict(defaults, **given))

  def _defaults(self, owner: str) -> dict:
    """The options of every axis with their defaults; a name declared by two axes is a ValueError."""
    out, by = {}, {}
    for kind in _OPTIONED:
      for name, value in self.axis(kind).defaults.items():
        if name in out:
          raise ValueError(f"{owner}: option {name!r} is declared by both the {by[name]} and the {kind} axis")
        out[name], by[name] = value, kind
    return out

  def _solve_options(self) -> dict:
    """The solve's own options (its `defaults`, overridden by the point's), for its run and step."""
    solve, opts = self.axis("solve"), self.opts
    return {name: opts[name] for name in solve.defaults}

  def axis(self, kind: str) -> Axis | Solve:
    """The value of axis `kind` ("decay", "gain", "precond", "solve") as an object."""
    value = getattr(self, kind)
    return AXES[kind][value] if isinstance(value, str) else value

  def axis_name(self, kind: str) -> str:
    """The value of axis `kind` by name: its registered name, or "custom <kind>" for an unregistered object."""
    value = getattr(self, kind)
    if isinstance(value, str):
      return value
    return next((name for name, v in AXES[kind].items() if v is value), f"custom {kind}")

  def _axis(self, which: str) -> Axis:
    return self.axis(which)

  @property
  def online(self) -> bool:
    """Whether the solve writes with the write key (the delta rule) rather than reading with a query."""
    return "k_write" in self.axis("solve").reads

  @property
  def channel_decay(self) -> bool:
    """Whether the decay is per key channel (a feature or parameter over K)."""
    d = self.axis("decay")
    return any("K" in f.shape for f in d.features.values()) or any("K" in p for p in d.params.values())

  def check_inputs(self, q, v, features, params, *, per_token: bool = False) -> None:
    """ValueError unless `features` and `params` hold exactly the point's names ({axis: {name: array}}), each
    floating with exactly the shape `feature_shapes` (led by q's [B, T]) and `init_params` give at the sizes of
    q [B, T, H, K] and v [B, T, HV, V] (per_token: q [B, H, K], v [B, HV, V], features led by [B])."""
    owner = f"DGPS point {self.name!r}"
    lead_sym = "[B, " if per_token else "[B, T, "
    rank = 3 if per_token else 4
    for name, x, layout in (("q", q, lead_sym + "H, K]"), ("v", v, lead_sym + "HV, V]")):
      if np.ndim(x) != rank:
        raise ValueError(f"{owner}: `{name}` must be {layout}, got shape {np.shape(x)}")
    sizes = {"H": np.shape(q)[-2], "K": np.shape(q)[-1], "HV": np.shape(v)[-2]}
    lead = tuple(np.shape(q)[:-2])
    wanted_f = {w: {n: (lead, f.shape) for n, f in fs.items()} for w, fs in self.features().items()}
    wanted_p = {w: {n: ((), shape) for n, shape in self._axis(w).params.items()} for w in wanted_f}
    _check_tree(owner, "feature", features, wanted_f, sizes, lead_sym)
    _check_tree(owner, "parameter", params, wanted_p, sizes, "[")

  def check_state(self, state, q, v, *, segment_ids=None, step: bool = False) -> dict:
    """`state` as a dict, checked against q [B, (T,) H, K] and v [B, (T,) HV, V]: None or a mapping (step: one
    holding "S"), whose "precond" is None (step: required for a stateful preconditioner) or the preconditioner's
    state, of `initial_state`'s shape: [B, H, K] for PDN/ATQ, [B, HV, K] for OSDN, [B, HV, K, K] for MesaNet (rows N
    when packed: state["S"]'s leading axis, else counted from concrete ids), and None for the stateless
    preconditioners."""
    owner = f"DGPS point {self.name!r}"
    if state is None and not step:
      return {}
    if not isinstance(state, Mapping):
      raise ValueError(f"{owner}: `state` must be a mapping {{'S': ..., 'precond': ...}} (`Point.initial_state`), "
                       f"got {type(state).__name__}")
    b, h, kd, hv = np.shape(q)[0], np.shape(q)[-2], np.shape(q)[-1], np.shape(v)[-2]
    if step and state.get("S") is None:
      raise ValueError(f"{owner}: `state` must hold \"S\", the solve's state [B, HV, K, V] = "
                       f"{(b, hv, kd, np.shape(v)[-1])} (`Point.initial_state`), got keys {sorted(state)}")
    p = state.get("precond")
    if not self.stateful_precond:
      if p is not None:
        raise ValueError(f"{owner}: `state[\"precond\"]` must be None (precond {self.axis_name('precond')!r} "
                         "carries no state), "
                         f"got shape {np.shape(p)}")
      return dict(state)
    rows, lead = b, "B"
    if segment_ids is not None:
      S = state.get("S")
      rows, lead = (np.shape(S)[0] if S is not None and np.ndim(S) else
                    precond_fns.num_segments(segment_ids, None)), "N"
    st = self.axis("precond").state
    want = st.shape(rows, h if st.heads == "H" else hv, kd)
    layout = st.layout(lead)
    if p is None:
      if step:
        raise ValueError(f"{owner}: `state[\"precond\"]` must be the preconditioner's state {layout} = "
                         f"{want} (`Point.initial_state`), got None")
      return dict(state)
    shape = tuple(np.shape(p))
    if len(shape) != len(want) or shape[1:] != want[1:] or (rows is not None and shape[0] != rows):
      raise ValueError(f"{owner}: `state[\"precond\"]` must be the preconditioner's state of shape {layout} = "
                       f"{want}, got shape {shape}")
    if not jnp.issubdtype(jnp.result_type(p), jnp.floating):
      raise ValueError(f"{owner}: `state[\"precond\"]` must be a floating array, got dtype {jnp.result_type(p)}")
    return dict(state)

  @property
  def opts(self) -> dict:
    """Every axis's options (defaults, then the point's), the derived ones, and "solve": the solve's name."""
    o = {**self._defaults(f"DGPS point {self.name!r}"), **dict(self.options), "solve": self.axis_name("solve")}
    for kind in _APPLIED:
      if self.axis(kind).derive is not None:
        o = self.axis(kind).derive(o)
    return o

  @property
  def stateful_precond(self) -> bool:
    return self.axis("precond").state is not None

  def features(self) -> dict[str, dict[str, Feature]]:
    """{axis: {name: Feature}}, each bias resolved (a bias given as a function of the options is evaluated)."""
    o = self.opts
    resolve = lambda f: dataclasses.replace(f, bias=f.bias(o)) if callable(f.bias) else f
    return {w: {n: resolve(f) for n, f in self.axis(w).features.items()} for w in _APPLIED}

  def feature_shapes(self, dims: Dims) -> dict[str, dict[str, tuple[int, ...]]]:
    return {w: {n: f.resolve(dims) for n, f in fs.items()} for w, fs in self.features().items()}

  def init_params(self, key, dims: Dims) -> dict[str, dict]:
    keys = jax.random.split(key, 3)
    return {w: dict(self._axis(w).init(kk, dims, self.opts)) for w, kk in zip(("decay", "gain", "precond"), keys)}

  def initial_state(self, batch: int, dims: Dims, dtype=jnp.float32) -> dict:
    """The state a fresh sequence starts from: {"S": zeros [B, HV, K, V], "precond": zeros [B, H, K] for the
    second-moment preconditioners, d_init [B, HV, K] for OSDN, zeros [B, HV, K, K] for MesaNet, None for the
    stateless ones}."""
    S = jnp.zeros((batch, dims.value_heads, dims.key_dim, dims.value_dim), dtype)
    st = self.axis("precond").state
    if st is None:
      return {"S": S, "precond": None}
    heads = dims.heads if st.heads == "H" else dims.value_heads
    return {"S": S, "precond": jnp.full(st.shape(batch, heads, dims.key_dim), st.init(self.opts), dtype)}

  def prepare(self, q, k, v, features, params, *, precond_state=None, implementation="auto",
              segment_ids=None) -> dict:
    """Applies the D, G and P axes: returns the solve's inputs (q, k, v, beta, k_write, q_tilde, log_decay)
    and the preconditioner's final state under "precond_state". `implementation` runs the preconditioner's pass
    ("reference": its token-serial form)."""
    self.check_inputs(q, v, features, params)
    features, params = features or {}, params or {}
    if self.normalize_qk:
      q, k = _l2norm(q), _l2norm(k)
    ctx = lambda w, **kw: Context(q, k, v, features.get(w, {}), params.get(w, {}), self.opts,
                                  implementation=implementation, segment_ids=segment_ids,
                                  reads=self.axis("solve").reads, **kw)
    log_decay = self.axis("decay").apply(ctx("decay"))
    beta = self.axis("gain").apply(ctx("gain"))
    written, p_state = self.axis("precond").apply(ctx("precond", beta=beta, log_decay=log_decay,
                                                      state=precond_state))
    reads = self.axis("solve").reads
    if set(written) - set(reads):
      raise ValueError(f"DGPS point {self.name!r}: precond {self.axis_name('precond')!r} returned "
                       f"{sorted(written)}, but the {self.axis_name('solve')!r} solve reads only {list(reads)}")
    self._check_returned_state(p_state, q, v, precond_state, segment_ids)
    # Named for the rematerialisation policies that keep the preconditioner's pass (`models.config`).
    written = {n: checkpoint_name(x, "precond_pass") for n, x in written.items()}
    p_state = None if p_state is None else checkpoint_name(p_state, "precond_pass")
    return dict(q=q, k=k, v=v, beta=beta, log_decay=log_decay, k_write=written.get("k_write"),
                q_tilde=written.get("q_tilde"), precond_state=p_state)

  def _check_returned_state(self, p_state, q, v, entering, segment_ids) -> None:
    """The preconditioner's final state against its `state` declaration: None for a value that declares none;
    for a stateful one [rows, heads, K] with rows the entering state's, else B (one per row), else N counted
    from concrete `segment_ids` (one per segment). Where N is unknown (traced ids and no entering state) the
    value may return None, as the built-in passes do, and the rows are not checked."""
    owner = f"DGPS point {self.name!r}: precond {self.axis_name('precond')!r}"
    st = self.axis("precond").state
    if st is None:
      if p_state is not None:
        raise ValueError(f"{owner} returned a state but declares none (its `state` is None): declare it with "
                         "dgps.State(heads, init, carry) so that it is carried, or return None")
      return
    if entering is not None:
      rows = np.shape(entering)[0]
    elif segment_ids is None:
      rows = np.shape(q)[0]
    else:
      rows = precond_fns.num_segments(segment_ids, None)
    g = np.shape(q)[2] if st.heads == "H" else np.shape(v)[2]
    layout = st.layout("B" if segment_ids is None else "N")
    want = st.shape(rows, g, np.shape(q)[3])
    if p_state is None:
      if rows is None:
        return
      raise ValueError(f"{owner} declares a state {layout} = {want} but returned None; "
                       "`apply` returns (its outputs, the state after the last token)")
    shape = tuple(np.shape(p_state))
    if len(shape) != len(want) or shape[1:] != want[1:] or (rows is not None and shape[0] != rows):
      packed = "" if segment_ids is None else " (one per packed segment: `apply` receives `segment_ids`)"
      raise ValueError(f"{owner} returned a state of shape {shape}, but its declaration (`State.heads` "
                       f"{st.heads!r}) makes it {layout} = {want}{packed}")

  def __call__(self, q, k, v, features, params, *, state=None, output_final_state=False, scale=None,
               chunk_size=64, segment_ids=None, implementation="auto", context=None):
    """Runs the point. state: None or {"S": [B, HV, K, V], "precond": [B, G, K] or None}.

    Returns (o [B, T, HV, V], {"S": ..., "precond": ...} or None). `implementation` (one of
    `ops.dispatch.IMPLEMENTATIONS`; "naive" is an alias of "reference") runs the preconditioner's pass and the
    solve: "reference" runs every axis token-serially (the point's own reference composition); "pallas",
    "pallas-gpu" and "pallas-tpu" need a kernel of that platform for each. With segment_ids [B, T]
    every state restarts at each segment start and the states are per segment ([N, ...] instead of [B, ...]).

    context: None, or the name of a mesh axis that splits T, inside `jax.shard_map` (context parallelism,
    `osdn_jax.ops.context`): the per-token arrays (and segment_ids) are this shard's tokens, `state` and the
    returned final states are the whole rows' (packed: pass state["S"] [N, ...] so that N is static). The
    solve's state and the PDN/ATQ second moment pass between the shards as affine maps, OSDN's d as a ring
    (`ops.context`).
    """
    self.check_inputs(q, v, features, params)
    state = self.check_state(state, q, v, segment_ids=segment_ids)
    if context is not None:
      return self._context_call(q, k, v, features, params, state, output_final_state, scale, chunk_size,
                                segment_ids, implementation, context)
    x = self.prepare(q, k, v, features, params, precond_state=state.get("precond"),
                     implementation=implementation, segment_ids=segment_ids)
    o, S = self.axis("solve").run(x["q"], x["k"], x["v"], x["beta"], k_write=x["k_write"],
                           q_tilde=x["q_tilde"], log_decay=x["log_decay"], initial_state=state.get("S"),
                           output_final_state=output_final_state, scale=scale, chunk_size=chunk_size,
                           segment_ids=segment_ids, implementation=implementation, **self._solve_options())
    return o, ({"S": S, "precond": x["precond_state"]} if output_final_state else None)

  def _context_call(self, q, k, v, features, params, state, output_final_state, scale, chunk_size, segment_ids,
                    implementation, context):
    for kind in _APPLIED:
      if not self.axis(kind).context_parallel:
        raise ValueError(f"DGPS point {self.name!r}: {kind} {self.axis_name(kind)!r} does not run "
                         "context-parallel (its `context_parallel` is False)")
    st = self.axis("precond").state
    if st is not None and st.carry is None:
      raise ValueError(f"DGPS point {self.name!r}: precond {self.axis_name('precond')!r} carries a state without "
                       "a carry rule (`State.carry`), so it cannot run context-parallel")
    b = v.shape[0]
    whole = state.get("S"), state.get("precond")
    n = b if segment_ids is None else next((s.shape[0] for s in whole if s is not None), None)
    p_init = p_whole = None
    if self.stateful_precond:
      self.check_inputs(q, v, features, params)
      dims = Dims(q.shape[2], v.shape[2], q.shape[3], v.shape[3])
      ct = jnp.promote_types(jnp.float32, q.dtype)
      sh = context_ops.shards(context, b, segment_ids, n)
      p_whole = self.initial_state(n, dims, ct)["precond"] if whole[1] is None else whole[1]
      run = lambda init: self.prepare(q, k, v, features, params, precond_state=init,
                                      implementation=implementation, segment_ids=segment_ids)["precond_state"]
      carry = context_ops.carry_diagonal if st.carry == "diagonal" else context_ops.carry
      p_init = carry(run, p_whole, sh)
    x = self.prepare(q, k, v, features, params, precond_state=p_init, implementation=implementation,
                     segment_ids=segment_ids)
    o, S = self.axis("solve").run(x["q"], x["k"], x["v"], x["beta"], k_write=x["k_write"],
                           q_tilde=x["q_tilde"], log_decay=x["log_decay"], initial_state=whole[0],
                           output_final_state=output_final_state, scale=scale, chunk_size=chunk_size,
                           segment_ids=segment_ids, implementation=implementation, context=context,
                           **self._solve_options())
    if not output_final_state:
      return o, None
    p_final = None if p_init is None else context_ops.whole_finals(x["precond_state"], p_whole, sh)
    return o, {"S": S, "precond": p_final}

  def step(self, q, k, v, features, params, state, *, scale=None):
    """One token for decoding: q, k [B, H, K], v [B, HV, V], features per token without T; state as in
    __call__ (required). Returns (o [B, HV, V], new state)."""
    self.check_inputs(q, v, features, params, per_token=True)
    state = self.check_state(state, q, v, step=True)
    add_t = lambda x: x[:, None]
    x = self.prepare(add_t(q), add_t(k), add_t(v), jax.tree.map(add_t, features or {}), params,
                     precond_state=state.get("precond"))
    drop_t = lambda a: None if a is None else a[:, 0]
    o, S = self.axis("solve").step(drop_t(x["q"]), drop_t(x["k"]), drop_t(x["v"]), drop_t(x["beta"]),
                          state["S"], k_write=drop_t(x["k_write"]), q_tilde=drop_t(x["q_tilde"]),
                          log_decay=drop_t(x["log_decay"]), scale=scale, **self._solve_options())
    return o, {"S": S, "precond": x["precond_state"]}


def _check_tree(owner: str, kind: str, tree, wanted, sizes, lead_sym: str) -> None:
  """`tree` {axis: {name: array}} against wanted {axis: {name: (leading shape, symbols)}}: every wanted name present
  with its shape and a floating dtype. Other names are ignored, so that one set of inputs (e.g. a richer point's
  features) can feed several points."""
  layout = lambda sym: lead_sym + ", ".join(sym) + "]"
  expected = ", ".join(f"{w}.{n} {layout(sym)}" for w, fs in wanted.items() for n, (_, sym) in fs.items()) or "none"
  tree = {} if tree is None else tree
  if not isinstance(tree, Mapping) or not all(isinstance(t, Mapping) for t in tree.values()):
    raise ValueError(f"{owner}: the {kind}s must be a mapping {{axis: {{name: array}}}}; expected {expected}")
  for w, fs in wanted.items():
    for n, (lead, sym) in fs.items():
      if n not in tree.get(w, {}):
        raise ValueError(f"{owner}: missing {kind} `{w}.{n}`; the point takes {kind}s {expected}")
      x = tree[w][n]
      want = tuple(lead) + _resolve(sym, sizes)
      if tuple(np.shape(x)) != want:
        raise ValueError(f"{owner}: {kind} `{w}.{n}` must have shape {layout(sym)} = {want}, got {np.shape(x)}")
      if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{owner}: {kind} `{w}.{n}` must be a floating array, got dtype {jnp.result_type(x)}")


_DN = "DeltaNet (Yang et al., NeurIPS 2024, 'Parallelizing Linear Transformers with the Delta Rule')"
_GDN = "Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025)"
_KDA = "Kimi Delta Attention (Kimi Linear, Moonshot AI, 2025)"
_PDN = "Preconditioned DeltaNet (arXiv 2604.21100): diagonal second-moment preconditioner on the write key"
_OSDN = "Online Scaled DeltaNet (arXiv 2605.13473): write scale learned online by hypergradient descent"
_APF = _OSDN[:-1] + ", with adaptive preconditioner forgetting (APF)"
_MESANET = ("MesaNet (von Oswald et al., 2025, 'MesaNet: Sequence Modeling by Locally Optimal Test-Time Training'): "
            "linear attention read with (H_t + Λ)⁻¹ q_t, solved by conjugate gradients")
_ATQ = "apply-to-query preconditioned form (arXiv 2604.21100, Theorem 3.1's diagonal approximation)"

POINTS = {p.name: p for p in [
    Point("dn", "none", "sigmoid", "identity", "online", doc=_DN),
    Point("gdn", "scalar", "sigmoid", "identity", "online", doc=_GDN),
    Point("kda", "channel", "sigmoid", "identity", "online", doc=_KDA),
    Point("pdn", "none", "sigmoid", "pdn", "online", doc=_PDN + "; backbone " + _DN),
    Point("pgdn", "scalar", "sigmoid", "pdn", "online", doc=_PDN + "; backbone " + _GDN),
    Point("pkda", "channel", "sigmoid", "pdn", "online", doc=_PDN + "; backbone " + _KDA),
    Point("osdn", "none", "sigmoid", "osdn", "online", doc=_OSDN + "; backbone " + _DN),
    Point("osdn-gdn", "scalar", "sigmoid", "osdn", "online", doc=_OSDN + "; backbone " + _GDN),
    Point("osdn-kda", "channel", "sigmoid", "osdn", "online", doc=_OSDN + "; backbone " + _KDA),
    Point("osdn-apf", "none", "sigmoid", "osdn-apf", "online", doc=_APF + "; backbone " + _DN),
    Point("osdn-apf-gdn", "scalar", "sigmoid", "osdn-apf", "online", doc=_APF + "; backbone " + _GDN),
    Point("osdn-apf-kda", "channel", "sigmoid", "osdn-apf", "online", doc=_APF + "; backbone " + _KDA),
    Point("dn-fixed-d", "none", "sigmoid", "fixed", "online",
          doc="Control for OSDN (this project): DeltaNet writing with a learned constant per-channel scale d "
              "(guarded like OSDN), so gains can be credited to the online hypergradient"),
    Point("la", "none", "one", "identity", "offline", doc="Linear attention (Katharopoulos et al., ICML 2020)"),
    Point("retnet", "constant", "one", "identity", "offline", doc="RetNet (Sun et al., 2023): fixed decays"),
    Point("mamba2", "scalar", "one", "identity", "offline", doc="Mamba-2 / SSD (Dao & Gu, ICML 2024)"),
    Point("gla", "channel", "one", "identity", "offline", doc="Gated Linear Attention (Yang et al., ICML 2024)"),
    Point("pla", "none", "one", "atq", "offline", doc="Preconditioned linear attention: " + _ATQ),
    Point("pmamba2", "scalar", "one", "atq", "offline", doc="Preconditioned Mamba-2: " + _ATQ),
    Point("pgla", "channel", "one", "atq", "offline", doc="Preconditioned GLA: " + _ATQ),
    Point("mesa", "sigmoid", "sigmoid", "mesa", "offline", doc=_MESANET),
    Point("longhorn", "none", "longhorn", "identity", "online", normalize_qk=False,
          doc="Longhorn (Liu et al., 2024): the implicit online-regression step β/(1 + β‖k‖²), raw keys"),
    Point("nlms", "none", "nlms", "identity", "online", normalize_qk=False,
          doc="Normalised LMS (Widrow–Hoff): β = σ(b)/(‖k‖² + ε), raw keys"),
]}


_BUILTIN = frozenset(POINTS)


def names() -> list[str]:
  return list(POINTS)


def get(name: str, **options) -> Point:
  """The named point (docs/design.md §1's table), with its preconditioner options overridden by `options`.
  ValueError unless `name` is a registered name (a str, any case)."""
  if not isinstance(name, str):
    raise ValueError(f"dgps.get: `name` must be a registry name (a str), got {name!r}; known: {', '.join(POINTS)}")
  key = name.lower()
  if key not in POINTS:
    raise ValueError(f"dgps.get: unknown point {name!r}; known: {', '.join(POINTS)}")
  p = POINTS[key]
  return dataclasses.replace(p, options=tuple(sorted(dict(p.options, **options).items()))) if options else p


def register(point: Point, *, replace: bool = False) -> Point:
  """Adds `point` to the registry under its name (lower-cased), so that every consumer of registry names (model
  configs "<name>-<size>", the trainer, the experiments' variant lists) can use it, e.g.
  register(compose(decay="scalar", precond="osdn-apf", name="my-point")). ValueError if the name is taken
  (unless replace=True, which cannot replace a built-in point) or not a plain identifier-like string."""
  if not isinstance(point, Point):
    raise ValueError(f"dgps.register: `point` must be a dgps.Point, got {type(point).__name__}")
  key = point.name.lower()
  if not key or not all(ch.isalnum() or ch in "-_." for ch in key):
    raise ValueError(f"dgps.register: the point's name must be letters, digits, '-', '_' or '.', got {point.name!r}")
  if key in POINTS and (not replace or key in _BUILTIN):
    raise ValueError(f"dgps.register: a point named {key!r} is already registered"
                     + ("" if key in _BUILTIN else " (pass replace=True to replace it)"))
  POINTS[key] = dataclasses.replace(point, name=key)
  return POINTS[key]


def compose(*, decay="none", gain="sigmoid", precond="identity", solve="online", normalize_qk=True, name=None,
            **options) -> Point:
  """A point from a value per axis, each a registered name or an `Axis` (`Solve`) object, e.g.
  compose(decay="channel", precond="osdn-apf", apf_anchor="init") or compose(precond=my_axis, my_option=2.0);
  `options` are any axis's. Register it (`register`) to name it in configs and on the command line."""
  named = lambda kind, v: v if isinstance(v, str) else next(
      (n for n, x in AXES.get(kind, {}).items() if x is v), f"custom-{kind}")
  name = name or "/".join(named(k, v) for k, v in (("decay", decay), ("gain", gain), ("precond", precond),
                                                   ("solve", solve)))
  return Point(name, decay, gain, precond, solve, normalize_qk, tuple(sorted(options.items())),
               doc="composed from axis values")


def register_axis(kind: str, name: str, value: Axis | Solve, *, replace: bool = False) -> Axis | Solve:
  """Adds `value` to axis `kind` ("decay", "gain", "precond" or "solve") under `name`, so points name it like a
  built-in one (compose(precond=name), configs). ValueError for another kind, a value that is not a dgps.Axis
  (dgps.Solve for the solve axis), a name that is taken (unless replace=True, which cannot replace a built-in
  value) or not letters, digits, '-', '_', '.'."""
  if kind not in AXES:
    raise ValueError(f"dgps.register_axis: `kind` must be one of {', '.join(AXES)}, got {kind!r}")
  want = Solve if kind == "solve" else Axis
  if not isinstance(value, want):
    raise ValueError(f"dgps.register_axis: `value` must be a dgps.{want.__name__} for the {kind} axis, got "
                     f"{type(value).__name__}")
  if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "-_." for ch in name):
    raise ValueError(f"dgps.register_axis: `name` must be letters, digits, '-', '_' or '.', got {name!r}")
  if name in AXES[kind] and (not replace or name in _BUILTIN_AXES[kind]):
    raise ValueError(f"dgps.register_axis: the {kind} axis already has a value named {name!r}"
                     + ("" if name in _BUILTIN_AXES[kind] else " (pass replace=True to replace it)"))
  AXES[kind][name] = value
  return value
