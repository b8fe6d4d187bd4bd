# Two entry points (see README): `make demo` and `make test`.
# Both create .venv on first use and install the package with the pinned
# constraints (CPU torch, no CUDA downloads). The install reruns only when
# pyproject.toml or constraints.txt change (stamp file .venv/.installed).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench lint install clean

demo: $(STAMP)
	$(PY) examples/train_tiny_lm.py

test: $(STAMP)
	$(PY) -m pytest -q

# Every benchmark, side by side with torch, torchopt and optax; rewrites docs/benchmarks.md and its chart.
bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/run.py --wait-quiet 180

lint: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m ruff check gradtx tests examples

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -c constraints.txt -e ".[test,examples]"
	touch $@

clean:
	rm -rf $(VENV) out build dist *.egg-info .pytest_cache .hypothesis
