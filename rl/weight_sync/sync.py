"""The loop's weight sync: plan once at setup, then every step move the actor's shards into the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl.weight_sync.execute import SyncStats, execute_sync
from rl.weight_sync.layouts import actor_sources, engine_destinations
from rl.weight_sync.plan import SyncPlan, plan_sync
from rl.weight_sync.verify import verify_sync


@dataclass
class SyncResult:
    stats: SyncStats
    verified: bool
    num_checked: int


class WeightSync:
    """Plan for (actor TP, PP, VPP) -> (rollout TP, replicas) on ``world_size`` colocated ranks."""

    def __init__(
        self,
        hf_config: Any,
        rank: int,
        world_size: int,
        actor_tp: int,
        actor_pp: int,
        actor_vpp: int | None,
        rollout_tp: int,
        bucket_mb: int,
        element_bytes: int,
        verify: bool,
        te_norms: bool = False,
    ):
        self.rank, self.verify = rank, verify
        sources = actor_sources(hf_config, actor_tp, actor_pp, actor_vpp, world_size, te_norms=te_norms)
        destinations = engine_destinations(hf_config, rollout_tp, world_size)
        self.plan: SyncPlan = plan_sync(sources, destinations, bucket_mb << 20, element_bytes)

    def __call__(
        self, src_tensors: dict, dst_tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None = None
    ) -> SyncResult:
        stats = execute_sync(self.plan, self.rank, src_tensors, dst_tensors, group=group)
        num_checked = verify_sync(self.plan, self.rank, src_tensors, dst_tensors, group=group) if self.verify else 0
        return SyncResult(stats, self.verify, num_checked)
