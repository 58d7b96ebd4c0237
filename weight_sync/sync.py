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
from weight_sync.reference import ReferenceCheck, host_group, sample_names
from weight_sync.transfers import SyncPlan, plan_sync
from weight_sync.transport import TorchP2PTransport, Transport
from weight_sync.verify import verify_sync


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Actor -> engine weight resharding (``weight_sync.*``)."""

    bucket_mb: int = 512  # bytes each rank sends + receives per bucket, in MiB
    verify: bool = False  # bit-level checksums of every slice on both sides after each sync
    # every check_every-th sync (the first included): one layer's engine slices against the actor's own full
    # tensors (weight_sync/reference.py), independent of the plan; a mismatch stops the run. 0: never
    check_every: int = 1

    def __post_init__(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb={self.bucket_mb} must be >= 1 (MiB per bucket), e.g. 512")
        if self.check_every < 0:
            raise ValueError(f"weight_sync.check_every={self.check_every} must be >= 0 (0: no reference check)")

    def build(
        self,
        shape: ModelShape,
        mesh: ColocatedMesh,
        rank: int,
        dtype: str,
        te_norms: bool = False,
        transport: Transport | None = None,
    ) -> WeightSync:
        """Plan the sync for this model on this mesh (every rank plans the same; collective only where the
        reference check needs its gloo group, :func:`weight_sync.reference.host_group`)."""
        sources = actor_sources(shape, mesh, te_norms=te_norms)
        plan = plan_sync(sources, engine_destinations(shape, mesh), self.bucket_mb << 20, element_bytes(dtype))
        reference = ReferenceCheck(shape, mesh, te_norms, host_group()) if self.check_every else None
        return WeightSync(
            plan,
            rank,
            verify=self.verify,
            transport=transport or TorchP2PTransport(),
            reference=reference,
            check_every=self.check_every,
        )


@dataclass
class SyncResult:
    stats: SyncStats
    verified: bool
    num_checked: int
    num_reference_checked: int = 0  # engine slices compared with the actor's full tensors (this rank)
    reference_layer: int = -1  # the layer the reference check sampled (with 0: the vocab tensors too); -1: none


class WeightSync:
    """A planned sync for one rank: ``sync(src_tensors, dst_tensors) -> SyncResult``."""

    def __init__(
        self,
        plan: SyncPlan,
        rank: int,
        verify: bool,
        transport: Transport,
        reference: ReferenceCheck | None = None,
        check_every: int = 1,
    ):
        self.plan, self.rank, self.verify, self.transport = plan, rank, verify, transport
        self.reference, self.check_every, self.num_syncs = reference, check_every, 0

    def __call__(self, src_tensors: dict, dst_tensors: dict[str, torch.Tensor]) -> SyncResult:
        """``src_tensors``: (vp_stage, megatron name) -> actor shard; ``dst_tensors``: vLLM name -> engine
        tensor (written in place)."""
        stats = execute_sync(self.plan, self.rank, src_tensors, dst_tensors, transport=self.transport)
        num_checked = verify_sync(self.plan, self.rank, src_tensors, dst_tensors) if self.verify else 0
        num_reference, layer = 0, -1
        if self.reference is not None and self.num_syncs % self.check_every == 0:
            # before the caller's finish_weight_update: vLLM's CPU build repacks the tensors there
            check = self.num_syncs // self.check_every
            names = sample_names(self.reference.shape, check)
            num_reference = self.reference(self.rank, src_tensors, dst_tensors, names)
            layer = check % self.reference.shape.num_layers
        self.num_syncs += 1
        return SyncResult(stats, self.verify, num_checked, num_reference, layer)
