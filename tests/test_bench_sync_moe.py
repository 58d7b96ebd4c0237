"""``make bench-sync`` on MoE layouts and its paper estimate: byte counts only (never time).

The tiny Qwen3-MoE (h 128, 4 experts of m = 64, 3 of its 4 layers sparse, layer 2 dense) at actor EP2 (TP1, so DP2:
both ranks hold every dense parameter, rank e experts 2e and 2e+1) -> engine TP2 on 2 ranks. By hand, per expert:
gate [m, h] + up [m, h] + down [h, m] = 3 x 64 x 128 = 24576 elements, fp32:

- the planned sync: engine rank r keeps rows [32 r, 32 r + 32) of gate / up and those columns of down of all
  4 experts (12288 elements each) and holds 2 of them; it receives the other 2: 2 x 12288 x 3 layers x 4 B =
  294,912 B per rank, 589,824 in all; nothing else crosses (attention, norms, embeddings are all local at TP1);
- the peers' export: every rank all-gathers the other EP rank's 2 experts whole: 2 x 24576 x 3 x 4 B = 589,824 B
  per rank, 1,179,648 in all, and builds every expert's full tensors: 4 x 24576 x 3 x 4 B = 1,179,648 B per rank.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from modelspec import ColocatedMesh, ModelShape
from modelspec.tiny import tiny_hf_config
from weight_sync.baseline import peer_export_layout
from weight_sync.estimate import INTERCONNECTS, refit_estimate

EXPERT_NUMEL = 3 * 64 * 128
SPARSE_LAYERS = 3
PLANNED_PER_RANK = 2 * (EXPERT_NUMEL // 2) * SPARSE_LAYERS * 4
BASELINE_PER_RANK = 2 * EXPERT_NUMEL * SPARSE_LAYERS * 4
ALL_EXPERTS = 4 * EXPERT_NUMEL * SPARSE_LAYERS * 4


def tiny_moe_shape() -> ModelShape:
    return ModelShape.from_hf_config(tiny_hf_config("qwen3_moe"))


def test_paper_estimate_bytes_equal_a_hand_count():
    shape = tiny_moe_shape()
    assert shape.moe_layers == (0, 1, 3) and shape.num_experts == 4 and shape.moe_intermediate_size == 64
    mesh = ColocatedMesh(world_size=2, actor_ep=2, rollout_tp=2)
    out = refit_estimate(shape, mesh, "float32", 1 << 20, "H100-80GB")
    assert out["estimate"] is True
    assert out["planned_bytes"] == out["min_bytes"] == 2 * PLANNED_PER_RANK
    assert out["planned_bytes_received_max"] == out["planned_bytes_sent_max"] == PLANNED_PER_RANK
    assert out["baseline_bytes"] == 2 * BASELINE_PER_RANK and out["baseline_bytes_received_max"] == BASELINE_PER_RANK
    # each engine rank's FusedMoE w13 [4, 2 x 32, 128] + w2 [4, 128, 32] in the 3 sparse layers
    assert out["engine_expert_bytes_per_rank"] == SPARSE_LAYERS * 4 * (2 * 32 * 128 + 128 * 32) * 4
    hw = INTERCONNECTS["H100-80GB"]
    assert out["transfer_s"] == PLANNED_PER_RANK / hw.link_bytes_per_s
    assert out["baseline_transfer_s"] == BASELINE_PER_RANK / hw.link_bytes_per_s
    assert out["post_load_s"] == 2 * out["engine_expert_bytes_per_rank"] / hw.memory_bytes_per_s
    assert out["total_s"] == out["transfer_s"] + out["copy_s"] + out["post_load_s"]


def test_paper_estimate_refuses_a_device_without_bandwidths():
    mesh = ColocatedMesh(world_size=2, actor_ep=2, rollout_tp=2)
    with pytest.raises(ValueError, match="cluster.device='cpu'"):
        refit_estimate(tiny_moe_shape(), mesh, "float32", 1 << 20, "cpu")


def test_peer_export_gathers_every_expert_over_expert_tp_and_ep():
    """TP2 x EP2 (expert TP 2) on 4 ranks: each expert gather is over the 4 ranks of the expert grid (3 other
    shards of each local expert), the attention's over the TP pair (1 other shard), the router not at all."""
    shape = tiny_moe_shape()
    mesh = ColocatedMesh(world_size=4, actor_tp=2, actor_ep=2, rollout_tp=2)
    export = peer_export_layout(0, shape, mesh)
    expert_steps = [peers for _, (_, name), peers, gathered in export.steps() if ".mlp.experts." in name]
    assert expert_steps and all(peers == [0, 1, 2, 3] for peers in expert_steps)
    router = [(peers, gathered) for _, (_, name), peers, gathered in export.steps() if name.endswith("router.weight")]
    assert router == [([0], False)] * SPARSE_LAYERS
    qkv = [peers for _, (_, name), peers, g in export.steps() if name.endswith("linear_qkv.weight")]
    assert qkv == [[0, 1]] * shape.num_layers
    # a rank holds half of each of its 2 experts (EXPERT_NUMEL elements per layer) and receives 3 such shards
    expert_numel = sum(
        math.prod(export.shard_shapes[0][key]) for _, key, _, _ in export.steps() if ".mlp.experts." in key[1]
    )
    assert expert_numel == EXPERT_NUMEL * SPARSE_LAYERS
    expert_received = 3 * expert_numel * 4
    dense_received = sum(
        math.prod(export.shard_shapes[0][key]) * 4 for _, key, p, g in export.steps() if g and p == [0, 1]
    )
    assert export.bytes_received(4) == expert_received + dense_received


def test_bench_sync_moe_layout_moves_less_than_the_peers_gather():
    """``make bench-sync LAYOUT=ep2-tp2`` at the tiny size (native engine, 2 ranks): the tool checks that both
    methods leave the engine generating the same tokens and log-probs; here the bytes it counted."""
    cmd = [sys.executable, "-m", "tools.bench_sync", "--layout", "ep2-tp2", "--hf", "tiny:qwen3_moe", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["same_outputs"] and out["layout"] == "ep2->tp2" and out["train_ep"] == 2
    assert out["planned_bytes"] == out["min_bytes"] == 2 * PLANNED_PER_RANK
    assert out["baseline_bytes"] == 2 * BASELINE_PER_RANK > out["planned_bytes"]
    assert out["baseline_expert_bytes_per_rank"] == out["expert_bytes"] == ALL_EXPERTS


def test_paper_layout_refuses_an_experiment_on_cpu(capsys):
    from tools.bench_sync import main

    assert main(["--layout", "paper", "--exp", "tiny_cpu_moe"]) == 2
    assert "cluster.device='cpu'" in capsys.readouterr().err
