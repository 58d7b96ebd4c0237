"""Process groups for the actor: torch.distributed init plus megatron-core's ``parallel_state``.

Callers get a :class:`ParallelDims` with the tp/pp/dp groups and pass them on explicitly; nothing
outside ``megatron_backend`` reads ``parallel_state``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_backend import cpu_compat
from modelspec.mesh import check_world


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the actor's TP x PP x DP grid, and its groups.

    MoE layers have a second grid over the same ranks (megatron's expert rank generator, order
    tp-ep-dp-pp): expert TP (``etp``, each expert's intermediate dim) x EP (``ep``, whole experts) x
    expert DP x PP. A dense model has ep = 1 and etp = tp.
    """

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    expert_dp: int = 1
    expert_dp_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    etp_group: dist.ProcessGroup | None = None

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the default process group from the usual env (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    NCCL on CUDA, gloo otherwise. Idempotent. ``timeout_s`` bounds every collective (and the
    rendezvous): a rank whose peer died raises instead of waiting forever.
    """
    if dist.is_initialized():
        return
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def initialize_model_parallel(
    tp: int,
    pp: int,
    vpp: int | None = None,
    seed: int = 1234,
    timeout_s: float = 600.0,
    ep: int = 1,
    etp: int | None = None,
) -> ParallelDims:
    """Set up megatron-core's TP/PP/DP groups (order tp-dp-pp as in megatron), its expert groups
    (etp x ep x expert-dp x pp; ``etp`` None follows ``tp``) and the RNG tracker."""
    # first use: at the top megatron-core (~4 s) would load with `import checkpointing.checkpoint, megatron_backend.model ...`, which do not need it
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    init_distributed(timeout_s)
    cpu_compat.apply()
    world_size = dist.get_world_size()
    etp = tp if etp is None else etp
    check_world(world_size, tp, pp, ep, etp)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # its subgroups' timeout (default 30 min): a hung TP/PP/DP collective fails when the default group's does
        distributed_timeout_minutes=timeout_s / 60,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelDims(
        rank=dist.get_rank(),
        world_size=world_size,
        tp=tp,
        pp=pp,
        dp=world_size // (tp * pp),
        vpp=vpp,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        device=default_device(),
        ep=ep,
        etp=etp,
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        expert_dp=world_size // (etp * ep * pp),
        expert_dp_rank=mpu.get_expert_data_parallel_rank(),
        ep_group=mpu.get_expert_model_parallel_group(),
        etp_group=mpu.get_expert_tensor_parallel_group(),
    )


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """Megatron's model-parallel RNG tracker states (name -> generator state), for checkpoints."""
    # first use: at the top megatron-core (~4 s) would load with `import checkpointing.checkpoint, megatron_backend.model ...`, which do not need it
    from megatron.core import tensor_parallel

    return {name: state.clone() for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    # first use: at the top megatron-core (~4 s) would load with `import checkpointing.checkpoint, megatron_backend.model ...`, which do not need it
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states({name: state.clone() for name, state in states.items()})


def destroy() -> None:
    # first use: at the top megatron-core (~4 s) would load with `import checkpointing.checkpoint, megatron_backend.model ...`, which do not need it
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
