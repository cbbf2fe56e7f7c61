"""Imports run one way (experiments → training → models → layers → dgps/diagnostics → ops → kernels) and stay
light: the core ops import only jax and numpy (and the kernels' standard-library contract module), no kernel
backend; nothing in the kernel package imports the library."""
import ast
import os
import re
import subprocess
import sys

HEAVY = ("flax", "optax", "grain", "orbax", "absl", "chex", "torch", "hypothesis")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ops_import_only_jax_and_numpy():
  code = ("import sys, osdn_jax.ops, osdn_jax.diagnostics, osdn_jax.dgps; "
          f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})), "
          "sorted(m for m in sys.modules if m.startswith(('pallas_kernels.gpu', 'jax.experimental.pallas'))), "
          "sorted(m for m in sys.modules if m.startswith('pallas_kernels')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == "[] [] ['pallas_kernels', 'pallas_kernels.spec']", out


def test_the_package_front_loads_subpackages_on_first_access():
  """`import osdn_jax` alone imports none of its subpackages (so no Flax or Optax); `osdn_jax.ops` and the others
  (`__all__`, each a real module) load on first access (PEP 562); an unknown name is an AttributeError."""
  code = ("import sys, importlib.util, osdn_jax; "
          f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})); "
          "subs = sorted(m for m in sys.modules if m.startswith('osdn_jax.')); "
          "fn = osdn_jax.ops.delta_rule; "
          "print(heavy, subs, fn is sys.modules['osdn_jax.ops'].delta_rule, "
          "all(importlib.util.find_spec('osdn_jax.' + n) for n in osdn_jax.__all__), "
          "set(osdn_jax.__all__) <= set(dir(osdn_jax)), hasattr(osdn_jax, 'no_such_module'), osdn_jax.__version__)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  version = re.search(r'version="([^"]+)"', open(os.path.join(ROOT, "setup.py")).read()).group(1)
  assert out.strip() == f"[] [] True True True False {version}", out


def test_the_test_helpers_import_only_jax_and_numpy():
  """osdn_jax.testing (which experiments/tour.py imports) loads chex, hypothesis and pytest only inside the
  functions that need them."""
  code = ("import sys, osdn_jax.testing; "
          f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY + ('pytest', '_pytest')!r})))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == "[]", out


def _imports(package):
  """(file, imported module) for every import statement under `package`."""
  for folder, _, files in os.walk(os.path.join(ROOT, package)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        for node in ast.walk(ast.parse(open(path).read())):
          if isinstance(node, ast.Import):
            yield from ((path, a.name) for a in node.names)
          elif isinstance(node, ast.ImportFrom) and node.module:
            yield path, node.module


def test_the_kernels_do_not_import_the_library():
  bad = [(os.path.relpath(p, ROOT), m) for p, m in _imports("pallas_kernels") if m.split(".")[0] == "osdn_jax"]
  assert not bad, bad


def test_the_library_reaches_the_kernels_through_their_contract_and_dispatch():
  """Only the request spec and the contract constants are imported from `pallas_kernels` outside the dispatch;
  kernel backends are never imported by the library."""
  allowed = {"pallas_kernels.spec"}
  bad = [(os.path.relpath(p, ROOT), m) for p, m in _imports("osdn_jax")
         if m.startswith("pallas_kernels") and m not in allowed and not p.endswith(os.path.join("ops", "dispatch.py"))]
  assert not bad, bad


def test_the_layers_below_training_do_not_import_it():
  """models, layers, dgps, diagnostics and ops never import the trainer or the data pipeline; the data pipeline
  never imports the models or the trainer."""
  below = [(p, m) for pkg in ("models", "layers", "dgps", "diagnostics", "ops")
           for p, m in _imports(os.path.join("osdn_jax", pkg))]
  bad = [(os.path.relpath(p, ROOT), m) for p, m in below if m.startswith(("osdn_jax.train", "osdn_jax.data"))]
  bad += [(os.path.relpath(p, ROOT), m) for p, m in _imports(os.path.join("osdn_jax", "data"))
          if m.startswith(("osdn_jax.train", "osdn_jax.models", "osdn_jax.layers"))]
  assert not bad, bad


def test_the_second_moment_reference_does_not_import_its_fast_forms():
  """dgps.precond imports dgps.naive (its reference) and both import dgps.moment; naive never imports precond."""
  tree = ast.parse(open(os.path.join(ROOT, "osdn_jax", "dgps", "naive.py")).read())
  names = {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
           for a in n.names}
  names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  assert not any(m == "osdn_jax.dgps.precond" or m.startswith("osdn_jax.dgps.precond.") for m in names), names
