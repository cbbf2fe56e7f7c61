# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum setup.py | cut -d' ' -f1)

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	rm -f $(VENV)/.installed-* && touch $@

demo: install
	$(PY) -m experiments.demo

test: install
	JAX_PLATFORMS=cpu $(PY) -m pytest -n auto -q tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
