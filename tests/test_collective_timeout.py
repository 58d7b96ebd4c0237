"""One-sided file work inside a collective window (rank 0 deleting an old checkpoint while the others wait in a
barrier; a rank writing its shards while the others wait in the final gather) is not cut off by the collective
timeout meant for a step (on NCCL: its watchdog ending the waiting ranks). Real gloo ranks, a 2 s timeout."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from checkpointing.checkpoint import Checkpointer
from tests.dist import run_ranks

STEP_TIMEOUT_S, FILE_TIMEOUT_S, RANK0_WORK_S = 2.0, 60.0, 5.0


def _barrier_after_rank0_works(rank: int) -> str:
    if rank == 0:
        time.sleep(RANK0_WORK_S)  # e.g. shutil.rmtree of an old checkpoint
    try:
        dist.barrier()
        return "passed"
    except RuntimeError:
        return "timed out"


def _slow_rank0_in_and_out_of_the_window(rank: int, world_size: int, run_dir: str) -> list[str]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=STEP_TIMEOUT_S))
    checkpointer = Checkpointer(Path(run_dir), rank, 1, timeout_s=STEP_TIMEOUT_S, file_timeout_s=FILE_TIMEOUT_S)
    with checkpointer.window():
        inside = _barrier_after_rank0_works(rank)
    return [inside, _barrier_after_rank0_works(rank)]  # after the window: the step's timeout again


def test_file_work_inside_the_checkpoint_window_outlasts_the_step_timeout(tmp_path):
    outcomes = run_ranks(_slow_rank0_in_and_out_of_the_window, 2, str(tmp_path), timeout_s=120)
    assert outcomes[1] == ["passed", "timed out"], outcomes  # rank 1 waited on rank 0 both times
