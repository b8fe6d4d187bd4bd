# Entry points (see README): `make demo` and `make test`; `make typecheck`, `make docs` and
# `make package-check` are what CI runs besides the tests.
# Every target creates .venv on first use and installs the package with the pinned
# constraints (CPU torch, no CUDA downloads). An install reruns only when
# pyproject.toml or constraints.txt change (stamp files .venv/.installed*).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEV_STAMP  := $(VENV)/.installed-dev
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: demo test bench lint typecheck docs docs-serve package-check install clean

demo: $(STAMP)
	$(PY) examples/train_tiny_lm.py

test: $(STAMP)
	$(PY) -m pytest -q

# Every benchmark, side by side with torch, torchopt and optax; rewrites docs/benchmarks.md and its chart.
bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/run.py --wait-quiet 180
	$(PY) benchmarks/overhead.py --out docs/benchmarks.md  # after run.py, which rewrites that file
	$(PY) benchmarks/norm.py --dist --out docs/benchmarks-norm.md  # on CUDA when present

lint: $(DEV_STAMP)
	$(PY) -m ruff check gradtx tests examples tools

# mypy over gradtx/ ([tool.mypy] in pyproject.toml).
typecheck: $(DEV_STAMP)
	$(PY) -m mypy

# The docs site (mkdocs.yml) into site/; --strict turns every warning (a broken link, a bad docstring) into an error.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The docs site at http://127.0.0.1:8000, rebuilt on every save.
docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# A wheel built from this checkout installs into a clean venv (pinned CPU torch), and a user
# script type-checks against the installed package (tests/test_packaging.py).
package-check: $(DEV_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m packaging tests/test_packaging.py

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torchtitan goes in without its dependencies (its pins would replace the CPU torch); the test extra has
# the two its optimizer and checkpoint modules import.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -c constraints.txt -e ".[test,examples]"
	$(PY) -m pip install -c constraints.txt --no-deps torchtitan==0.3.0
	touch $@

# The dev and docs extras go on top of $(STAMP) as their own requirements, read from pyproject.toml: pip
# neither rebuilds the editable install nor re-resolves the test extra's stack (jax, lightning, ...) each time.
PIP_EXTRA = $(PY) -c 'import subprocess, sys, tomllib; \
	reqs = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]; \
	sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", "-c", "constraints.txt", *reqs]))'

$(DEV_STAMP): $(STAMP)
	$(PIP_EXTRA) dev
	touch $@

$(DOCS_STAMP): $(STAMP)
	$(PIP_EXTRA) docs
	touch $@

clean:
	rm -rf $(VENV) out build dist site *.egg-info .pytest_cache .hypothesis .mypy_cache
