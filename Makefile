# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum setup.py | cut -d' ' -f1)

.PHONY: install demo test test-slow clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	rm -f $(VENV)/.installed-* && touch $@

demo: install
	$(PY) -m experiments.demo

# `make test`: the gate (every op, decay, kernel, oracle, mutation, packing and model; covering subsets of the
# cross products; hypothesis at its default counts). `make test-slow`: what it leaves out (the tests marked slow)
# and every hypothesis test again under the "thorough" profile. Both print their 15 slowest tests.
test: install
	JAX_PLATFORMS=cpu $(PY) -m pytest -n auto -q -m "not slow" --durations=15 tests

test-slow: install
	JAX_PLATFORMS=cpu HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -n auto -q -m "slow or hypothesis" --durations=15 tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
