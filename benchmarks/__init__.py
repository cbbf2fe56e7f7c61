"""Benchmarks and accuracy checks of the solves, the preconditioners' first passes and their kernels.

`python -m benchmarks.run` (run.py) measures the ops of `registry.py` at its shapes, per implementation and
kernel-config variant, with the one timing method of `timing.py`; `trace.py` reads per-kernel device times out of
a profiler trace, `census.py` counts what the Pallas kernels do without running them, and `fla.py` times FLA
(torch) on the same inputs when it is installed. Nothing in the library imports this package.
"""
