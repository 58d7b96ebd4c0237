"""The usual weight sync, kept only as a baseline to measure against (``make bench-sync``).

Per megatron parameter: all-gather it across the actor's TP group, rebuild the full HF tensors it
holds, broadcast each from its pipeline stage to every rank, and let every engine rank slice its
part (or, for vLLM, hand the full tensors to the model's own ``load_weights``, as verl and slime do).
Every rank briefly holds TP x its shard plus full HF tensors, and every byte of every tensor reaches
every rank.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist

from modelspec import ColocatedMesh
from rl.weight_sync.execute import SyncStats


@torch.no_grad()
def gather_full_hf_tensors(
    rank: int,
    sources: dict[int, list],
    hf_shapes: dict[str, tuple[int, ...]],
    tp_members: dict[int, list[int]],
    tp_group: dist.ProcessGroup,
    src_tensors: dict,
    dtype: torch.dtype,
    device: torch.device,
    stats: SyncStats,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF tensor on every rank, one megatron parameter at a time (what verl and slime hand
    their engine): all-gather the parameter over the actor's TP group, rebuild the HF tensors it holds,
    broadcast each from its pipeline stage. A collective: every rank must consume the whole iterator.
    ``stats`` collects bytes received and the largest staging footprint; ``tp_members[r]``: the ranks of
    rank r's actor TP group (every rank knows every group's members); ``tp_group``: this rank's own."""
    # owner of each megatron param: the lowest rank of the stage holding it; its TP peers hold the other shards
    params_by_owner: dict[tuple[int, str], list[int]] = defaultdict(list)
    for r, pieces in sources.items():
        for key in dict.fromkeys((p.vp_stage, p.megatron_name) for p in pieces if p.primary):
            params_by_owner[key].append(r)
    for key, holder_ranks in sorted(params_by_owner.items()):
        for stage_ranks in _stages(key, holder_ranks, sources, tp_members):
            owner = stage_ranks[0]
            extra = 0
            hf_full: dict[str, torch.Tensor] = {}
            hf_names = sorted(
                {
                    p.hf_name
                    for m in stage_ranks
                    for p in sources[m]
                    if (p.vp_stage, p.megatron_name) == key and p.primary
                }
            )
            if rank in stage_ranks:
                local = src_tensors[key]
                gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(gathered, local.contiguous(), group=tp_group)
                stats.bytes_received += local.numel() * local.element_size() * (len(gathered) - 1)
                extra += sum(g.numel() * g.element_size() for g in gathered)
                for name in hf_names:
                    hf_full[name] = torch.zeros(hf_shapes[name], dtype=local.dtype, device=device)
                for peer, shard in zip(tp_members[rank], gathered):
                    for p in sources[peer]:
                        if (p.vp_stage, p.megatron_name) == key and p.hf_name in hf_full:
                            hf_full[p.hf_name].narrow(p.dim, p.hf_start, p.length).copy_(
                                shard.narrow(p.dim, p.local_start, p.length)
                            )
                del gathered
            for name in hf_names:
                if name not in hf_full:
                    hf_full[name] = torch.empty(hf_shapes[name], dtype=dtype, device=device)
                dist.broadcast(hf_full[name], src=owner)
                if rank != owner:
                    stats.bytes_received += hf_full[name].numel() * hf_full[name].element_size()
                extra += hf_full[name].numel() * hf_full[name].element_size()
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
            yield from hf_full.items()
            del hf_full


@torch.no_grad()
def baseline_sync(
    rank: int,
    sources: dict[int, list],
    destinations: dict[int, list],
    hf_shapes: dict[str, tuple[int, ...]],
    tp_members: dict[int, list[int]],
    tp_group: dist.ProcessGroup,
    src_tensors: dict,
    dst_tensors: dict,
    dtype: torch.dtype,
    device: torch.device,
) -> SyncStats:
    """:func:`gather_full_hf_tensors`, then every engine rank slices its part of each full tensor.
    ``sources``/``destinations`` as for :func:`plan_sync`."""
    stats = SyncStats()
    start = time.perf_counter()
    needs = defaultdict(list)  # hf_name -> this rank's (param, spec)
    for param in destinations[rank]:
        for spec in param.slices:
            needs[spec.hf_name].append((param, spec))
    full_tensors = gather_full_hf_tensors(
        rank, sources, hf_shapes, tp_members, tp_group, src_tensors, dtype, device, stats
    )
    for name, full in full_tensors:
        for param, spec in needs.get(name, []):
            dst_tensors[param.name].narrow(spec.dim, spec.local_start, spec.length).copy_(
                full.narrow(spec.dim, spec.hf_start, spec.length)
            )
    stats.seconds = time.perf_counter() - start
    stats.num_messages = dist.get_world_size()  # not meaningful for collectives; kept for the stats shape
    return stats


def _stages(key, ranks: list[int], sources: dict, tp_members: dict) -> list[list[int]]:
    """The TP groups holding megatron param ``key``, one per distinct set of HF tensors (= pipeline stage).

    ``key`` is a local name, so it occurs on every stage; DP replicas of a stage hold identical shards
    and only the first replica's TP group gathers and broadcasts.
    """
    stages: dict[frozenset, list[int]] = {}
    for r in sorted(ranks):
        members = sorted(tp_members[r])
        names = frozenset(
            p.hf_name for m in members for p in sources[m] if (p.vp_stage, p.megatron_name) == key and p.primary
        )
        stages.setdefault(names, members)
    return list(stages.values())


def make_actor_tp_groups(rank: int, mesh: ColocatedMesh) -> tuple[dict[int, list[int]], dist.ProcessGroup]:
    """The actor's TP groups for :func:`baseline_sync`: every rank creates every group, in the same order.

    Returns ``tp_members`` (rank -> the ranks of its TP group) and this rank's own group.
    """
    tp_members, own = {}, None
    for pp_rank in range(mesh.actor_pp):
        for dp_rank in range(mesh.actor_dp):
            members = mesh.actor_ranks(pp_rank=pp_rank, dp_rank=dp_rank)
            group = dist.new_group(members)
            tp_members.update({m: members for m in members})
            own = group if rank in members else own
    return tp_members, own
