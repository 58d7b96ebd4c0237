"""Saving the run at a step boundary: the actor's shards (inside the step, right after ``train``), every
rank's RNG/task state and rank 0's :class:`~checkpointing.checkpoint.RLState`, and the stop a signal asks for.
See docs/DESIGN.md, "Checkpoints, resume, preemption"."""

from __future__ import annotations

import errno
import functools
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from checkpointing.checkpoint import ACTOR_DIR, CHECKPOINT_DIR, RLState, complete_checkpoints, model_sizes
from rl.generation import sampling_seed
from run.launch import PREEMPTED_EXIT_CODE
from run.setup import RankContext
from telemetry.metrics import NonFiniteError


class StopBeforeTrain(Exception):
    """Every rank agreed to stop before this step's ``train``: the training state is still the step's start."""


def save_actor(ctx: RankContext, completed_steps: int) -> Path:
    """Begin the checkpoint after ``completed_steps`` steps: the actor's shards into its temporary directory."""
    tmp = ctx.checkpointer.begin(completed_steps)
    with ctx.checkpointer.window():  # every rank writes its shards, then waits for the slowest in a collective
        ctx.actor.save_checkpoint(tmp / ACTOR_DIR)
    return tmp


def export_actor(ctx: RankContext, completed_steps: int) -> Path:
    """The actor's weights as ``<run dir>/hf/step_<n>`` (every rank writes its share; see Actor.save_hf)."""
    from checkpointing.checkpoint import HF_DIR, RUN_CONFIG_COPY, step_dir_name

    run_dir = ctx.checkpointer.root.parent
    out_dir = run_dir / HF_DIR / step_dir_name(completed_steps)
    return ctx.actor.save_hf(out_dir, extra_files={RUN_CONFIG_COPY: run_dir / "config.yaml"})


def finish_checkpoint(ctx: RankContext, tmp: Path, completed_steps: int, rank_state: dict, warmup_losses) -> Path:
    """Every rank's RNG/task state, then rank 0's RLState and the rename; then W&B gets the covered steps."""
    state = None
    if ctx.writer is not None:
        state = RLState(
            completed_steps=completed_steps,
            sampling_seed=ctx.sampling_base_seed,
            next_sampling_seeds=[
                sampling_seed(ctx.sampling_base_seed, completed_steps, r) for r in range(ctx.mesh.num_replicas)
            ],
            data_num_prompts_drawn=rank_state["task"]["num_drawn"],
            wandb_run_id=ctx.writer.wandb_run_id,
            wandb_step=ctx.writer.wandb_step + ctx.writer.num_deferred,
            world_size=ctx.mesh.world_size,
            layout=dict(
                actor_tp=ctx.dims.tp,
                actor_pp=ctx.dims.pp,
                actor_vpp=ctx.dims.vpp,
                actor_dp=ctx.dims.dp,
                rollout_tp=ctx.mesh.rollout_tp,
            ),
            model=model_sizes(ctx.actor.shape),
            exp=ctx.cfg.exp,
            warmup_losses=list(warmup_losses),
        )
    path = ctx.checkpointer.finish(tmp, rank_state, state)
    if ctx.writer is not None:
        ctx.writer.flush_wandb()
    return path


def save_and_stop(
    ctx: RankContext,
    completed_steps: int,
    rank_state: dict,
    warmup_losses,
    engine_awake: bool,
    pending: Path | None = None,
) -> int:
    """A stop was agreed: save the state after ``completed_steps`` steps (completing ``pending``, the
    checkpoint the step began after train, or unless that checkpoint exists), close the outputs without a
    summary, return the exit code job.sbatch requeues on."""
    if pending is not None:
        path = finish_checkpoint(ctx, pending, completed_steps, rank_state, warmup_losses)
    elif ctx.checkpointer.exists(completed_steps):  # resumed from exactly this state and trained nothing since
        path = ctx.checkpointer.root / f"step_{completed_steps:08d}"
    else:
        if engine_awake:
            ctx.engine.sleep(["weights", "kv_cache"])  # the run ends: room for the actor's state on the device
        for what in ("params", "grads", "optimizer"):
            if ctx.offloaded(what):
                ctx.actor.onload(what)  # a no-op for what is resident already
        path = finish_checkpoint(ctx, save_actor(ctx, completed_steps), completed_steps, rank_state, warmup_losses)
    if ctx.writer is not None:
        ctx.writer.close()
        print(
            f"stopped by {ctx.stop.received or 'a signal to another rank'} after {completed_steps} steps; checkpoint "
            f"{path}; run again with the same run directory (resume=auto) to continue",
            file=sys.stderr,
            flush=True,
        )
    dist.barrier()
    return PREEMPTED_EXIT_CODE


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
STORAGE_EXIT_CODE = 1
MIN_FREE_BYTES = 1 << 20
STORAGE_LINE_GRACE_S = 5.0  # less than this free after a failed write: the disk is full


def storage_fault_line(exc: BaseException, run_dir: Path) -> str | None:
    """One line naming the path and the cause when ``exc`` comes from a full or read-only run directory
    (an OSError, or a library's wrapper of one such as torch's checkpoint writer: the filesystem says);
    None for any other failure."""
    chain, cause_exc = [], exc
    while cause_exc is not None and len(chain) < 16:
        chain.append(cause_exc)
        cause_exc = cause_exc.__cause__ or cause_exc.__context__
    os_error = next((e for e in chain if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS), None)
    # torch's distributed checkpoint gathers every rank's failure as text (CheckpointException.failures)
    text = " ".join([str(e) for e in chain] + [str(f) for e in chain for f in getattr(e, "failures", {}).values()])
    named = next((code for code in STORAGE_ERRNOS if os.strerror(code) in text), None)
    stat = os.statvfs(run_dir)
    free_bytes = stat.f_bavail * stat.f_frsize
    checkpoints = run_dir / CHECKPOINT_DIR
    partial = sorted(checkpoints.glob(".tmp-step_*")) if checkpoints.is_dir() else []
    complete = complete_checkpoints(checkpoints) if checkpoints.is_dir() else []
    # room for less than one more checkpoint (the last complete one, or what the failed one wrote so far)
    checkpoint_bytes = max([MIN_FREE_BYTES] + [_bytes_under(p) for p in (complete[-1:] + partial[-1:])])
    if os_error is not None or named is not None:
        cause = os.strerror(os_error.errno if os_error is not None else named).lower()
    elif stat.f_flag & os.ST_RDONLY:
        cause = "read-only file system"
    elif free_bytes < checkpoint_bytes:
        cause = "no space left on device"
    else:
        return None
    path = getattr(os_error, "filename", None) or (partial[-1] if partial else run_dir)
    kept = f"the last complete checkpoint {complete[-1]} is kept" if complete else "no complete checkpoint yet"
    return (
        f"storage error: {path}: {cause} ({free_bytes / 2**20:.1f} MiB free on its filesystem, a checkpoint takes "
        f"{checkpoint_bytes / 2**20:.1f} MiB); the run stopped, "
        f"{kept}: free space (or make {run_dir} writable), then run again with the same run directory"
    )


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def numeric_fault_line(exc: BaseException, run_dir: Path) -> str | None:
    """One line for a non-finite reward, log-prob, loss or grad norm (:class:`telemetry.metrics.NonFiniteError`): the
    step, the phase, the quantity, and the checkpoint a resume starts from; None for any other failure."""
    if not isinstance(exc, NonFiniteError):
        return None
    checkpoints = run_dir / CHECKPOINT_DIR
    complete = complete_checkpoints(checkpoints) if checkpoints.is_dir() else []
    kept = f"the last complete checkpoint {complete[-1]} is kept" if complete else "no checkpoint was written yet"
    return (
        f"numeric error: {exc}; {kept}: look at the step's data and rewards, or lower actor.lr, "
        "then run again with the same run directory"
    )


def stops_on_storage_faults(run_rank):
    """A full or read-only run directory while a checkpoint, the timeline or the metrics are written, or a
    non-finite value in a step, ends the rank with one line instead of a library's traceback (rank 0's; the
    launcher stops the others)."""

    @functools.wraps(run_rank)
    def wrapper(cfg, run_dir: str) -> int:
        try:
            return run_rank(cfg, run_dir)
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            line = None
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                line = numeric_fault_line(exc, Path(run_dir)) or storage_fault_line(exc, Path(run_dir))
            if line is None:
                raise
            if int(os.environ.get("RANK", "0")) != 0:  # rank 0 says it (the launcher then stops this rank);
                time.sleep(STORAGE_LINE_GRACE_S)  # a rank whose disk alone is full says it after a moment
            print(f"\n{line}", file=sys.stderr, flush=True)  # on a line of its own after the progress bar
            os._exit(STORAGE_EXIT_CODE)  # not SystemExit: W&B's and torch's threads would print their tracebacks

    return wrapper
