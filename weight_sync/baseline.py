"""The peers' weight sync, kept only as the baseline ``make bench-sync`` measures the planned reshard against.

What verl, slime and NeMo-RL do to hand a Megatron actor's weights to a colocated engine, one megatron
parameter at a time, every rank taking part:

1. within the actor's pipeline group, broadcast the parameter's shard from the stage that holds it
   (only when PP > 1): verl ``verl/utils/megatron_utils.py::per_tensor_generator``
   (``broadcast_from_megatron_pp``); slime ``slime/backends/megatron_utils/update_weight/
   hf_weight_iterator_direct.py::_get_megatron_full_params`` ("broadcast params across pp ranks");
2. a routed expert's parameter (MoE): every EP rank's copy of it (the same local expert index, another
   global expert) gathered over the EP group, then each expert's expert-TP shards over the expert-TP group,
   so every rank ends with every expert of the layer: verl ``per_tensor_generator`` (``# EP``:
   ``all_gather(infer_params, broad_pp_tensor, group=ep_group)`` then ``# gather etp`` when etp > 1);
   slime ``_get_megatron_full_params`` ("broadcast params across ep ranks" from each expert's owner) then
   ``update_weight/common.py::all_gather_params_async`` on the expert-TP group for ``.experts.``, and
   ``update_weight_from_distributed.py::_update_expert_bucket_weights_from_distributed`` ("Gather EP");
   NeMo-RL's colocated refit streams ``megatron_bridge.export_hf_weights``
   (``nemo_rl/models/policy/workers/megatron_policy_worker.py``), whose expert mappings call Megatron-Bridge's
   ``models/conversion/param_mapping.py::MegatronParamMapping.gather_from_ep_ranks``. Here: one all-gather over
   the expert-TP x EP group of this rank's stage and expert-DP replica (the same bytes as verl's two nested
   gathers: EP x expert TP - 1 shards);
3. any other parameter: all-gather of its TP shard within the actor's TP group when it is TP-split (replicated
   ones, the norms and the router, are used as they are) and rebuild the full Hugging Face tensors: verl
   ``per_tensor_generator`` (TP all-gather + ``default_tp_concat_fn``), slime ``all_gather_param`` +
   ``convert_to_hf``;
4. the engine's own loading of full HF tensors, each rank keeping its slices: vLLM's
   ``model.load_weights`` (verl ``verl/workers/sharding_manager/megatron_vllm.py``,
   ``MegatronVLLMShardingManager.__enter__``: ``model.load_weights(per_tensor_param)``); the native engine's
   equivalent, ``NativeEngine.load_weights`` (``rollout.layout.copy_hf_into_local`` per slice, which is
   what :func:`baseline_sync` does here without an engine).

Nothing crosses a DP (or expert-DP) replica or goes world-wide. Per rank, bytes received: (PP-1)/PP of the
model's shard (step 1) + (EP x ETP - 1)/(EP x ETP) of the routed experts + (TP-1)/TP of the rest (steps 2, 3):
every rank receives every expert. Every rank briefly holds the shards plus the full tensors of one megatron
parameter (for an expert: EP experts). With PP=1, EP=1 and rollout TP=1 that is what any sync must move (the
planned one moves the same), so that layout shows each path's overhead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_backend.layout import local_param_shapes
from modelspec import ColocatedMesh, ModelShape
from modelspec.family import hf_tensor_shapes
from rollout.layout import copy_hf_into_local, hf_to_vllm_index
from weight_sync.execute import SyncStats
from weight_sync.layouts import actor_rank_layout, actor_sources, engine_destinations


def is_expert_param(megatron_name: str) -> bool:
    """A routed expert's parameter (held per EP rank); the router (``mlp.router``) is not one."""
    return ".mlp.experts." in megatron_name


@dataclass
class PeerExport:
    """One rank's view of the peers' export: the layouts of every rank and this rank's TP / expert / PP groups.

    Build it with :func:`make_peer_export` on every rank (it creates process groups: a collective)."""

    rank: int
    mesh: ColocatedMesh
    sources: dict[int, list]  # global rank -> megatron slice pieces it holds
    shard_shapes: dict[int, dict[tuple[int, str], tuple[int, ...]]]  # global rank -> (vp_stage, name) -> shape
    hf_shapes: dict[str, tuple[int, ...]]
    tp_group: dist.ProcessGroup | None = None  # None: layouts only (peer_export_layout)
    expert_group: dist.ProcessGroup | None = None  # expert TP x EP of this stage and expert-DP replica; None: dense
    pp_group: dist.ProcessGroup | None = None  # None when PP == 1: nothing is broadcast
    # (rank, (vp_stage, megatron name)) -> primary pieces, built on first use from ``sources``
    piece_index: dict[tuple[int, tuple[int, str]], list] = field(default_factory=dict, repr=False)

    def pieces(self, rank: int, key: tuple[int, str]) -> list:
        """The primary pieces of ``rank``'s shard ``key`` (indexed once: a model has thousands of both)."""
        if not self.piece_index:
            for r, pieces in self.sources.items():
                for p in pieces:
                    if p.primary:
                        self.piece_index.setdefault((r, (p.vp_stage, p.megatron_name)), []).append(p)
        return self.piece_index.get((rank, key), [])

    @property
    def stage_size(self) -> int:
        return self.mesh.actor_tp * self.mesh.actor_dp

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank at this rank's place within a stage (same TP, DP, EP, expert-TP ranks) on ``pp_rank``."""
        return pp_rank * self.stage_size + self.rank % self.stage_size

    def tp_peers(self, pp_rank: int) -> list[int]:
        """This rank's TP group, moved to stage ``pp_rank`` (global ranks in group order)."""
        tp = self.mesh.actor_tp
        first = self.stage_rank(pp_rank) // tp * tp
        return list(range(first, first + tp))

    def expert_peers(self, pp_rank: int) -> list[int]:
        """This rank's expert-TP x EP group (etp fastest, then ep: megatron's order), moved to stage ``pp_rank``."""
        size = self.mesh.actor_expert_tp * self.mesh.actor_ep
        first = self.stage_rank(pp_rank) // size * size
        return list(range(first, first + size))

    def steps(self) -> Iterator[tuple[int, tuple[int, str], list[int], bool]]:
        """What the export does, in order, the same on every rank: (stage, (vp_stage, megatron name), the global
        ranks on that stage whose shards make the full tensors, whether they are all-gathered: False for a
        parameter replicated across TP, the norms and the router; a routed expert is always gathered)."""
        size = self.stage_size
        for pp_rank in range(self.mesh.actor_pp):
            stage = range(pp_rank * size, (pp_rank + 1) * size)
            # the union over the stage's ranks: a TP rank may hold only vocab padding of a tensor
            keys = sorted({(p.vp_stage, p.megatron_name) for r in stage for p in self.sources[r] if p.primary})
            for key in keys:
                if is_expert_param(key[1]) and self.mesh.actor_expert_tp * self.mesh.actor_ep > 1:
                    yield pp_rank, key, self.expert_peers(pp_rank), True
                    continue
                peers = self.tp_peers(pp_rank)
                pieces = [p for r in peers for p in self.pieces(r, key)]
                gathered = len(peers) > 1 and not all(p.transform == "replicate" for p in pieces)
                yield pp_rank, key, peers if gathered else [self.stage_rank(pp_rank)], gathered

    def bytes_received(self, element_bytes: int) -> int:
        """What :func:`gather_full_hf_tensors` receives on this rank per sync, from the layouts alone (no tensors,
        no process group): the PP broadcasts' shards from other stages plus the all-gathers' other shards."""
        my_pp_rank = self.mesh.actor_coords(self.rank).pp_rank
        total = 0
        for pp_rank, key, peers, _ in self.steps():
            numel = math.prod(self.shard_shapes[self.stage_rank(pp_rank)][key])
            total += numel * ((pp_rank != my_pp_rank) + len(peers) - 1)
        return total * element_bytes


def peer_export_layout(rank: int, shape: ModelShape, mesh: ColocatedMesh, te_norms: bool = False) -> PeerExport:
    """The export's layouts for ``rank`` without process groups (enough for :meth:`PeerExport.bytes_received`)."""
    return PeerExport(
        rank,
        mesh,
        actor_sources(shape, mesh, te_norms=te_norms),
        {r: local_param_shapes(shape, actor_rank_layout(mesh, r, te_norms)) for r in range(mesh.world_size)},
        hf_tensor_shapes(shape),
    )


def make_peer_export(rank: int, shape: ModelShape, mesh: ColocatedMesh, te_norms: bool = False) -> PeerExport:
    """Every rank creates every actor TP group, then every expert TP x EP group (MoE), then every PP group, in
    the same order (as megatron's ``parallel_state`` does); keeps its own."""
    tp_group = expert_group = pp_group = None
    stage_size = mesh.actor_tp * mesh.actor_dp
    for pp_rank in range(mesh.actor_pp):
        for dp_rank in range(mesh.actor_dp):
            members = mesh.actor_ranks(pp_rank=pp_rank, dp_rank=dp_rank)
            group = dist.new_group(members)
            tp_group = group if rank in members else tp_group
    expert_size = mesh.actor_expert_tp * mesh.actor_ep
    if shape.is_moe and expert_size > 1:
        for first in range(0, mesh.world_size, expert_size):  # contiguous: etp fastest, then ep
            members = list(range(first, first + expert_size))
            group = dist.new_group(members)
            expert_group = group if rank in members else expert_group
    if mesh.actor_pp > 1:
        for in_stage in range(stage_size):
            members = list(range(in_stage, mesh.world_size, stage_size))
            group = dist.new_group(members)
            pp_group = group if rank in members else pp_group
    export = peer_export_layout(rank, shape, mesh, te_norms)
    export.tp_group, export.expert_group, export.pp_group = tp_group, expert_group, pp_group
    return export


@torch.no_grad()
def gather_full_hf_tensors(
    export: PeerExport, src_tensors: dict, device: torch.device, stats: SyncStats
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF tensor, on every rank, one megatron parameter at a time (steps 1 to 3 of the module
    doc). A collective: every rank must consume the whole iterator. ``src_tensors``: (vp_stage, megatron
    name) -> this rank's shard; ``stats.bytes_received`` counts what reached this rank."""
    rank = export.rank
    my_pp_rank = export.mesh.actor_coords(rank).pp_rank
    dtype = next(iter(src_tensors.values())).dtype
    for pp_rank, key, peers, gathered in export.steps():
        owner = export.stage_rank(pp_rank)  # this rank's place on that stage
        if pp_rank == my_pp_rank:
            shard = src_tensors[key].contiguous()
        else:
            shard = torch.empty(export.shard_shapes[owner][key], dtype=dtype, device=device)
        if export.pp_group is not None:
            dist.broadcast(shard, src=owner, group=export.pp_group)
            if rank != owner:
                stats.bytes_received += shard.numel() * shard.element_size()
        if gathered:
            shards = [torch.empty_like(shard) for _ in peers]
            dist.all_gather(shards, shard, group=export.expert_group if is_expert_param(key[1]) else export.tp_group)
            stats.bytes_received += shard.numel() * shard.element_size() * (len(peers) - 1)
        else:
            shards = [shard]
        hf_full: dict[str, torch.Tensor] = {}
        for peer, peer_shard in zip(peers, shards):
            for p in export.pieces(peer, key):
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
