"""FLA (flash-linear-attention, torch + Triton) on the same inputs as ours: an optional, benchmark-only comparison.

Imported only when the runner asks for FLA; the library never imports torch. The inputs are the registry's host
arrays: q, k, v in the benchmark dtype (rounded by torch as JAX rounds them), gates fp32, on "cuda"; PDN's center
is −0.2 per head (`registry.CENTER`). FLA is timed as ours (`timing.torch_ms`: back-to-back calls, one
`torch.cuda.synchronize`) and also with `triton.testing.do_bench` (median) as a check; peak memory is
`torch.cuda.max_memory_allocated` over one call beyond what was allocated before it.
"""
from __future__ import annotations

import importlib

from benchmarks import registry, timing

WIDE = ("q", "k", "v")


def unavailable() -> str | None:
  """None when torch, a CUDA device and `fla.ops` are there, else why not."""
  try:
    import torch
    importlib.import_module("fla.ops")
  except Exception as e:  # noqa: BLE001 — FLA is optional: any import failure means "not available"
    return f"{type(e).__name__}: {e}"
  if not torch.cuda.is_available():
    return "torch sees no CUDA device"
  return None


def _dtype(name: str):
  import torch
  return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def call(op: str, x: dict, *, dtype: str = "bf16", requires_grad: bool = False):
  """(run, tensors): run() → FLA's o [B, T, H, V] for the registry op `op` on inputs `x` (host numpy)."""
  import torch
  from fla.ops.delta_rule import chunk_delta_rule
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule
  from fla.ops.kda import chunk_kda
  from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
  from fla.ops.precond_kda import chunk_precond_kda
  dev = "cuda"
  t = {n: torch.tensor(a, device=dev, dtype=_dtype(dtype) if n in WIDE else torch.float32)
       .requires_grad_(requires_grad) for n, a in x.items()}
  center = torch.full((x["q"].shape[2],), registry.CENTER, device=dev)

  def run():
    if op == "dn":
      return chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"])[0]
    if op == "gdn":
      return chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])[0]
    if op == "kda":
      return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"])[0]
    if op in ("pdn", "pgdn"):
      g = t["g"] if op == "pgdn" else torch.zeros_like(t["beta"])
      return chunk_precond_gated_delta_rule(t["q"], t["k"], t["v"], t["g_p"], g, t["beta_p"], t["beta"],
                                            log_atk_scale=center)[0]
    if op == "pkda":
      return chunk_precond_kda(t["q"], t["k"], t["v"], t["g"], t["g_p"], t["beta_p"], t["beta"],
                               log_atk_scale=center)[0]
    raise KeyError(f"FLA has no op for {op!r}")
  return run, t


def measure(op: str, x: dict, mode: str, do, *, dtype: str = "bf16", calls: int = 20, reps: int = 7,
            warmup: int = 2) -> dict:
  """{ms, do_bench_ms, peak_bytes, out}: FLA's forward ("fwd") or forward + backward of every input ("fwdbwd",
  cotangent `do` [B, T, H, V] on o); out: the forward's o as fp32 numpy (fwd only, else None)."""
  import torch
  import triton
  run, _ = call(op, x, dtype=dtype, requires_grad=mode == "fwdbwd")
  do_t = torch.tensor(do, device="cuda", dtype=_dtype(dtype))
  if mode == "fwd":
    fn = run
  else:
    def fn():
      run().backward(do_t)
  torch.cuda.synchronize()
  fn()
  torch.cuda.synchronize()
  base = torch.cuda.memory_allocated()
  torch.cuda.reset_peak_memory_stats()
  fn()
  torch.cuda.synchronize()
  peak = torch.cuda.max_memory_allocated() - base
  ms = timing.torch_ms(fn, n=calls, reps=reps, warmup=warmup)
  bench = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
  with torch.no_grad():
    out = run().float().cpu().numpy() if mode == "fwd" else None
  return dict(ms=ms, do_bench_ms=float(bench), peak_bytes=int(peak), out=out)
