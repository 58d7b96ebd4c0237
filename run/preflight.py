"""Checks that read files or the environment, run by the launcher after composition and before any rank
starts: the checkpoint's shards and tokenizer, the engine's package, the KV-cache budget, the data file,
and the checkpoint a run resumes from. Each failure is one :class:`~run.compose.ConfigError` line naming
the key or file and the fix; all of them together take seconds (headers are read, never weights).

Pure config checks (sizes that must divide, ranges) live in the configs' ``__post_init__``
(:mod:`run.config` and each component's dataclass) and fail earlier, at composition.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
from dataclasses import asdict
from pathlib import Path

import yaml
from packaging.version import Version

from checkpointing.checkpoint import (
    ACTOR_DIR,
    CHECKPOINT_DIR,
    RLState,
    checkpoint_from_path,
    complete_checkpoints,
    model_sizes,
)
from megatron_backend.checkpoint import verify_hf_checkpoint
from megatron_backend.dist_checkpoint import saved_param_dtype
from modelspec import ModelShape
from rl.evaluation import eval_problems
from rl.generation import sampling_seed
from run.compose import ConfigError
from run.config import RunConfig
from run.memory_plan import LaunchPlan
from telemetry.tracking import SUMMARY_FILE

# Transformer Engine before 2.12 has no attention backend for float32 THD (packed) sequences: flash and fused
# attention take fp16/bf16 only and get_attention_backend disabled unfused attention for qkv_format="thd"
# (dot_product_attention/utils.py; the filter was removed by TE commit 93c5c65, released in 2.12.0)
TE_FLOAT32_THD = (2, 12)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# keys that may change between the run that saved a checkpoint and the one that resumes it automatically
RESUMABLE_CHANGES = ("resume", "trainer.steps")


def preflight(cfg: RunConfig, run_dir: Path | None, launch: LaunchPlan) -> None:
    """Every file-level check; ``cfg.model.path`` must already be resolved (tiny checkpoints written). ``launch``:
    the launch's memory plan (run.memory_plan.plan_launch), whose KV cache is checked."""
    check_engine_installed(cfg)
    check_attention_backend(cfg)
    shape = cfg.model.shape()
    check_tokenizer(cfg, shape)
    check_model_files(cfg, shape)
    check_kv_budget(cfg, launch)
    check_data(cfg)
    check_resume(cfg, run_dir, shape)


def check_engine_installed(cfg: RunConfig) -> None:
    package = cfg.rollout.profile.package  # what the engine needs beyond this repository (colocation.engines)
    if package is None:
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or one shadowed in sys.modules
        found = False
    if not found:
        raise ConfigError(
            f"rollout.engine={cfg.rollout.engine} needs the {package} package, which is not importable here; "
            f"install it (`make install EXTRAS=dev,gpu` on a GPU machine) or use rollout.engine=native"
        )


def check_attention_backend(cfg: RunConfig) -> None:
    """A CUDA run with Transformer Engine installed attends through TE (megatron_backend.model.layer_spec): refuse
    float32 packed sequences on a TE without a backend for them, rather than fail at the first forward."""
    if cfg.device_kind == "cpu" or cfg.model.dtype != "float32" or not cfg.actor.remove_padding:
        return
    try:
        installed = importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return  # megatron's local spec (no TE) attends float32 THD itself

    if Version(installed).release[:2] < TE_FLOAT32_THD:
        raise ConfigError(
            f"model.dtype=float32 with actor.remove_padding=true: Transformer Engine {installed} has no attention "
            "backend for float32 packed sequences; set model.dtype=bfloat16, or actor.remove_padding=false, or "
            "install transformer-engine>=2.12"
        )


def check_model_files(cfg: RunConfig, shape: ModelShape) -> None:

    try:
        verify_hf_checkpoint(cfg.model.path, shape)
    except ValueError as exc:
        raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from None


def check_tokenizer(cfg: RunConfig, shape: ModelShape) -> None:
    # first use: at the top transformers would load with `import run.main`, which does not need it
    from transformers import AutoTokenizer

    if not any((Path(cfg.model.path) / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone and fail much later
        raise ConfigError(
            f"model.path={cfg.model.path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "checkpoint's tokenizer files there"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"model.path={cfg.model.path!r} has no loadable tokenizer ({first}); the directory needs "
            "tokenizer.json / tokenizer_config.json"
        ) from None
    if len(tokenizer) > shape.vocab_size:
        raise ConfigError(
            f"the tokenizer in model.path={cfg.model.path!r} has {len(tokenizer)} tokens but config.json's "
            f"vocab_size is {shape.vocab_size}: token ids past the embedding would crash the run; use the "
            "checkpoint's own tokenizer"
        )


def check_kv_budget(cfg: RunConfig, launch: LaunchPlan) -> None:
    """The engine's KV cache must hold at least one ``max_model_len`` sequence (what the native engine and
    vLLM both refuse to start without). The KV cache is the one the launch's memory plan gives this config's
    engine (``planner.plan``: each engine's own sizing rule), so launch and ``make plan`` agree."""
    rollout = cfg.rollout
    if rollout.planner_sizes_kv_cache:
        return  # the planner picks it (run.memory_plan.plan_launch refuses a plan where none fits)
    plan = launch.plan
    if plan is None:
        raise ConfigError(f"the memory plan of this config failed: {launch.problem}")
    if not plan.kv_cache_too_small:
        return
    kv, needed = plan.kv_cache_bytes, plan.min_kv_cache_bytes
    max_model_len = plan.inputs.engine_max_model_len
    if rollout.kv_cache_bytes is not None:
        raise ConfigError(
            f"rollout.kv_cache_bytes={rollout.kv_cache_bytes} ({kv / 2**20:.1f} MiB in whole blocks) is less than "
            f"one max_model_len={max_model_len} sequence needs ({needed / 2**20:.1f} MiB); raise it, or lower "
            "rollout.max_model_len"
        )
    on_cpu = cfg.cluster.device == "cpu"
    capacity_key = "rollout.cpu_capacity_gb" if on_cpu else f"cluster.device={cfg.cluster.device}"
    raise ConfigError(
        f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} x {capacity_key} "
        f"({plan.inputs.utilization_capacity_bytes / 2**30:.3g} GiB) leaves {kv / 2**20:.1f} MiB for the KV cache "
        f"after the engine's weights and activation reserve, less than one max_model_len={max_model_len} sequence "
        f"needs ({needed / 2**20:.1f} MiB); raise rollout.gpu_memory_utilization"
        + (" or rollout.cpu_capacity_gb" if on_cpu else "")
        + ", or lower rollout.max_model_len"
    )


def check_data(cfg: RunConfig) -> None:
    """The task reads its whole file now, as every rank will: each line parses and has the task's fields."""
    if cfg.data.path is not None and not Path(cfg.data.path).is_file():
        raise ConfigError(f"data.path={cfg.data.path!r} does not exist; point it at a local .jsonl or .parquet file")
    if cfg.eval.data.path is not None and not Path(cfg.eval.data.path).is_file():
        raise ConfigError(
            f"eval.data.path={cfg.eval.data.path!r} does not exist; point it at a local .jsonl or .parquet file"
        )
    try:
        cfg.data.build(seed=cfg.trainer.seed)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if cfg.eval.enabled and cfg.eval.data.path is not None:
        try:
            eval_problems(cfg)
        except (OSError, ValueError) as exc:  # the reader names data.path: here it is the eval's file
            raise ConfigError(f"eval.data.path: {exc}") from None


def check_resume(cfg: RunConfig, run_dir: Path | None, shape: ModelShape) -> None:
    """The checkpoint the run will resume from exists and fits the model; ``never`` overwrites nothing."""
    existing = complete_checkpoints(run_dir / CHECKPOINT_DIR) if run_dir is not None else []
    if cfg.resume == "never":
        if existing:
            raise ConfigError(
                f"resume=never but {run_dir} already holds checkpoints ({existing[-1].name}); a fresh run there would "
                "mix with them: give a new --run-dir, or resume=auto to continue it"
            )
        return
    if cfg.resume == "auto":
        checkpoint = existing[-1] if existing else None
    else:
        try:
            checkpoint = checkpoint_from_path(cfg.resume)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if checkpoint is None:
        return
    try:
        state = RLState.read(checkpoint)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"resume: {checkpoint}/rl_state.json is unreadable ({exc}); pick another checkpoint"
        ) from None
    if state.model != model_sizes(shape):
        raise ConfigError(
            f"resume: {checkpoint} is of a model with {state.model}, model.path={cfg.model.path!r} has "
            f"{model_sizes(shape)}; resume it with its own model, or resume=never"
        )
    try:
        saved_dtype = saved_param_dtype(checkpoint / ACTOR_DIR)
    except (OSError, ValueError) as exc:  # torch's reader: a missing or unreadable .metadata
        raise ConfigError(
            f"resume: {checkpoint / ACTOR_DIR} has no readable .metadata ({exc}); pick another checkpoint"
        ) from None
    if saved_dtype is not None and saved_dtype != cfg.model.dtype:
        raise ConfigError(
            f"resume: {checkpoint} holds {saved_dtype} weights but model.dtype={cfg.model.dtype}; resume it with "
            f"model.dtype={saved_dtype}, or export it (make export RUN=<its run dir>) and start a {cfg.model.dtype} "
            "run from the export with model.path=<export> resume=never"
        )
    schedule = [
        sampling_seed(state.sampling_seed, state.completed_steps, r) for r in range(len(state.next_sampling_seeds))
    ]
    if schedule != state.next_sampling_seeds:
        raise ConfigError(
            f"resume: {checkpoint} was sampled with another seed schedule ({state.sampling_seed_schedule}); its steps "
            "cannot be continued exactly by this code; resume=never starts over"
        )


RUN_DIR_LOCK = ".lock"


def hold_run_dir(run_dir: Path):
    """An exclusive ``flock`` on ``<run_dir>/.lock`` for as long as the returned file stays open (the launcher's
    life; the kernel drops it when that process dies, even by SIGKILL). Another live run holding it: one
    line, before this run writes anything there (its config.yaml, timeline, checkpoints would interleave)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / RUN_DIR_LOCK, "a+")  # noqa: SIM115 (held open until the run ends)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"--run-dir={run_dir} is in use by a live run ({holder} holds {run_dir / RUN_DIR_LOCK}); wait for it to "
            "end, stop it, or give another --run-dir"
        ) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def resume_point(cfg: RunConfig, run_dir: Path | None) -> RLState | None:
    """The RLState the run will start from (after :func:`preflight`), or None for a fresh run."""
    if cfg.resume == "never":
        return None
    if cfg.resume != "auto":
        return RLState.read(checkpoint_from_path(cfg.resume))
    existing = complete_checkpoints(run_dir / CHECKPOINT_DIR) if run_dir is not None else []
    return RLState.read(existing[-1]) if existing else None


def nothing_left(completed_steps: int, steps: int, run_dir: Path) -> str | None:
    """Why a run resumed after ``completed_steps`` has nothing left to do (None: it has). A run with every step
    done but no summary.json stopped after its last checkpoint, before its end (final eval, summary): that
    end is left."""
    if completed_steps > steps or (completed_steps == steps and (run_dir / SUMMARY_FILE).is_file()):
        done = f" and finished ({SUMMARY_FILE} written)" if completed_steps == steps else ""
        return f"{run_dir} already did {completed_steps} steps (trainer.steps={steps}){done}: nothing to do"
    return None


def _comparable(config: dict) -> dict:
    out = dict(config)
    for key in RESUMABLE_CHANGES:
        node = out
        *parents, leaf = key.split(".")
        for parent in parents:
            node[parent] = dict(node.get(parent) or {})
            node = node[parent]
        node.pop(leaf, None)
    return out


def find_unfinished_run(cfg: RunConfig, runs_root: Path) -> Path | None:
    """``make run`` with resume=auto and no --run-dir: the newest run of this experiment that has a complete
    checkpoint, no summary.json (it did not finish) and the same config (up to RESUMABLE_CHANGES)."""
    exp_dir = runs_root / cfg.exp
    if not exp_dir.is_dir():
        return None
    wanted = _comparable(yaml.safe_load(yaml.safe_dump(asdict(cfg))))
    for run_dir in sorted((p for p in exp_dir.iterdir() if p.is_dir()), reverse=True):
        if (run_dir / SUMMARY_FILE).exists() or not complete_checkpoints(run_dir / CHECKPOINT_DIR):
            continue
        try:
            saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(saved, dict) and _comparable(saved) == wanted:
            return run_dir
    return None
