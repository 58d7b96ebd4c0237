"""Checkpoints of a run, resuming from them, and stopping cleanly on SIGUSR1 / SIGTERM.

Layout under the run directory::

    checkpoints/step_00000012/          the state after 12 completed steps (the next step is 12)
        actor/                          megatron-core distributed checkpoint: params + optimizer, every rank's shards
        ranks/rank_00000.pt ...         per rank: torch / CUDA / python / numpy / megatron-tracker RNG, task state
        rl_state.json                   written last by rank 0 (RLState): step, seeds, data cursor, W&B id, layout
    checkpoints/.tmp-step_00000012/     being written; renamed to step_00000012 only when complete

A checkpoint is written into ``.tmp-<name>`` and renamed (one atomic ``rename`` on rank 0) after every
rank has written its part and rank 0 its ``rl_state.json``, so a directory named ``step_*`` is always
complete: a run killed inside a save leaves only a ``.tmp-*`` that is never picked and is removed at
the next start. The last ``trainer.keep_last`` are kept (older ones are renamed aside, then deleted).

``resume``: ``auto`` continues from the newest complete checkpoint of the run directory (none: a fresh
run), ``never`` starts fresh, ``<path>`` resumes from that checkpoint (or the newest one under that run
or ``checkpoints`` directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from megatron_backend.parallel import rng_tracker_states, set_rng_tracker_states

if TYPE_CHECKING:
    from megatron_backend.actor import Actor

CHECKPOINT_DIR = "checkpoints"
ACTOR_DIR = "actor"
RANKS_DIR = "ranks"
STATE_FILE = "rl_state.json"
HF_DIR = "hf"  # <run dir>/hf/step_<n>: the HF exports (make export, trainer.export_every)
RUN_CONFIG_COPY = "run_config.yaml"  # an export's copy of the run's config.yaml
FORMAT_VERSION = 1
SAMPLING_SEED_SCHEDULE = "rl.sampling.sampling_seed(seed, step, replica) v1"  # a format tag in rl_state.json, kept verbatim: old checkpoints resume
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)-step_\d{8}$")


def step_dir_name(completed_steps: int) -> str:
    return f"step_{completed_steps:08d}"


@dataclass(kw_only=True)
class RLState:
    """What rank 0 writes last (``rl_state.json``): everything of the run's state that is not a tensor."""

    completed_steps: int  # steps 0 .. completed_steps - 1 are done; the next step is completed_steps
    sampling_seed: int  # base of the schedule: sampling_seed(sampling_seed, step, replica)
    next_sampling_seeds: list[int]  # the schedule at the next step, per engine replica (checked on resume)
    data_num_prompts_drawn: int  # the data cursor (the task's random.Random state is in ranks/*.pt)
    wandb_run_id: str | None
    wandb_step: int  # W&B steps logged up to this checkpoint: the resumed run's W&B records continue from it
    world_size: int
    layout: dict[str, Any]  # actor tp/pp/vpp/dp and rollout tp when saved (any layout may resume it)
    model: dict[str, int]  # the model's sizes: a checkpoint of another model is refused before any rank starts
    exp: str
    warmup_losses: list[float] = field(default_factory=list)
    sampling_seed_schedule: str = SAMPLING_SEED_SCHEDULE
    format_version: int = FORMAT_VERSION

    @classmethod
    def read(cls, checkpoint: Path) -> RLState:
        data = json.loads((Path(checkpoint) / STATE_FILE).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def model_sizes(shape) -> dict[str, int]:
    """The sizes a checkpoint must agree on with the model it resumes into (from a ModelShape)."""
    return dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        vocab_size=shape.vocab_size,
    )


# ---------------------------------------------------------------------------------------------- finding


def is_complete(path: Path) -> bool:
    """A finished checkpoint: a ``step_*`` directory with its rl_state.json and the actor's metadata."""
    path = Path(path)
    return (
        bool(_STEP_DIR.match(path.name))
        and (path / STATE_FILE).is_file()
        and (path / ACTOR_DIR / "metadata.json").is_file()
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints`` directory), oldest first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_from_path(path: str | Path) -> Path:
    """``resume=<path>``: a checkpoint, or the newest one in a ``checkpoints`` or run directory.

    Raises ValueError naming the path and the fix when there is none.
    """
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / CHECKPOINT_DIR):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    what = (
        "does not exist" if not path.exists() else "is not a checkpoint (no step_*/rl_state.json + actor/metadata.json)"
    )
    raise ValueError(
        f"resume={str(path)!r} {what}; give a runs/<exp>/<time>/checkpoints/step_* directory (or its run "
        "directory), resume=auto or resume=never"
    )


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint a run in ``run_dir`` starts from, or None for a fresh start."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(Path(run_dir) / CHECKPOINT_DIR)
    return checkpoint_from_path(resume)


# ---------------------------------------------------------------------------------------------- RNG


def capture_rank_state(task) -> dict[str, Any]:
    """Every RNG this rank draws from, and the task's data cursor (a deep copy, cheap: a few KiB)."""

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "megatron_tracker": rng_tracker_states(),
        "task": task.state_dict(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rank_state(state: dict[str, Any], task) -> None:

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    set_rng_tracker_states(state["megatron_tracker"])
    task.load_state_dict(state["task"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def load_rank_state(checkpoint: Path, rank: int) -> dict[str, Any]:
    """This rank's saved state; a rank the saving run did not have (more ranks now) takes rank 0's."""
    path = Path(checkpoint) / RANKS_DIR / f"rank_{rank:05d}.pt"
    if not path.is_file():
        path = Path(checkpoint) / RANKS_DIR / "rank_00000.pt"
    return torch.load(path, weights_only=False)  # our own file: python/numpy RNG states are tuples


# ---------------------------------------------------------------------------------------------- saving


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def collective_timeout(timeout_s: float, restore_s: float) -> Iterator[None]:
    """The default group's collectives give up after ``timeout_s`` inside the block, ``restore_s`` after it.

    For one-sided file work inside a collective window (a rank writing its shards while the others wait in the
    checkpoint's final gather; rank 0 renaming and deleting while the others wait in a barrier): on NCCL the
    watchdog would otherwise end the waiting ranks at ``cluster.timeout_s`` (run/launch.py, NCCL_RANK_ENVIRON).
    torch's own ``dist.breakpoint`` lengthens the timeout the same way (``_set_pg_timeout``, for gloo and NCCL);
    collectives begun inside the block keep the long timeout. Chosen over moving the work out of the window
    (the next collective would then wait on it instead) and over a gloo side group (megatron's checkpoint
    collectives run on the default group, which only this reaches)."""

    if not dist.is_initialized():
        yield
        return
    _set_pg_timeout(timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        _set_pg_timeout(timedelta(seconds=restore_s))


class Checkpointer:
    """Writes the run's checkpoints (every rank calls every method: they are collective). Its file work runs in
    :meth:`window` (the collectives there wait up to ``file_timeout_s``, then ``timeout_s`` again; None: as they
    are)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        keep_last: int,
        *,
        timeout_s: float | None = None,
        file_timeout_s: float | None = None,
    ):
        if keep_last < 1:
            raise ValueError(f"trainer.keep_last={keep_last} must be >= 1")
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.rank = rank
        self.keep_last = keep_last
        self.timeouts = (file_timeout_s, timeout_s) if file_timeout_s is not None and timeout_s is not None else None
        with self.window():
            if rank == 0:
                self.remove_leftovers()
            dist.barrier()

    def window(self) -> contextlib.AbstractContextManager:
        """Around one-sided file work inside collectives (this class's, and the actor's shard writes and reads)."""
        return contextlib.nullcontext() if self.timeouts is None else collective_timeout(*self.timeouts)

    def remove_leftovers(self) -> None:
        """Half-written (``.tmp-*``) and half-deleted (``.trash-*``) directories of a killed run."""
        if self.root.is_dir():
            for path in self.root.iterdir():
                if _LEFTOVER.match(path.name):
                    shutil.rmtree(path, ignore_errors=True)

    def exists(self, completed_steps: int) -> bool:
        return is_complete(self.root / step_dir_name(completed_steps))

    def begin(self, completed_steps: int) -> Path:
        """A fresh temporary directory for the checkpoint after ``completed_steps`` steps."""
        tmp = self.root / f".tmp-{step_dir_name(completed_steps)}"
        with self.window():
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / RANKS_DIR).mkdir(parents=True)
            dist.barrier()
        return tmp

    def save_actor(self, actor: Actor, completed_steps: int) -> Path:
        """Begin the checkpoint after ``completed_steps`` steps: the actor's shards into its temporary
        directory (every rank writes its shards, then waits for the slowest in a collective)."""
        tmp = self.begin(completed_steps)
        with self.window():
            actor.save_checkpoint(tmp / ACTOR_DIR)
        return tmp

    def export_actor(self, actor: Actor, completed_steps: int) -> Path:
        """The actor's weights as ``<run dir>/hf/step_<n>`` (every rank writes its share; see Actor.save_hf)."""
        run_dir = self.root.parent
        out_dir = run_dir / HF_DIR / step_dir_name(completed_steps)
        with self.window():  # the shard writes, barriers and rank 0's rename are one-sided file work
            return actor.save_hf(out_dir, extra_files={RUN_CONFIG_COPY: run_dir / "config.yaml"})

    def finish(self, tmp: Path, rank_state: dict[str, Any], state: RLState | None) -> Path:
        """Write this rank's part; rank 0 then writes ``rl_state.json`` (``state``) and renames the
        directory into place, then drops the checkpoints beyond ``keep_last``."""
        final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
        with self.window():
            _write_durably(tmp / RANKS_DIR / f"rank_{self.rank:05d}.pt", lambda f: torch.save(rank_state, f))
            dist.barrier()
            if self.rank == 0:
                assert state is not None, "rank 0 writes rl_state.json"
                text = json.dumps(dataclasses.asdict(state), indent=2) + "\n"
                _write_durably(tmp / STATE_FILE, lambda f: f.write(text.encode()))
                if final.exists():  # the same state saved again (a stop right after resuming): keep the first
                    shutil.rmtree(tmp)
                else:
                    os.rename(tmp, final)
                    _fsync_dir(self.root)
                self.prune()
            dist.barrier()
        return final

    def prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.keep_last]:
            trash = old.with_name(f".trash-{old.name}")
            os.rename(old, trash)  # a checkpoint is either whole under its name, or gone
            shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- stopping


class StopRequest:
    """SIGUSR1 (Slurm's warning before the time limit, forwarded by job.sbatch) and SIGTERM (preemption,
    scancel, a local kill): remember the signal; the loop asks :meth:`agreed` at its phase boundaries,
    a collective, so every rank stops at the same boundary even if only one rank was signalled. A second
    SIGTERM ends the process at once."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, rank: int):
        self.rank = rank
        self.received: str | None = None

    def install(self) -> StopRequest:
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is None and self.rank == 0:
            print(
                f"\n{name}: saving a checkpoint at the next phase boundary, then exiting", file=sys.stderr, flush=True
            )
        self.received = self.received or name

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was signalled (collective: every rank calls it at the same boundary)."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
