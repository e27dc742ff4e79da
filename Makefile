# hf_zero3 — `make help` lists the targets. Everything runs inside .venv (created by `make setup`).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU-only machine takes the CPU wheel; on a GPU box use the torch you have (TORCH="").
TORCH ?= torch==2.13.0
NUM_GPUS ?= 2
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
# `make bench`: which recipe (8b on 2 GPUs, tiny on CPU) and where the report goes (default
# benchmarks/results/<date>_bench-<recipe>)
RECIPE ?= 8b
BENCH_OUT ?=
# Overrides for train-<size>/plan-<size>, e.g. ARGS="--max_steps 10 --output_dir outputs/try"
ARGS ?=
# What `make sync` copies: the files git tracks or would track (`git ls-files --cached --others --exclude-standard`:
# not outputs, environments or caches), less .deepspeed_env (may hold HF_TOKEN; only the launching node reads it),
# and .git (the doctor compares `git ls-files` content hashes across nodes; in a `git worktree`, .git is a file
# naming the repository's git folder, which goes too, to its same path). It deletes nothing outside the git folder
# on the hosts: a node's own files in the checkout (its checkpoint shards on a node-local disk, say) stay.
SYNC_SKIP := .deepspeed_env

.DEFAULT_GOAL := help
.PHONY: help setup demo test test-unit test-integration bench configs check-configs clean sync

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
	source $(BIN)/activate && python -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-unit: setup ## fast tests only
	source $(BIN)/activate && python -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup ## real multi-rank runs only
	source $(BIN)/activate && python -m pytest tests/integration $(PYTEST_ARGS)

bench: setup ## the standard comparison: RECIPE=8b (2 GPUs) or RECIPE=tiny (CPU) against the stock baselines, report in benchmarks/results/
	source $(BIN)/activate && RECIPE=$(RECIPE) GPUS=$(NUM_GPUS) bash benchmarks/bench.sh $(BENCH_OUT)

configs: setup ## regenerate every committed ds_config (ds_configs/, recipes/*/ds_config.json)
	$(BIN)/hf-zero3 configs

check-configs: setup ## fail if a committed ds_config differs from the generator
	$(BIN)/hf-zero3 configs --check

clean: ## remove caches (not outputs/: it holds your runs and checkpoints; not .venv)
	rm -rf .pytest_cache build dist
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +
	@test ! -d outputs || echo "outputs/ kept: it holds runs and checkpoints; delete what you no longer need yourself"

train-%: setup ## train recipes/<size>, e.g. NUM_NODES=2 NUM_GPUS=4 HOSTFILE=hosts MODEL=/models/llama-70b make train-70b
	@test -x recipes/$*/launch.sh || { echo "error: no recipe recipes/$*/ (recipes: $$(cd recipes && ls -d */ | tr -d / | LC_ALL=C sort | xargs))" >&2; exit 2; }
	source $(BIN)/activate && recipes/$*/launch.sh $(ARGS)

plan-%: setup ## dry run of train-<size> (no GPU needed): command, arguments, batch math, memory plan; same env
	@test -x recipes/$*/launch.sh || { echo "error: no recipe recipes/$*/ (recipes: $$(cd recipes && ls -d */ | tr -d / | LC_ALL=C sort | xargs))" >&2; exit 2; }
	source $(BIN)/activate && DRY_RUN=1 recipes/$*/launch.sh $(ARGS)

sync: setup ## copy this checkout to every host of HOSTFILE=path, same path (rsync over SSH, SSH_PORT/PDSH_SSH_ARGS_APPEND as the launcher); the doctor then compares code
	@test -n "$(HOSTFILE)" || { echo "error: make sync needs HOSTFILE=path (DeepSpeed's hostfile, lines: host slots=N)" >&2; exit 2; }
	@test -f "$(HOSTFILE)" || { echo "error: HOSTFILE=$(HOSTFILE) does not exist" >&2; exit 2; }
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "error: make sync copies the files git tracks: run it in a git checkout (or copy this folder to the same path on every host yourself)" >&2; exit 2; }
	@hosts=$$(sed -e 's/#.*//' "$(HOSTFILE)" | awk 'NF {print $$1}'); \
	test -n "$$hosts" || { echo "error: $(HOSTFILE) lists no hosts" >&2; exit 2; }; \
	rsh=$$(echo ssh $${SSH_PORT:+-p $$SSH_PORT} $${PDSH_SSH_ARGS_APPEND:-}); \
	for host in $$hosts; do \
	  echo "sync $(CURDIR)/ -> $$host:$(CURDIR)/"; \
	  git ls-files -z --cached --others --exclude-standard | grep -zvxF '$(SYNC_SKIP)' | \
	    rsync -az --from0 --files-from=- --ignore-missing-args -e "$$rsh" ./ "$$host:$(CURDIR)/" || exit 1; \
	  if [ -d .git ]; then rsync -az --delete -e "$$rsh" .git/ "$$host:$(CURDIR)/.git/" || exit 1; \
	  else common=$$(cd "$$(git rev-parse --git-common-dir)" && pwd); \
	    rsync -az -e "$$rsh" .git "$$host:$(CURDIR)/.git" || exit 1; \
	    rsync -az --mkpath --delete -e "$$rsh" "$$common/" "$$host:$$common/" || exit 1; \
	  fi; \
	done
	source $(BIN)/activate && hf-zero3 doctor --hostfile "$(HOSTFILE)" --skip versions --skip native --skip gpus \
	  --skip ops --skip nvme --skip allreduce $${SSH_PORT:+--ssh-port $$SSH_PORT}
