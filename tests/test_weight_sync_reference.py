"""weight_sync.check_every: the engine's slices against the actor's own full tensors, independent of the plan.

One process (world 1: every transfer a local copy), real bf16 tensors, the real planner and executor. The
4-rank version (TP/PP/rollout TP, the gather over ranks) is in test_weight_sync_dist.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from modelspec import ColocatedMesh
from tests.test_weight_sync_plan import hf_weights, megatron_shards, model_config
from weight_sync import TorchP2PTransport, WeightSyncConfig, plan_sync
from weight_sync.execute import dst_view
from weight_sync.layouts import actor_sources, engine_destinations
from weight_sync.reference import ReferenceCheck, WeightLayoutError, sample_names
from weight_sync.sync import WeightSync

FAMILY = "qwen2"
MESH = ColocatedMesh(world_size=1)


def _actor_and_engine():
    shape = model_config(FAMILY)
    src = {k: v.to(torch.bfloat16) for k, v in megatron_shards(hf_weights(FAMILY), FAMILY, 1, 1, None, 0).items()}
    dst = {p.name: torch.zeros(p.local_shape, dtype=torch.bfloat16) for p in engine_destinations(shape, MESH)[0]}
    return shape, src, dst


def swap_gate_up(destinations: dict) -> dict:
    """The engine's layout with gate and up exchanged in every gate_up_proj: a family mapping error."""
    out = {}
    for rank, params in destinations.items():
        out[rank] = []
        for p in params:
            if p.name.endswith("gate_up_proj.weight"):
                gate, up = p.slices
                p = dataclasses.replace(
                    p,
                    slices=(
                        dataclasses.replace(gate, local_start=up.local_start),
                        dataclasses.replace(up, local_start=gate.local_start),
                    ),
                )
            out[rank].append(p)
    return out


def test_a_clean_bf16_sync_passes_bit_for_bit_and_the_sample_rotates_over_the_layers():
    shape, src, dst = _actor_and_engine()
    sync = WeightSyncConfig(bucket_mb=1).build(shape, MESH, 0, "bfloat16")
    results = [sync(src, dst) for _ in range(shape.num_layers)]
    assert all(r.num_reference_checked > 0 for r in results)
    assert "model.embed_tokens.weight" in sample_names(shape, 0)
    assert "model.embed_tokens.weight" not in sample_names(shape, 1)
    covered = set().union(*(sample_names(shape, i) for i in range(shape.num_layers)))
    from modelspec.family import hf_tensor_shapes

    assert covered == set(hf_tensor_shapes(shape))  # L checks see every tensor
    off = WeightSyncConfig(check_every=0).build(shape, MESH, 0, "bfloat16")
    assert off(src, dst).num_reference_checked == 0
    with pytest.raises(ValueError, match=r"weight_sync.check_every=-1 must be >= 0"):
        WeightSyncConfig(check_every=-1)


def test_a_wrong_engine_layout_in_the_plan_passes_the_plan_checksums_and_stops_at_the_first_check():
    shape, src, dst = _actor_and_engine()
    plan = plan_sync(actor_sources(shape, MESH), swap_gate_up(engine_destinations(shape, MESH)), 1 << 20, 2)
    sync = WeightSync(plan, 0, verify=False, transport=TorchP2PTransport(), reference=ReferenceCheck(shape, MESH))
    with pytest.raises(WeightLayoutError) as info:
        sync(src, dst)
    # what weight_sync.verify compares (sent vs arrived, along the plan) agrees: it cannot see this
    for bucket in plan.buckets:
        for t in bucket:
            assert torch.equal(src[t.src_key].narrow(t.dim, t.src_start, t.length), dst_view(dst, t))
    assert str(info.value) == (
        "weight sync check failed: engine rank 0 model.layers.0.mlp.gate_up_proj.weight[dim 0, 0:256] is not the "
        "actor's model.layers.0.mlp.gate_proj.weight[dim 0, 0:256] (the layout is wrong, not rounded)"
    )


class _TransposeAfterCopies(TorchP2PTransport):
    """World 1 moves nothing between ranks; its run() (after the bucket's local copies) then writes layer
    ``layer``'s o_proj transposed into the engine: a wrong write after the sync."""

    def __init__(self, dst: dict, layer: int):
        super().__init__()
        self.dst, self.layer, self.armed = dst, layer, False

    def run(self) -> int:
        if self.armed:
            weight = self.dst[f"model.layers.{self.layer}.self_attn.o_proj.weight"]
            weight.copy_(weight.t().clone())
        return super().run()


def test_a_transposed_slice_written_after_the_sync_stops_the_run_at_the_next_check():
    shape, src, dst = _actor_and_engine()
    transport = _TransposeAfterCopies(dst, layer=1)  # the second check's layer
    sync = WeightSyncConfig(bucket_mb=64).build(shape, MESH, 0, "bfloat16", transport=transport)
    assert sync(src, dst).num_reference_checked > 0  # check 0: layer 0, clean
    transport.armed = True
    with pytest.raises(WeightLayoutError, match=r"engine rank 0 model\.layers\.1\.self_attn\.o_proj\.weight\[dim 1"):
        sync(src, dst)
