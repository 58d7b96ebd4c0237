"""Plan a weight sync: which slice of which actor shard goes to which engine rank (a pure function).

Inputs are the two sides' own layout descriptions, keyed by global rank (the colocated actor rank
and engine rank of one device share a global rank):

- ``sources[rank]``: what the actor rank holds, as megatron slice pieces
  (:class:`megatron_backend.layout.SlicePiece`: ``local[vp_stage][megatron_name].narrow(dim,
  local_start, length) == hf[hf_name].narrow(dim, hf_start, length)``);
- ``destinations[rank]``: what the engine rank needs, as vLLM parameter layouts
  (:class:`rollout.layout.ParamLayout` with ``SliceSpec(hf_name, dim, hf_start, hf_stop, local_start)``; an
  MoE expert's slice lands in ``param[expert]`` of a FusedMoE parameter [E, ...], ``SliceSpec.expert``).

Both sides speak in slices of the full HF tensors along one dim (0 rows, 1 columns), so the layout
transforms (grouped-interleaved QKV -> [q; k; v] with KV-head replication, fc1 [gate; up] ->
gate_up, vocab re-padding, tied embeddings, PP/VPP layer offsets) all reduce to interval
intersections. For each destination slice the planner takes each overlapping interval from the
colocated source rank when it holds it (a local copy, never a message), else from the holder that has
been given the least to send so far (spreading load over DP replicas). Transfers are then packed
first-fit into buckets so that on every rank the bytes it sends plus the bytes it receives in one
bucket stay within ``bucket_bytes``; a transfer larger than a bucket is split along its dim.

What the executor (``execute.py``) stages is decided here too (:func:`is_direct`): a row slice of at least
``DIRECT_MIN_BYTES`` is contiguous on both sides and goes from the actor shard straight into the engine
parameter; every other cross-rank transfer is packed into one send buffer per peer and arrives in one
receive buffer per peer. :meth:`SyncPlan.staged_bytes` is what one rank allocates for one bucket, the
number the memory planner plans the weight_sync phase with (``run/memory_plan.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# a row (dim 0) transfer of at least this many bytes is sent from the shard and received into the engine
# parameter as it is (both contiguous); smaller ones and column slices are packed per peer (staged)
DIRECT_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Transfer:
    """``dst[dst_name].narrow(dim, dst_start, length) <- src[src_key].narrow(dim, src_start, length)``; with a
    ``dst_expert``, into ``dst[dst_name][dst_expert]`` (one routed expert of a FusedMoE parameter)."""

    src_rank: int
    dst_rank: int
    hf_name: str
    src_key: tuple[int, str]  # (vp_stage, megatron name)
    dst_name: str  # vLLM name
    dim: int
    src_start: int
    dst_start: int
    length: int
    numel: int  # length x the other dims
    dst_expert: int | None = None

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass
class SyncPlan:
    """Transfers grouped into buckets; ``bytes_moved`` counts only what crosses ranks."""

    transfers: list[Transfer]
    buckets: list[list[Transfer]]
    bucket_bytes: int
    element_bytes: int
    world_size: int
    dst_numel: dict[tuple[int, str], int] = field(default_factory=dict)

    @property
    def bytes_moved(self) -> int:
        return sum(t.numel for t in self.transfers if not t.is_local) * self.element_bytes

    @property
    def bytes_local(self) -> int:
        return sum(t.numel for t in self.transfers if t.is_local) * self.element_bytes

    def bucket_extra_bytes(self, bucket: Sequence[Transfer], rank: int) -> int:
        """Staging bytes ``rank`` needs for one bucket: what it packs to send plus what it receives."""
        return self.element_bytes * sum(t.numel for t in bucket if not t.is_local and rank in (t.src_rank, t.dst_rank))

    def max_extra_bytes(self) -> int:
        return max((self.bucket_extra_bytes(b, r) for b in self.buckets for r in range(self.world_size)), default=0)

    def staged_bytes(self, bucket: Sequence[Transfer], rank: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> int:
        """What the executor allocates on ``rank`` for one bucket: the packed send buffers (what it sends that
        is not direct) plus the packed receive buffers (what it receives that is not direct). Direct transfers
        and local copies move between the shard and the engine parameter with no buffer."""
        return self.element_bytes * sum(
            t.numel
            for t in bucket
            if not t.is_local
            and rank in (t.src_rank, t.dst_rank)
            and not is_direct(t, self.element_bytes, direct_min_bytes)
        )

    def max_staged_bytes(self, ranks: Sequence[int] | None = None, direct_min_bytes: int = DIRECT_MIN_BYTES) -> int:
        """The most any of ``ranks`` (None: every rank) stages in one bucket (the executor's peak beyond the
        tensors: one bucket's buffers at a time)."""
        ranks = range(self.world_size) if ranks is None else ranks
        return max((self.staged_bytes(b, r, direct_min_bytes) for b in self.buckets for r in ranks), default=0)


def is_direct(t: Transfer, element_bytes: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> bool:
    """Large row slices are contiguous on both sides: sent from the shard and received into the engine
    parameter as they are, with no staging copy. Everything else is packed per peer."""
    return t.dim == 0 and t.numel * element_bytes >= direct_min_bytes


def _split(transfer: Transfer, max_numel: int) -> list[Transfer]:
    """Cut a transfer along its dim into pieces of at most ``max_numel`` elements."""
    per_index = transfer.numel // transfer.length  # elements of one row / column
    if per_index > max_numel:
        raise ValueError(
            f"weight_sync.bucket_mb is smaller than one {'row' if transfer.dim == 0 else 'column'} of "
            f"{transfer.hf_name} ({per_index} elements); raise weight_sync.bucket_mb"
        )
    step = max_numel // per_index
    out = []
    for offset in range(0, transfer.length, step):
        n = min(step, transfer.length - offset)
        out.append(
            Transfer(
                transfer.src_rank,
                transfer.dst_rank,
                transfer.hf_name,
                transfer.src_key,
                transfer.dst_name,
                transfer.dim,
                transfer.src_start + offset,
                transfer.dst_start + offset,
                n,
                n * per_index,
                transfer.dst_expert,
            )
        )
    return out


def slice_numel_per_index(param: Any, spec: Any) -> int:
    """Elements of one index of ``spec``'s dim in the block it fills (an expert's slice: in ``param[expert]``)."""
    shape = param.local_shape[1:] if spec.expert is not None else param.local_shape
    return math.prod(s for i, s in enumerate(shape) if i != spec.dim)


def plan_sync(
    sources: dict[int, Sequence[Any]],
    destinations: dict[int, Sequence[Any]],
    bucket_bytes: int,
    element_bytes: int,
) -> SyncPlan:
    """Every destination slice, matched to source slices; see the module doc. Raises if something is missing."""
    if bucket_bytes < element_bytes:
        raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than one element ({element_bytes} bytes)")
    world_size = max([*sources, *destinations]) + 1
    # hf_name -> [(rank, piece)] of every source interval
    holders: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for rank, pieces in sources.items():
        for piece in pieces:
            holders[piece.hf_name].append((rank, piece))
    send_load = defaultdict(int)
    transfers: list[Transfer] = []
    dst_numel: dict[tuple[int, str], int] = {}
    for dst_rank in sorted(destinations):
        for param in destinations[dst_rank]:
            dst_numel[(dst_rank, param.name)] = math.prod(param.local_shape)
            for spec in param.slices:
                per_index = slice_numel_per_index(param, spec)
                transfers += _cover(spec, param.name, dst_rank, per_index, holders.get(spec.hf_name, []), send_load)
    max_numel = bucket_bytes // element_bytes
    pieces: list[Transfer] = []
    for t in transfers:
        pieces += _split(t, max_numel) if not t.is_local and t.numel > max_numel else [t]
    return SyncPlan(pieces, _pack(pieces, max_numel), bucket_bytes, element_bytes, world_size, dst_numel)


def _cover(spec, dst_name: str, dst_rank: int, per_index: int, candidates, send_load) -> list[Transfer]:
    """Cover the HF interval [spec.hf_start, spec.hf_stop) of one destination slice with source intervals."""
    out: list[Transfer] = []
    start, stop = spec.hf_start, spec.hf_stop
    while start < stop:
        # all source intervals containing `start`, on the same dim
        here = [
            (rank, p) for rank, p in candidates if p.dim == spec.dim and p.hf_start <= start < p.hf_start + p.length
        ]
        if not here:
            raise ValueError(
                f"no actor rank holds {spec.hf_name}[dim {spec.dim}, index {start}] needed by engine rank "
                f"{dst_rank} for {dst_name}; the two layouts disagree"
            )
        local = [(rank, p) for rank, p in here if rank == dst_rank]
        rank, piece = local[0] if local else min(here, key=lambda rp: (send_load[rp[0]], rp[0]))
        end = min(stop, piece.hf_start + piece.length)
        length = end - start
        if rank != dst_rank:
            send_load[rank] += length * per_index
        out.append(
            Transfer(
                src_rank=rank,
                dst_rank=dst_rank,
                hf_name=spec.hf_name,
                src_key=(piece.vp_stage, piece.megatron_name),
                dst_name=dst_name,
                dim=spec.dim,
                src_start=piece.local_start + (start - piece.hf_start),
                dst_start=spec.local_start + (start - spec.hf_start),
                length=length,
                numel=length * per_index,
                dst_expert=spec.expert,
            )
        )
        start = end
    return out


def _pack(transfers: list[Transfer], max_numel: int) -> list[list[Transfer]]:
    """First-fit: each message goes to the first bucket where both its ranks still have room."""
    buckets: list[list[Transfer]] = []
    load: list[dict[int, int]] = []  # per bucket: rank -> numel staged (sent + received)
    local: list[Transfer] = []
    for t in transfers:
        if t.is_local:
            local.append(t)
            continue
        for bucket, used in zip(buckets, load):  # noqa: B007 (used after the loop)
            if used[t.src_rank] + t.numel <= max_numel and used[t.dst_rank] + t.numel <= max_numel:
                break
        else:
            bucket, used = [], defaultdict(int)
            buckets.append(bucket)
            load.append(used)
        bucket.append(t)
        used[t.src_rank] += t.numel
        used[t.dst_rank] += t.numel
    if not buckets:
        buckets.append([])
    buckets[0][:0] = local  # local copies need no staging; do them with the first bucket
    return buckets


def min_sync_bytes(
    sources: dict[int, Sequence[Any]], destinations: dict[int, Sequence[Any]], element_bytes: int
) -> int:
    """The least any correct sync must move: every destination element its colocated actor rank lacks.

    Computed straight from the layouts by interval arithmetic, independently of :func:`plan_sync`.
    """
    total = 0
    for rank, params in destinations.items():
        held: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
        for p in sources.get(rank, []):
            held[(p.hf_name, p.dim)].append((p.hf_start, p.hf_start + p.length))
        for param in params:
            for spec in param.slices:
                per_index = slice_numel_per_index(param, spec)
                covered = _union_length(held.get((spec.hf_name, spec.dim), []), spec.hf_start, spec.hf_stop)
                total += (spec.hf_stop - spec.hf_start - covered) * per_index
    return total * element_bytes


def _union_length(intervals: list[tuple[int, int]], start: int, stop: int) -> int:
    clipped = sorted((max(a, start), min(b, stop)) for a, b in intervals if a < stop and b > start)
    length, reach = 0, start
    for a, b in clipped:
        if b > reach:
            length += b - max(a, reach)
            reach = b
    return length
