"""The loop's weight sync: plan once at setup, then every step move the actor's shards into the engine.

sync = WeightSyncConfig(bucket_mb=512).build(shape, mesh, rank, dtype="bfloat16")
dst = engine.begin_weight_update()
result = sync(actor.local_params(), dst)
engine.finish_weight_update()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelspec import ColocatedMesh, ModelShape, element_bytes
from weight_sync.execute import SyncStats, execute_sync
from weight_sync.layouts import actor_sources, engine_destinations
from weight_sync.transfers import SyncPlan, plan_sync
from weight_sync.transport import TorchP2PTransport, Transport
from weight_sync.verify import verify_sync


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Actor -> engine weight resharding (``weight_sync.*``)."""

    bucket_mb: int = 512  # bytes each rank sends + receives per bucket, in MiB
    verify: bool = False  # bit-level checksums of every slice on both sides after each sync

    def __post_init__(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb={self.bucket_mb} must be >= 1 (MiB per bucket), e.g. 512")

    def build(
        self,
        shape: ModelShape,
        mesh: ColocatedMesh,
        rank: int,
        dtype: str,
        te_norms: bool = False,
        transport: Transport | None = None,
    ) -> WeightSync:
        """Plan the sync for this model on this mesh (every rank plans the same, no communication)."""
        sources = actor_sources(shape, mesh, te_norms=te_norms)
        plan = plan_sync(sources, engine_destinations(shape, mesh), self.bucket_mb << 20, element_bytes(dtype))
        return WeightSync(plan, rank, verify=self.verify, transport=transport or TorchP2PTransport())


@dataclass
class SyncResult:
    stats: SyncStats
    verified: bool
    num_checked: int


class WeightSync:
    """A planned sync for one rank: ``sync(src_tensors, dst_tensors) -> SyncResult``."""

    def __init__(self, plan: SyncPlan, rank: int, verify: bool, transport: Transport):
        self.plan, self.rank, self.verify, self.transport = plan, rank, verify, transport

    def __call__(self, src_tensors: dict, dst_tensors: dict[str, torch.Tensor]) -> SyncResult:
        """``src_tensors``: (vp_stage, megatron name) -> actor shard; ``dst_tensors``: vLLM name -> engine
        tensor (written in place)."""
        stats = execute_sync(self.plan, self.rank, src_tensors, dst_tensors, transport=self.transport)
        num_checked = verify_sync(self.plan, self.rank, src_tensors, dst_tensors) if self.verify else 0
        return SyncResult(stats, self.verify, num_checked)
