"""Run a :class:`SyncPlan` over torch.distributed, bucket by bucket, writing engine weights in place.

Per bucket, each rank packs what it sends to one peer into one flat buffer (one message per peer),
posts its receives, copies its local slices straight from the actor shard into the engine parameter,
then unpacks what arrived. Nothing beyond one bucket's staging buffers is ever allocated, and those
are freed before the next bucket starts (``peak_extra_bytes`` reports the high-water mark).

The transport is torch.distributed point-to-point (gloo on CPU, NCCL on GPU); any object with the
same ``isend``/``irecv`` shape can stand in (``transport=``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl.weight_sync.plan import SyncPlan, Transfer


@dataclass
class SyncStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0
    num_buckets: int = 0
    num_messages: int = 0


def _src_view(src: dict, t: Transfer) -> torch.Tensor:
    return src[t.src_key].narrow(t.dim, t.src_start, t.length)


def _dst_view(dst: dict, t: Transfer) -> torch.Tensor:
    return dst[t.dst_name].narrow(t.dim, t.dst_start, t.length)


@torch.no_grad()
def execute_sync(
    plan: SyncPlan,
    rank: int,
    src_tensors: dict[tuple[int, str], torch.Tensor],
    dst_tensors: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> SyncStats:
    """Move this rank's part of ``plan``. ``src_tensors``: (vp_stage, megatron name) -> local shard;
    ``dst_tensors``: vLLM name -> engine parameter (written in place)."""
    device = device or next(iter(dst_tensors.values())).device
    dtype = next(iter(src_tensors.values())).dtype if src_tensors else next(iter(dst_tensors.values())).dtype
    stats = SyncStats()
    start = time.perf_counter()
    for bucket in plan.buckets:
        sends: dict[int, list[Transfer]] = defaultdict(list)
        recvs: dict[int, list[Transfer]] = defaultdict(list)
        for t in bucket:
            if t.is_local:
                if t.dst_rank == rank:
                    _dst_view(dst_tensors, t).copy_(_src_view(src_tensors, t))
                    stats.bytes_local += t.numel * plan.element_bytes
            elif t.src_rank == rank:
                sends[t.dst_rank].append(t)
            elif t.dst_rank == rank:
                recvs[t.src_rank].append(t)
        ops, recv_buffers, extra = [], {}, 0
        for peer in sorted(sends):
            buffer = torch.empty(sum(t.numel for t in sends[peer]), dtype=dtype, device=device)
            offset = 0
            for t in sends[peer]:  # pack straight into the buffer: no second copy of column slices
                view = _src_view(src_tensors, t)
                buffer[offset : offset + t.numel].view(view.shape).copy_(view)
                offset += t.numel
            extra += buffer.numel() * buffer.element_size()
            ops.append(dist.P2POp(dist.isend, buffer, peer, group))
            stats.bytes_sent += buffer.numel() * buffer.element_size()
        for peer in sorted(recvs):
            buffer = torch.empty(sum(t.numel for t in recvs[peer]), dtype=dtype, device=device)
            extra += buffer.numel() * buffer.element_size()
            recv_buffers[peer] = buffer
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group))
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            stats.num_messages += len(ops)
        for peer, buffer in recv_buffers.items():
            offset = 0
            for t in recvs[peer]:
                view = _dst_view(dst_tensors, t)
                view.copy_(buffer[offset : offset + t.numel].view(view.shape))
                offset += t.numel
            stats.bytes_received += buffer.numel() * buffer.element_size()
        del ops, recv_buffers
        stats.num_buckets += 1
    stats.seconds = time.perf_counter() - start
    return stats
