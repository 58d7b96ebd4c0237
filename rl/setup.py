"""Build everything one rank holds for a run, in order: process groups and the mesh, the memory
timeline, the actor (and reference actor), the engine, the weight-sync plan, the task, the writer."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from modelspec import ColocatedMesh
from rl.config import RunConfig
from rl.data import DigitSumTask, Gsm8kTask
from rl.losses import PolicyLoss
from rl.memory import PHASES, TAGS, MemoryProbe, MemoryTimeline
from rl.tracking import RunWriter
from rl.weight_sync import SyncResult, WeightSync

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_backend.actor import Actor
    from megatron_backend.parallel import ParallelDims
    from rollout import RolloutEngine


@dataclass
class RankContext:
    """Everything one rank holds for the run; built by :func:`setup`."""

    cfg: RunConfig
    mesh: ColocatedMesh
    dims: ParallelDims  # this rank's actor groups (megatron's)
    actor: Actor
    ref_actor: Actor | None
    engine: RolloutEngine
    tokenizer: PreTrainedTokenizerBase
    task: DigitSumTask | Gsm8kTask
    loss: PolicyLoss
    weight_sync: WeightSync
    timeline: MemoryTimeline
    writer: RunWriter | None  # rank 0 only
    phase_seconds: dict[str, float] = field(default_factory=dict)
    logprob_gaps: list[float] = field(default_factory=list)  # per step, the worst over all ranks
    t0: float = field(default_factory=time.monotonic)

    @property
    def rank(self) -> int:
        return self.dims.rank

    @property
    def replica(self) -> int:
        return self.mesh.replica(self.rank)

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        """Time and sample memory around one phase of the step."""
        assert name in PHASES, name
        start = time.monotonic()
        with self.timeline.phase(name, step):
            yield
        self.phase_seconds[name] = time.monotonic() - start

    def offloaded(self, what: str) -> bool:
        """Whether ``actor.offload.<what>`` moves it to host between its uses (``ref_params``: the
        reference actor's params, when there is a reference actor)."""
        if what == "ref_params" and self.ref_actor is None:
            return False
        return bool(getattr(self.cfg.actor.offload, what))

    def sync_weights(self) -> SyncResult:
        """Planned reshard of the actor's shards straight into the engine's (awake) weights."""
        destinations = self.engine.begin_weight_update()
        result = self.weight_sync(self.actor.local_params(), destinations)
        self.engine.finish_weight_update()
        return result


def rollout_groups(mesh: ColocatedMesh) -> list[dist.ProcessGroup]:
    """One process group per engine replica (every rank creates every group, in the same order)."""
    return [dist.new_group(mesh.replica_ranks(i)) for i in range(mesh.num_replicas)]


def setup(cfg: RunConfig, run_dir: Path) -> RankContext:
    from transformers import AutoTokenizer

    from megatron_backend.actor import Actor
    from megatron_backend.parallel import default_device, initialize_model_parallel
    from modelspec.host_memory import configure_host_allocator
    from rollout import make_engine

    mesh = cfg.mesh()
    if default_device().type == "cpu":
        # the process's memory is the device's here: keep it from creeping with allocator fragmentation
        configure_host_allocator()
    dims = initialize_model_parallel(cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, seed=cfg.actor.seed)
    coords = mesh.actor_coords(dims.rank)
    if (coords.tp_rank, coords.pp_rank, coords.dp_rank) != (dims.tp_rank, dims.pp_rank, dims.dp_rank):
        raise RuntimeError("megatron's rank order is not tp-dp-pp; the weight-sync plan would be wrong")
    groups = rollout_groups(mesh)

    probe = MemoryProbe(dims.device)  # after imports and process-group setup: the CPU baseline
    timeline = MemoryTimeline(probe, dims.rank, interval_s=cfg.trainer.memory_sample_interval_s)
    actor = Actor(cfg.model.path, cfg.actor, dims, dtype=cfg.model.dtype)
    ref_actor = None
    if cfg.algorithm.kl_coef > 0:
        ref_actor = Actor(cfg.model.path, cfg.actor, dims, dtype=cfg.model.dtype, train=False)
    engine = make_engine(
        cfg.rollout,
        cfg.model.path,
        group=groups[mesh.replica(dims.rank)] if mesh.rollout_tp > 1 else None,
        device=dims.device,
        dtype=cfg.model.dtype,
        load=False,
    )
    probe.add_ledger(lambda: _tagged(actor.memory(), dims.device))
    probe.add_ledger(lambda: _tagged(engine.memory(), dims.device))
    if ref_actor is not None:
        # the reference actor's params under their own tag (its ledger calls them actor_params)
        probe.add_ledger(lambda: _tagged(ref_actor.memory(), dims.device, rename={"actor_params": "ref_params"}))
        if cfg.actor.offload.ref_params:
            ref_actor.offload("params")  # on host until its first ref_logprob
    weight_sync = cfg.weight_sync.build(
        actor.shape, mesh, dims.rank, dtype=cfg.model.dtype, te_norms=actor.layout.te_norms
    )
    writer = cfg.wandb.build(run_dir, cfg, name=f"{cfg.exp}-{run_dir.name}") if dims.rank == 0 else None
    return RankContext(
        cfg=cfg,
        mesh=mesh,
        dims=dims,
        actor=actor,
        ref_actor=ref_actor,
        engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(cfg.model.path),
        task=cfg.data.build(seed=cfg.trainer.seed),
        loss=PolicyLoss(cfg.algorithm),
        weight_sync=weight_sync,
        timeline=timeline,
        writer=writer,
    )


def _tagged(memory: dict[str, int], device: torch.device, rename: dict[str, str] | None = None) -> dict[str, int]:
    """A side's ``memory()`` -> the timeline's tags (``rename``d first), plus pinned host copies (CUDA only)."""
    rename = rename or {}
    out = {rename.get(k, k): v for k, v in memory.items() if rename.get(k, k) in TAGS}
    if device.type == "cuda":
        out["host_pinned"] = sum(v for k, v in memory.items() if k.startswith("host/"))
    return out
