# hf_zero3 — `make help` lists the targets. Everything runs inside .venv (created by `make setup`).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU-only machine takes the CPU wheel; on a GPU box use the torch you have (TORCH="").
TORCH ?= torch==2.13.0
NUM_GPUS ?= 2
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup demo test test-unit test-integration configs check-configs clean

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  %-20s %s\n", $$1, $$2}'

$(BIN)/.installed: setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	[ -z "$(TORCH)" ] || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed ## create .venv and install hf_zero3 with its dependencies (once)

demo: setup ## train the tiny recipe with ZeRO-3 on 2 ranks (CPU is fine); prints where checkpoint and logs are
	source $(BIN)/activate && NUM_GPUS=$(NUM_GPUS) recipes/tiny/launch.sh --output_dir outputs/tiny-$$(date +%Y%m%d-%H%M%S)

test: setup ## run all tests (unit + real 2-rank DeepSpeed runs on CPU; GPU tests skip without CUDA)
	source $(BIN)/activate && python -m pytest tests $(PYTEST_ARGS)

test-unit: setup ## fast tests only
	source $(BIN)/activate && python -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup ## real multi-rank runs only
	source $(BIN)/activate && python -m pytest tests/integration $(PYTEST_ARGS)

configs: setup ## regenerate every committed ds_config (ds_configs/, recipes/*/ds_config.json)
	$(BIN)/hf-zero3 configs

check-configs: setup ## fail if a committed ds_config differs from the generator
	$(BIN)/hf-zero3 configs --check

clean: ## remove outputs/ and caches (not .venv)
	rm -rf outputs .pytest_cache
