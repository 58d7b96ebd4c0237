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

from checkpointing.checkpoint import CHECKPOINT_DIR, Checkpointer, RLState, StopRequest, complete_checkpoints
from run.launch import PREEMPTED_EXIT_CODE
from run.shared_device import SharedDevice
from telemetry.metrics import NonFiniteError
from telemetry.tracking import RunWriter


class StopBeforeTrain(Exception):
    """Every rank agreed to stop before this step's ``train``: the training state is still the step's start."""


def finish_checkpoint(
    checkpointer: Checkpointer, writer: RunWriter | None, tmp: Path, rank_state: dict, state: RLState | None
) -> Path:
    """Every rank's RNG/task state, then rank 0's RLState (``state``, None on the other ranks) and the rename;
    then W&B gets the covered steps."""
    path = checkpointer.finish(tmp, rank_state, state)
    if writer is not None:
        writer.flush_wandb()
    return path


def save_and_stop(
    checkpointer: Checkpointer,
    device: SharedDevice,
    writer: RunWriter | None,
    stop: StopRequest,
    *,
    completed_steps: int,
    rank_state: dict,
    state: RLState | None,
    pending: Path | None = None,
) -> int:
    """A stop was agreed: save the state after ``completed_steps`` steps (completing ``pending``, the
    checkpoint the step began after train, or unless that checkpoint exists), close the outputs without a
    summary, return the exit code job.sbatch requeues on. ``state``: rank 0's RLState for the checkpoint."""
    if pending is not None:
        path = finish_checkpoint(checkpointer, writer, pending, rank_state, state)
    elif checkpointer.exists(completed_steps):  # resumed from exactly this state and trained nothing since
        path = checkpointer.root / f"step_{completed_steps:08d}"
    else:
        device.hold_the_actor()  # the run ends: the engine released, room for the actor's state on the device
        tmp = checkpointer.save_actor(device.actor, completed_steps)
        path = finish_checkpoint(checkpointer, writer, tmp, rank_state, state)
    if writer is not None:
        writer.close()
        print(
            f"stopped by {stop.received or 'a signal to another rank'} after {completed_steps} steps; checkpoint "
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
