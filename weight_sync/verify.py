"""``weight_sync.verify=true``: bit-level checksums of every transferred slice on both sides.

The sender checksums what it sent (cast to the engine's dtype), the receiver what it now holds;
every rank gathers both lists and a mismatch fails the step, naming the tensor and the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weight_sync.execute import dst_view
from weight_sync.transfers import SyncPlan

_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}
_MODULUS = 65521  # position weights 1..65521 make the sum order-sensitive


class WeightSyncMismatch(RuntimeError):
    """A transferred slice differs between actor and engine after the sync."""


def checksum(t: torch.Tensor) -> int:
    """Exact, position-sensitive checksum of the bit pattern (int64 arithmetic wraps identically everywhere)."""
    bits = t.contiguous().view(_BITS[t.dtype]).reshape(-1).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _MODULUS + 1
    return int((bits * weights).sum().item())


@torch.no_grad()
def verify_sync(
    plan: SyncPlan,
    rank: int,
    src_tensors: dict,
    dst_tensors: dict,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Compare sender and receiver checksums of every transfer; returns how many were checked."""
    dst_dtype = next(iter(dst_tensors.values())).dtype
    sent, held = {}, {}
    for bucket_index, bucket in enumerate(plan.buckets):
        for i, t in enumerate(bucket):
            key = (bucket_index, i)
            if t.src_rank == rank:
                sent[key] = checksum(src_tensors[t.src_key].narrow(t.dim, t.src_start, t.length).to(dst_dtype))
            if t.dst_rank == rank:
                held[key] = checksum(dst_view(dst_tensors, t))
    world_size = dist.get_world_size(group)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (sent, held), group=group)
    all_sent = {k: v for s, _ in gathered for k, v in s.items()}
    all_held = {k: v for _, h in gathered for k, v in h.items()}
    for (bucket_index, i), value in all_held.items():
        if all_sent.get((bucket_index, i)) != value:
            t = plan.buckets[bucket_index][i]
            expert = "" if t.dst_expert is None else f"[expert {t.dst_expert}]"
            raise WeightSyncMismatch(
                f"weight sync verify failed: engine rank {t.dst_rank} {t.dst_name}{expert}[dim {t.dim}, "
                f"{t.dst_start}:{t.dst_start + t.length}] != actor rank {t.src_rank} {t.src_key[1]} "
                f"(from {t.hf_name}); checksum {value} vs {all_sent.get((bucket_index, i))}"
            )
    return len(all_held)
