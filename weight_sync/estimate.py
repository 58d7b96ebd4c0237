"""A paper ESTIMATE of one weight sync's time on a GPU node, from the plan's bytes and the hardware's bandwidths.

Nothing here is measured. The plan is the real one: :func:`weight_sync.transfers.plan_sync` over both sides'
layouts needs only the model's shapes (no tensors, no GPU), so the bytes every rank sends, receives, copies
locally and stages are exact for that layout; the times are those bytes over datasheet bandwidths, per rank,
the slowest rank deciding:

- ``transfer_s``: max over ranks of max(bytes sent, bytes received) / the link's bandwidth per direction
  (each GPU's NVLink ports send and receive at once; NVSwitch gives every pair the full rate);
- ``copy_s``: the copies in device memory, each a read and a write: local slices (actor shard -> engine
  parameter), packing what is sent and unpacking what arrives in staging buffers
  (:meth:`SyncPlan.staged_bytes`: transfers below ``DIRECT_MIN_BYTES`` or column slices);
- ``post_load_s``: the engine's processing after loading, one read and write of its routed experts' weights:
  vLLM 0.32's ``UnquantizedFusedMoEMethod.process_weights_after_loading``
  (``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) copies ``w13_weight`` and
  ``w2_weight`` back over themselves after ``_maybe_pad_weight``;
- ``total_s`` = their sum (the executor runs bucket after bucket: pack, send / receive, unpack).

Left out, so the total is a lower bound at peak bandwidth: per-message latency (``num_messages`` says how
many), kernel launches, Python, the engine's wake and the actor's offload around the sync. The peers' way
(:mod:`weight_sync.baseline`: every expert gathered to every rank, then ``load_weights``) is estimated with the
same model from its own bytes (:meth:`PeerExport.bytes_received`), for the ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from modelspec import ColocatedMesh, ModelShape, element_bytes
from weight_sync.baseline import peer_export_layout
from weight_sync.layouts import actor_sources, engine_destinations
from weight_sync.transfers import is_direct, min_sync_bytes, plan_sync


@dataclass(frozen=True)
class Interconnect:
    """One GPU's bandwidths, in bytes per second, with their source."""

    link_bytes_per_s: float  # GPU-to-GPU, per direction
    memory_bytes_per_s: float  # device memory (HBM)
    source: str


# NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 SXM: "NVLink: 900GB/s"
# (bidirectional, 18 links: 450 GB/s each way) and "GPU Memory Bandwidth: 3.35TB/s" (HBM3).
INTERCONNECTS = {
    "H100-80GB": Interconnect(
        450e9,
        3.35e12,
        "NVIDIA H100 datasheet, H100 SXM: NVLink 900 GB/s bidirectional (450 GB/s per direction), HBM3 3.35 TB/s",
    ),
}


def refit_estimate(
    shape: ModelShape, mesh: ColocatedMesh, dtype: str, bucket_bytes: int, device: str
) -> dict[str, object]:
    """The estimate (module doc) for ``shape`` on ``mesh`` at ``dtype``, one JSON-able dict."""
    if device not in INTERCONNECTS:
        raise ValueError(f"cluster.device={device!r}: no bandwidths for it here; one of {', '.join(INTERCONNECTS)}")
    hw = INTERCONNECTS[device]
    elem = element_bytes(dtype)
    sources, destinations = actor_sources(shape, mesh), engine_destinations(shape, mesh)
    plan = plan_sync(sources, destinations, bucket_bytes, elem)
    world = mesh.world_size
    sent, received, local, staged = ([0] * world for _ in range(4))
    num_messages = [0] * world
    for bucket in plan.buckets:
        peers: list[set] = [set() for _ in range(world)]
        for t in bucket:
            nbytes = t.numel * elem
            if t.is_local:
                local[t.dst_rank] += nbytes
                continue
            sent[t.src_rank] += nbytes
            received[t.dst_rank] += nbytes
            if not is_direct(t, elem):  # packed by the sender, unpacked by the receiver
                staged[t.src_rank] += nbytes
                staged[t.dst_rank] += nbytes
                peers[t.src_rank].add(t.dst_rank)
                peers[t.dst_rank].add(t.src_rank)
            else:
                num_messages[t.src_rank] += 1
                num_messages[t.dst_rank] += 1
        for r in range(world):
            num_messages[r] += len(peers[r])
    expert_bytes = [
        elem * sum(math.prod(p.local_shape) for p in destinations[r] if any(s.expert is not None for s in p.slices))
        for r in range(world)
    ]
    engine_bytes = [elem * sum(math.prod(p.local_shape) for p in destinations[r]) for r in range(world)]
    transfer_s = max(max(sent[r], received[r]) for r in range(world)) / hw.link_bytes_per_s
    copy_s = max(2 * (local[r] + staged[r]) for r in range(world)) / hw.memory_bytes_per_s
    post_load_s = max(2 * b for b in expert_bytes) / hw.memory_bytes_per_s
    # the peers: every rank receives its gathers' bytes, then its engine copies its slices out of the full
    # tensors (a read and a write of every engine byte), then the same post-load processing
    export = peer_export_layout(0, shape, mesh)
    baseline_received = [replace(export, rank=r).bytes_received(elem) for r in range(world)]
    baseline_transfer_s = max(baseline_received) / hw.link_bytes_per_s
    baseline_copy_s = max(2 * b for b in engine_bytes) / hw.memory_bytes_per_s
    return dict(
        estimate=True,
        note="a paper estimate, not a measurement: plan bytes over datasheet bandwidths; no latency, launches, "
        "Python, wake or offload (a lower bound at peak bandwidth)",
        model=shape.source,
        dtype=dtype,
        device=device,
        bandwidth_source=hw.source,
        link_gbps_per_direction=hw.link_bytes_per_s / 1e9,
        memory_gbps=hw.memory_bytes_per_s / 1e9,
        world_size=world,
        train=dict(tp=mesh.actor_tp, pp=mesh.actor_pp, ep=mesh.actor_ep, etp=mesh.actor_expert_tp),
        rollout_tp=mesh.rollout_tp,
        num_params=shape.param_count(),
        bucket_bytes=bucket_bytes,
        num_buckets=len(plan.buckets),
        planned_bytes=plan.bytes_moved,
        min_bytes=min_sync_bytes(sources, destinations, elem),
        planned_bytes_received_max=max(received),
        planned_bytes_sent_max=max(sent),
        planned_bytes_local_max=max(local),
        planned_bytes_staged_max=max(staged),
        num_messages_max=max(num_messages),
        engine_bytes_per_rank=max(engine_bytes),
        engine_expert_bytes_per_rank=max(expert_bytes),
        transfer_s=transfer_s,
        copy_s=copy_s,
        post_load_s=post_load_s,
        total_s=transfer_s + copy_s + post_load_s,
        baseline_bytes=sum(baseline_received),
        baseline_bytes_received_max=max(baseline_received),
        baseline_transfer_s=baseline_transfer_s,
        baseline_copy_s=baseline_copy_s,
        baseline_total_s=baseline_transfer_s + baseline_copy_s + post_load_s,
        published=PUBLISHED_REFIT,
    )


# The peers' published refit times for Qwen3-30B-A3B (as ../shared/reference/peers.md cites them).
PUBLISHED_REFIT = [
    dict(
        system="NeMo-RL nccl_reshard (shard to shard, separate GPUs)",
        setup="Qwen3-30B EP8 x PP2 -> TP8 x DP2, H100",
        seconds=[0.74, 1.00],
        source="NVIDIA-NeMo/RL docs/design-docs/nccl-reshard-refit.md; PRs #2808 #2971",
    ),
    dict(
        system="slime (colocated, per sync loop)",
        setup="Qwen3-30B-A3B, 8 x H200",
        seconds=[3.0],
        source="vime #175 (slime on Megatron + vLLM: 11-13.5 s with one IPC handle per tensor)",
    ),
]
