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


def _subgroup_timeouts(rank: int, world_size: int, timeout_s: float) -> dict[str, float]:
    import torch
    from megatron.core import parallel_state as mpu

    from megatron_backend.parallel import initialize_model_parallel

    dims = initialize_model_parallel(tp=1, pp=1, timeout_s=timeout_s)
    groups = dict(
        tp=dims.tp_group,
        pp=dims.pp_group,
        dp=dims.dp_group,
        ep=dims.ep_group,
        etp=dims.etp_group,
        dp_gloo=mpu.get_data_parallel_group_gloo(),
        expert_dp=mpu.get_expert_data_parallel_group(),
    )
    return {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for name, g in groups.items()}


def test_megatron_subgroups_wait_cluster_timeout_not_30_minutes():
    """initialize_model_parallel hands cluster.timeout_s to megatron's groups (distributed_timeout_minutes,
    megatron-core's default 30 min): a hung TP/PP/DP collective fails then, as the default group's does."""
    timeouts = run_ranks(_subgroup_timeouts, 1, 90.0)[0]
    assert set(timeouts.values()) == {90.0}, timeouts


def _timeout_during_export(rank: int, world_size: int, run_dir: str) -> float:
    import torch

    dist.init_process_group("gloo", timeout=timedelta(seconds=STEP_TIMEOUT_S))
    checkpointer = Checkpointer(Path(run_dir), rank, 1, timeout_s=STEP_TIMEOUT_S, file_timeout_s=FILE_TIMEOUT_S)
    seen = []

    class Actor:  # its save_hf: shard writes, barriers and rank 0's rename (megatron_backend/hf_export.py)
        def save_hf(self, out_dir, extra_files):
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            seen.append(backend.options._timeout.total_seconds())
            return out_dir

    checkpointer.export_actor(Actor(), 3)
    return seen[0]


def test_the_hf_export_runs_inside_the_checkpoint_window(tmp_path):
    assert run_ranks(_timeout_during_export, 1, str(tmp_path))[0] == FILE_TIMEOUT_S
