# rlmem: every user-facing command. `make help` (the default) lists them.
# Targets take EXP=<experiment> and ARGS="<hydra overrides>".
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# CPU build by default; CUDA clusters override, e.g. TORCH_SPEC="torch==2.13.0 --index-url <their wheel index>".
TORCH_SPEC  ?= torch==2.13.0
EXTRAS      ?= dev
EXP         ?= tiny_cpu
ARGS        ?=
TINY_DIR    ?= tiny_models
HF          ?= $(TINY_DIR)/qwen2
TP          ?= 1
PP          ?= 1
VPP         ?=
TRAIN_TP    ?= 1
TRAIN_PP    ?= 1
ROLLOUT_TP  ?= 1
PYTEST_ARGS ?=
JSON        ?=
NODES       ?=
SUBMIT      ?=
RUN         ?=
RUNS        ?=
OUT         ?= compare.png

STAMP := $(VENV)/.installed-$(EXTRAS)
# HF=tiny_models/<family> builds that tiny checkpoint on demand, so README examples work in a fresh clone
TINY_HF := $(if $(filter $(TINY_DIR)/%,$(HF)),$(HF)/config.json)

.PHONY: help install run plan report compare sbatch test test-gpu test-slow test-slurm lint tiny-models parity verify-sync bench-entropy bench-sync bench-rollout clean

help: ## list the targets
	@echo "usage: make <target> [EXP=<experiment>] [ARGS=\"<hydra overrides>\"]"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sort | awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv, install torch (TORCH_SPEC) first, then this repo with [EXTRAS]; idempotent

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@
	@echo "installed into $(VENV)"

run: $(STAMP) ## run experiment EXP (default tiny_cpu: the whole loop on 2 CPU processes) with ARGS overrides
	$(PY) -m rl.main --exp $(EXP) $(ARGS)

plan: $(STAMP) ## predicted memory of every phase of EXP on its device, KV cache sized to fit (no GPU); JSON=<path> writes it
	@$(PY) -m tools.plan --exp $(EXP) $(if $(JSON),--json $(JSON)) $(ARGS)
report: $(STAMP) ## RUN=<run dir>: stage chart + timeline PNGs into it and the per-phase memory table, from its files
	@$(PY) -m tools.report $(RUN)

compare: $(STAMP) ## RUNS="<dir> <dir>": measured phase peaks side by side, stage charts one under the other (OUT=compare.png)
	@$(PY) -m tools.report $(RUNS) --out $(OUT)

sbatch: $(STAMP) ## render runs/<EXP>/<timestamp>/job.sbatch [NODES=<n>] [SUBMIT=1: sbatch it, print the job id]
	@$(PY) -m tools.sbatch --exp $(EXP) $(if $(NODES),--nodes $(NODES)) $(if $(filter 1 yes true,$(SUBMIT)),--submit) $(ARGS)

test: $(STAMP) ## run the CPU test suite (excludes gpu, slow and slurm tests)
	$(PY) -m pytest -q -m "not gpu and not slow and not slurm" $(PYTEST_ARGS)

test-slow: $(STAMP) ## run the slow end-to-end tests
	$(PY) -m pytest -q -m "slow" $(PYTEST_ARGS)

test-gpu: $(STAMP) ## run the gpu-marked tests (needs CUDA; `make install EXTRAS=dev,gpu` for vLLM)
	$(PY) -m pytest -q -m "gpu" $(PYTEST_ARGS)

test-slurm: $(STAMP) ## the slurm-marked tests: start a local Slurm (.ci/slurm-up, root) if none answers, submit jobs
	$(PY) -m pytest -q -m "slurm" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff over the whole repo
	$(PY) -m ruff check .

tiny-models: $(STAMP) ## write the tiny Qwen2 / Llama / Qwen3 HF checkpoints to $(TINY_DIR)/
	$(PY) -m modelspec.tiny --out $(TINY_DIR)

verify-sync: $(STAMP) $(TINY_HF) ## HF=<dir> -> actor TRAIN_TP x TRAIN_PP -> reshard -> engine ROLLOUT_TP; engine vs transformers (one JSON line)
	@$(PY) -m tools.verify_sync --hf $(HF) --train-tp $(TRAIN_TP) --train-pp $(TRAIN_PP) --rollout-tp $(ROLLOUT_TP) $(ARGS)

bench-sync: $(STAMP) ## planned reshard vs gather+broadcast baseline on 4 CPU ranks (one JSON line)
	@$(PY) -m tools.bench_sync $(ARGS)

$(TINY_DIR)/%/config.json: | $(STAMP)
	$(PY) -m modelspec.tiny --out $(TINY_DIR) --families $*

parity: $(STAMP) $(TINY_HF) ## megatron (TP x PP [x VPP]) vs transformers log-probs on HF=<dir>: one JSON line
	@$(PY) -m tools.parity --hf $(HF) --tp $(TP) --pp $(PP) $(if $(VPP),--vpp $(VPP))

bench-entropy: $(STAMP) ## peak memory of chunked vs unchunked vocab entropy: one JSON line
	@$(PY) -m tools.bench_entropy

bench-rollout: $(STAMP) ## native engine vs transformers generate tokens/s (batch 32, tiny model): one JSON line
	@$(PY) -m tools.bench_rollout $(ARGS)

clean: ## remove caches and generated tiny checkpoints (keeps .venv and runs/)
	rm -rf .pytest_cache .ruff_cache $(TINY_DIR)
