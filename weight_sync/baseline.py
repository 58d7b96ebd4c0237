"""The peers' weight sync, kept only as the baseline ``make bench-sync`` measures the planned reshard against.

What verl and slime do to hand a Megatron actor's weights to a colocated engine, one megatron parameter
at a time, every rank taking part:

1. within the actor's pipeline group, broadcast the parameter's TP shard from the stage that holds it
   (only when PP > 1): verl ``verl/utils/megatron_utils.py::per_tensor_generator``
   (``broadcast_from_megatron_pp``); slime ``slime/backends/megatron_utils/update_weight_utils.py``
   (``UpdateWeightFromTensor``: "broadcast PP/EP -> gather TP -> convert HF -> send");
2. all-gather the shard within the actor's TP group when it is TP-split (replicated ones, the norms, are
   used as they are) and rebuild the full Hugging Face tensors: verl ``per_tensor_generator`` (TP
   all-gather + ``default_tp_concat_fn``), slime ``all_gather_param`` + ``convert_to_hf``;
3. the engine's own loading of full HF tensors, each rank keeping its slices: vLLM's
   ``model.load_weights`` (verl ``verl/workers/sharding_manager/megatron_vllm.py``,
   ``MegatronVLLMShardingManager.__enter__``: ``model.load_weights(per_tensor_param)``); the native engine's
   equivalent, ``NativeEngine.load_weights`` (``rollout.layout.copy_hf_into_local`` per slice, which is
   what :func:`baseline_sync` does here without an engine).

Nothing crosses a DP replica or goes world-wide. Per rank, bytes received: (PP-1)/PP of the model /TP
(step 1) + (TP-1)/TP of the model (step 2); every rank briefly holds TP shards plus the full tensors of
one parameter. With PP=1 and rollout TP=1 that is what any sync must move (the planned one moves the
same), so that layout shows each path's overhead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_backend.layout import RankLayout, local_param_shapes
from modelspec import ColocatedMesh, ModelShape
from modelspec.family import hf_tensor_shapes
from rollout.layout import copy_hf_into_local, hf_to_vllm_index
from weight_sync.execute import SyncStats
from weight_sync.layouts import actor_sources, engine_destinations


@dataclass
class PeerExport:
    """One rank's view of the peers' export: the layouts of every rank and this rank's TP / PP groups.

    Build it with :func:`make_peer_export` on every rank (it creates process groups: a collective)."""

    rank: int
    mesh: ColocatedMesh
    sources: dict[int, list]  # global rank -> megatron slice pieces it holds
    shard_shapes: dict[int, dict[tuple[int, str], tuple[int, ...]]]  # global rank -> (vp_stage, name) -> shape
    hf_shapes: dict[str, tuple[int, ...]]
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup | None  # None when PP == 1: nothing is broadcast

    def stage_rank(self, tp_rank: int, pp_rank: int) -> int:
        """The global rank holding TP shard ``tp_rank`` of stage ``pp_rank`` in this rank's DP replica."""
        dp_rank = self.mesh.actor_coords(self.rank).dp_rank
        return self.mesh.actor_ranks(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)[0]


def make_peer_export(rank: int, shape: ModelShape, mesh: ColocatedMesh, te_norms: bool = False) -> PeerExport:
    """Every rank creates every actor TP group, then every PP group, in the same order (as megatron's
    ``parallel_state`` does); keeps its own."""
    tp_group = pp_group = None
    for pp_rank in range(mesh.actor_pp):
        for dp_rank in range(mesh.actor_dp):
            members = mesh.actor_ranks(pp_rank=pp_rank, dp_rank=dp_rank)
            group = dist.new_group(members)
            tp_group = group if rank in members else tp_group
    if mesh.actor_pp > 1:
        for dp_rank in range(mesh.actor_dp):
            for tp_rank in range(mesh.actor_tp):
                members = mesh.actor_ranks(tp_rank=tp_rank, dp_rank=dp_rank)
                group = dist.new_group(members)
                pp_group = group if rank in members else pp_group
    shard_shapes = {}
    for r in range(mesh.world_size):
        c = mesh.actor_coords(r)
        layout = RankLayout(mesh.actor_tp, mesh.actor_pp, mesh.actor_vpp, c.tp_rank, c.pp_rank, te_norms=te_norms)
        shard_shapes[r] = local_param_shapes(shape, layout)
    return PeerExport(
        rank,
        mesh,
        actor_sources(shape, mesh, te_norms=te_norms),
        shard_shapes,
        hf_tensor_shapes(shape),
        tp_group,
        pp_group,
    )


@torch.no_grad()
def gather_full_hf_tensors(
    export: PeerExport, src_tensors: dict, device: torch.device, stats: SyncStats
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF tensor, on every rank, one megatron parameter at a time (steps 1 and 2 of the module
    doc). A collective: every rank must consume the whole iterator. ``src_tensors``: (vp_stage, megatron
    name) -> this rank's shard; ``stats.bytes_received`` counts what reached this rank."""
    mesh, rank = export.mesh, export.rank
    my = mesh.actor_coords(rank)
    for pp_rank in range(mesh.actor_pp):
        owner = export.stage_rank(my.tp_rank, pp_rank)  # this rank's TP position on that stage
        # the union over the stage's TP ranks: a TP rank may hold only vocab padding of a tensor
        stage = [export.stage_rank(t, pp_rank) for t in range(mesh.actor_tp)]
        keys = sorted({(p.vp_stage, p.megatron_name) for r in stage for p in export.sources[r] if p.primary})
        for key in keys:
            if pp_rank == my.pp_rank:
                shard = src_tensors[key].contiguous()
            else:
                dtype = next(iter(src_tensors.values())).dtype
                shard = torch.empty(export.shard_shapes[owner][key], dtype=dtype, device=device)
            if export.pp_group is not None:
                dist.broadcast(shard, src=owner, group=export.pp_group)
                if rank != owner:
                    stats.bytes_received += shard.numel() * shard.element_size()
            pieces = [p for r in stage for p in export.sources[r] if (p.vp_stage, p.megatron_name) == key]
            if all(p.transform == "replicate" for p in pieces):
                shards = {owner: shard}  # replicated across TP (norms): nothing to gather
            else:
                gathered = [torch.empty_like(shard) for _ in range(mesh.actor_tp)]
                dist.all_gather(gathered, shard, group=export.tp_group)
                stats.bytes_received += shard.numel() * shard.element_size() * (mesh.actor_tp - 1)
                shards = dict(zip(stage, gathered))
            hf_full: dict[str, torch.Tensor] = {}
            for peer, peer_shard in shards.items():
                for p in export.sources[peer]:
                    if (p.vp_stage, p.megatron_name) != key or not p.primary:
                        continue
                    if p.hf_name not in hf_full:
                        hf_full[p.hf_name] = torch.empty(export.hf_shapes[p.hf_name], dtype=shard.dtype, device=device)
                    hf_full[p.hf_name].narrow(p.dim, p.hf_start, p.length).copy_(
                        peer_shard.narrow(p.dim, p.local_start, p.length)
                    )
            del shards
            yield from hf_full.items()
            del hf_full


@torch.no_grad()
def baseline_sync(
    export: PeerExport, shape: ModelShape, src_tensors: dict, dst_tensors: dict, device: torch.device
) -> SyncStats:
    """:func:`gather_full_hf_tensors`, then each full tensor loaded as the native engine's
    ``load_weights`` does (this rank's slices copied out of it), into ``dst_tensors`` (vLLM name ->
    engine tensor, written in place)."""
    stats = SyncStats()
    start = time.perf_counter()
    targets = hf_to_vllm_index(engine_destinations(shape, export.mesh)[export.rank])
    for name, full in gather_full_hf_tensors(export, src_tensors, device, stats):
        for layout, spec in targets.get(name, []):
            copy_hf_into_local(dst_tensors[layout.name], layout, spec, full)
    stats.seconds = time.perf_counter() - start
    return stats
