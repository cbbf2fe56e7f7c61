import subprocess
import sys

HEAVY = ("flax", "optax", "grain", "orbax", "absl", "chex", "torch", "hypothesis", "pallas_kernels")


def test_ops_import_only_jax_and_numpy():
  code = ("import sys, osdn_jax.ops, osdn_jax.diagnostics; "
          f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == "[]", out
