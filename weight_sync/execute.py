"""Run a :class:`SyncPlan` over torch.distributed, bucket by bucket, writing engine weights in place.

Per bucket, each rank packs what it sends to one peer into one flat buffer (one message per peer),
posts its receives, copies its local slices straight from the actor shard into the engine parameter,
then unpacks what arrived. Nothing beyond one bucket's staging buffers is ever allocated, and those
are freed before the next bucket starts (``peak_extra_bytes`` reports the high-water mark).

Bytes move through a :class:`~weight_sync.transport.Transport` (``transport=``; default
torch.distributed point-to-point, gloo on CPU and NCCL on GPU): the executor only submits sends and
receives per bucket and runs them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from weight_sync.transfers import DIRECT_MIN_BYTES, SyncPlan, Transfer, is_direct
from weight_sync.transport import TorchP2PTransport, Transport


@dataclass
class SyncStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0
    num_buckets: int = 0
    num_messages: int = 0
    # packed into (and unpacked from) staging buffers: what is neither local nor a direct transfer
    bytes_staged_sent: int = 0
    bytes_staged_received: int = 0


def _src_view(src: dict, t: Transfer) -> torch.Tensor:
    return src[t.src_key].narrow(t.dim, t.src_start, t.length)


def dst_view(dst: dict, t: Transfer) -> torch.Tensor:
    """The block of the engine parameter ``t`` writes (in ``[dst_expert]`` of a FusedMoE parameter)."""
    param = dst[t.dst_name] if t.dst_expert is None else dst[t.dst_name][t.dst_expert]
    return param.narrow(t.dim, t.dst_start, t.length)


@torch.no_grad()
def execute_sync(
    plan: SyncPlan,
    rank: int,
    src_tensors: dict[tuple[int, str], torch.Tensor],
    dst_tensors: dict[str, torch.Tensor],
    transport: Transport | None = None,
    device: torch.device | None = None,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> SyncStats:
    """Move this rank's part of ``plan``. ``src_tensors``: (vp_stage, megatron name) -> local shard;
    ``dst_tensors``: vLLM name -> engine parameter (written in place). Both sides must use the same
    dtype (the plan's ``element_bytes``); cast the actor's export first if they differ."""
    transport = transport or TorchP2PTransport()
    device = device or next(iter(dst_tensors.values())).device
    dtype = next(iter(src_tensors.values())).dtype if src_tensors else next(iter(dst_tensors.values())).dtype
    for tensors in (src_tensors, dst_tensors):
        for name, tensor in tensors.items():
            if tensor.element_size() != plan.element_bytes or not tensor.is_contiguous():
                raise ValueError(f"weight sync: {name} must be contiguous with {plan.element_bytes}-byte elements")
    stats = SyncStats()
    start = time.perf_counter()
    for bucket in plan.buckets:
        sends: dict[int, list[Transfer]] = defaultdict(list)
        recvs: dict[int, list[Transfer]] = defaultdict(list)
        for t in bucket:
            if t.is_local:
                if t.dst_rank == rank:
                    dst_view(dst_tensors, t).copy_(_src_view(src_tensors, t))
                    stats.bytes_local += t.numel * plan.element_bytes
            elif t.src_rank == rank:
                sends[t.dst_rank].append(t)
            elif t.dst_rank == rank:
                recvs[t.src_rank].append(t)
        # Per peer, in plan order on both sides: one packed message (if any), then the direct ones.
        unpack, extra = [], 0
        for peer in sorted(sends):
            packed = [t for t in sends[peer] if not is_direct(t, plan.element_bytes, direct_min_bytes)]
            if packed:
                buffer = torch.empty(sum(t.numel for t in packed), dtype=dtype, device=device)
                offset = 0
                for t in packed:
                    view = _src_view(src_tensors, t)
                    buffer[offset : offset + t.numel].view(view.shape).copy_(view)
                    offset += t.numel
                extra += buffer.numel() * buffer.element_size()
                stats.bytes_staged_sent += buffer.numel() * buffer.element_size()
                transport.submit_send(buffer, peer)
            for t in sends[peer]:
                if is_direct(t, plan.element_bytes, direct_min_bytes):
                    transport.submit_send(_src_view(src_tensors, t), peer)
            stats.bytes_sent += sum(t.numel for t in sends[peer]) * plan.element_bytes
        for peer in sorted(recvs):
            packed = [t for t in recvs[peer] if not is_direct(t, plan.element_bytes, direct_min_bytes)]
            if packed:
                buffer = torch.empty(sum(t.numel for t in packed), dtype=dtype, device=device)
                extra += buffer.numel() * buffer.element_size()
                stats.bytes_staged_received += buffer.numel() * buffer.element_size()
                transport.submit_recv(buffer, peer)
                unpack.append((buffer, packed))
            for t in recvs[peer]:
                if is_direct(t, plan.element_bytes, direct_min_bytes):
                    transport.submit_recv(dst_view(dst_tensors, t), peer)
            stats.bytes_received += sum(t.numel for t in recvs[peer]) * plan.element_bytes
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
        stats.num_messages += transport.run()
        for buffer, packed in unpack:
            offset = 0
            for t in packed:
                view = dst_view(dst_tensors, t)
                view.copy_(buffer[offset : offset + t.numel].view(view.shape))
                offset += t.numel
        # drop every reference to this bucket's buffers before the next allocates its own
        unpack = buffer = None
        stats.num_buckets += 1
    stats.seconds = time.perf_counter() - start
    return stats
