"""Every way a run stops early. A stop every rank agreed on (SIGUSR1 / SIGTERM) is raised at the boundary where
they agreed (:class:`StopDuringWarmup`, :func:`stop_at`) and leaves through one exit, :func:`exit_at_stop`: the
actor's shards (or the checkpoint the step began right after ``train``), every rank's RNG/task state and rank 0's
:class:`~checkpointing.checkpoint.RLState` saved first. A full or read-only disk, or a non-finite value, ends the rank
with one line (:func:`stops_on_storage_faults`). See docs/DESIGN.md, "Checkpoints, resume, preemption"."""

from __future__ import annotations

import errno
import functools
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from checkpointing.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    RLState,
    capture_rank_state,
    complete_checkpoints,
    step_dir_name,
)
from run.launch import PREEMPTED_EXIT_CODE
from telemetry.metrics import NonFiniteError
from telemetry.tracking import RunWriter

if TYPE_CHECKING:
    from run.setup import RankContext


class AgreedStop(Exception):
    """Every rank agreed at one of the run's boundaries to stop (SIGUSR1 / SIGTERM): raised there, it leaves
    through :func:`exit_at_stop` (run/loop.py::run_rank)."""


class StopDuringWarmup(AgreedStop):
    """Before the warm-up's last step, after ``done`` of them: no checkpoint exists before its end."""

    def __init__(self, done: int):
        super().__init__(f"stop during the warm-up, after {done} of its steps")
        self.done = done


class StopAndSave(AgreedStop):
    """After the warm-up: what to save is the state after ``completed_steps`` steps, this rank's RNGs and data cursor
    then (``rank_state``), rank 0's RLState (``state``, None on the other ranks), and ``pending``, the checkpoint
    the step began after ``train`` (completed instead of a new one)."""

    def __init__(self, completed_steps: int, rank_state: dict, state: RLState | None, pending: Path | None = None):
        super().__init__(f"stop after {completed_steps} steps")
        self.completed_steps, self.rank_state, self.state, self.pending = completed_steps, rank_state, state, pending


def stop_at(ctx: RankContext, completed_steps: int, rank_state: dict | None = None, pending: Path | None = None):
    """The stop every rank agreed on at a boundary after the warm-up, to raise there: the state after
    ``completed_steps`` steps (``rank_state``: this rank's then; None: now), completing ``pending`` if the step began
    a checkpoint."""
    rank_state = capture_rank_state(ctx.task) if rank_state is None else rank_state
    return StopAndSave(completed_steps, rank_state, ctx.rl_state(completed_steps, rank_state), pending)


def exit_at_stop(ctx: RankContext, stopped: AgreedStop) -> int:
    """The one exit of an agreed stop: close the outputs without a summary and return the exit code job.sbatch
    requeues on. During the warm-up at once: no checkpoint can hold part of it (every checkpoint is after the
    warm-up, and a resume skips it), so a requeue starts the run over. Anywhere else once the state ``stopped``
    names is saved: its pending checkpoint completed, else a new one unless that step's exists."""
    if isinstance(stopped, StopDuringWarmup):
        what = (
            f"during the supervised warm-up (after {stopped.done} of {ctx.cfg.trainer.sft_warmup_steps} steps); no "
            "checkpoint before the warm-up ends: run again with the same run directory to start over"
        )
    else:
        path = _save(ctx, stopped)
        what = (
            f"after {stopped.completed_steps} steps; checkpoint {path}; run again with the same run directory "
            "(resume=auto) to continue"
        )
    if ctx.writer is not None:
        ctx.writer.close()
        print(f"stopped by {ctx.stop.received or 'a signal to another rank'} {what}", file=sys.stderr, flush=True)
    dist.barrier()
    return PREEMPTED_EXIT_CODE


def _save(ctx: RankContext, stopped: StopAndSave) -> Path:
    checkpointer, steps, rank_state, state = (
        ctx.checkpointer,
        stopped.completed_steps,
        stopped.rank_state,
        stopped.state,
    )
    if stopped.pending is not None:
        return finish_checkpoint(checkpointer, ctx.writer, stopped.pending, rank_state, state)
    if checkpointer.exists(steps):  # resumed from exactly this state and trained nothing since
        return checkpointer.root / step_dir_name(steps)
    ctx.shared.hold_the_actor()  # the run ends: the engine released, room for the actor's state on the device
    tmp = checkpointer.save_actor(ctx.shared.actor, steps)
    return finish_checkpoint(checkpointer, ctx.writer, tmp, rank_state, state)


def finish_checkpoint(
    checkpointer: Checkpointer, writer: RunWriter | None, tmp: Path, rank_state: dict, state: RLState | None
) -> Path:
    """Every rank's RNG/task state, then rank 0's RLState (``state``, None on the other ranks) and the rename;
    then W&B gets the covered steps."""
    path = checkpointer.finish(tmp, rank_state, state)
    if writer is not None:
        writer.flush_wandb()
    return path


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
    def wrapper(cfg, run_dir: str, launch=None) -> int:
        try:
            return run_rank(cfg, run_dir, launch)
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
