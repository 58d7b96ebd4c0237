"""The planner's weight_sync term against what the executor really stages (in-process, no process group).

weight_sync/execute.py runs one rank's part of the sync plan here over a transport that moves nothing and
records, at each bucket's ``run()``, the tensors handed to it that are not views of the actor shards or the
engine parameters: the staging buffers alive at the bucket's peak. The plan's ``sync_bucket`` component of
the weight_sync phase (run/memory_plan.py::sync_staged_bytes -> planner/plan.py::sync_staging_bytes) must equal
the largest of them over the planned stage's ranks: with column slices and small rows packed, large rows
sent direct (actor TP=2 -> engine TP=1), whole layers moved between pipeline stages, and every copy local.
"""

from __future__ import annotations

import pytest
import torch

from modelspec import ColocatedMesh, ModelShape
from modelspec.tiny import tiny_hf_config
from tests.planner_inputs import make_inputs
from weight_sync.execute import SyncStats

WORLD = 2
BUCKET = 4 << 20  # several buckets, transfers split
# (actor TP, actor PP, rollout TP): column slices packed + big rows direct; layers across stages; all local;
# nearly all local
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)]


def shape() -> ModelShape:
    # rows of >= 1 MiB in fp32 (gate / up halves: 1024 x 512), so the direct path is taken too
    config = tiny_hf_config(
        "qwen2", hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=128, tie_word_embeddings=False,
    )  # fmt: skip
    return ModelShape.from_hf_config(config.to_dict())


class StagingProbe:
    """A transport that moves nothing: per ``run()``, the bytes of submitted tensors that are not views of
    ``owned`` (the shards and engine parameters), i.e. the executor's staging buffers alive at that point."""

    def __init__(self, owned: list[torch.Tensor]):
        self.owned = {t.untyped_storage().data_ptr() for t in owned}
        self.pending: list[torch.Tensor] = []
        self.peak = 0
        self.direct = 0  # messages sent or received in place (views of owned tensors)

    def _add(self, tensor: torch.Tensor, _peer: int) -> None:
        self.pending.append(tensor)

    submit_send = submit_recv = _add

    def run(self) -> int:
        ops, self.pending = self.pending, []
        staged = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in ops}
        self.direct += sum(1 for t in ops if t.untyped_storage().data_ptr() in self.owned)
        self.peak = max(self.peak, sum(b for p, b in staged.items() if p not in self.owned))
        return len(ops)


def executor_staging(s: ModelShape, mesh: ColocatedMesh, rank: int) -> tuple[int, int, int, SyncStats]:
    """(the executor's staged peak, its own report of it, its direct messages, its stats) for ``rank`` of ``mesh``."""
    from megatron_backend.layout import RankLayout, local_param_shapes
    from rollout.layout import vllm_param_layouts
    from weight_sync import WeightSyncConfig

    # check_every=0: one rank of the mesh in one process; the reference check gathers shards no other rank sends here
    sync = WeightSyncConfig(bucket_mb=BUCKET >> 20, check_every=0).build(s, mesh, rank, dtype="float32")
    c = mesh.actor_coords(rank)
    layout = RankLayout(mesh.actor_tp, mesh.actor_pp, mesh.actor_vpp, c.tp_rank, c.pp_rank)
    src = {k: torch.zeros(v) for k, v in local_param_shapes(s, layout).items()}
    dst = {
        p.name: torch.zeros(p.local_shape) for p in vllm_param_layouts(s, mesh.rollout_tp, mesh.rollout_tp_rank(rank))
    }
    probe = StagingProbe([*src.values(), *dst.values()])
    sync.transport = probe
    stats = sync(src, dst).stats
    return probe.peak, stats.peak_extra_bytes, probe.direct, stats


@pytest.mark.parametrize("tp,pp,rtp", LAYOUTS)
def test_planned_sync_staging_is_what_the_executor_stages(tp, pp, rtp):
    from planner import device_preset, make_plan
    from run.memory_plan import sync_staged_bytes

    s = shape()
    mesh = ColocatedMesh(world_size=WORLD, actor_tp=tp, actor_pp=pp, rollout_tp=rtp)
    measured = {rank: executor_staging(s, mesh, rank) for rank in range(WORLD)}
    assert all(peak == reported for peak, reported, *_ in measured.values())  # the executor's stat is its buffers
    common = dict(actor=dict(tp=tp, pp=pp), rollout=dict(engine="native", tp=rtp), shape=s, device=device_preset("cpu"))
    common.update(dtype="float32", actor_dp=WORLD // (tp * pp), sequences_per_step=WORLD, sync_bucket_bytes=BUCKET)
    plan = make_plan(make_inputs(**common, sync_staged_bytes=sync_staged_bytes(s, mesh, BUCKET, 4)))
    stage_ranks = [r for r in range(WORLD) if mesh.actor_coords(r).pp_rank == plan.pp_stage]
    planned = plan.phase("weight_sync").components["sync_bucket"]
    assert planned == max(measured[r][0] for r in stage_ranks), (measured, planned)
    bound = make_plan(make_inputs(**common)).phase("weight_sync").components["sync_bucket"]  # without the sync plan
    if (tp, pp, rtp) == (2, 1, 1):  # o_proj / down_proj columns and small rows packed, gate / up rows direct
        assert all(direct > 0 for _, _, direct, _ in measured.values())
        assert 0 < planned < bound == BUCKET
    elif (tp, pp, rtp) == (1, 2, 1):  # the other stage's layers; whole row-parallel weights go as column slices
        assert 0 < planned <= bound
    elif (tp, pp, rtp) == (1, 1, 2):  # every engine slice is cut from the rank's own full copy
        assert planned == 0 < bound
    else:  # TP=2 -> TP=2: only the vocab rows megatron pads differently (128 -> 256 vs vLLM's 128) cross ranks
        assert planned == 2 * 64 * s.hidden_size * 4 and bound == 0


@pytest.mark.parametrize("tp,pp,rtp", LAYOUTS)
def test_the_step_time_models_sync_traffic_is_what_the_executor_moves(tp, pp, rtp):
    """run/memory_plan.py::sync_traffic (what planner/step_time.py times the weight sync by): per stage, the most a
    rank copies locally, sends and receives, as the executor's own stats count them on every rank."""
    from run.memory_plan import sync_traffic

    s = shape()
    mesh = ColocatedMesh(world_size=WORLD, actor_tp=tp, actor_pp=pp, rollout_tp=rtp)
    stats = {rank: executor_staging(s, mesh, rank)[3] for rank in range(WORLD)}
    traffic = sync_traffic(s, mesh, BUCKET, 4)
    assert len(traffic) == pp
    for stage, counted in enumerate(traffic):
        ranks = [r for r in range(WORLD) if mesh.actor_coords(r).pp_rank == stage]
        assert counted.local_bytes == max(stats[r].bytes_local for r in ranks) > 0
        assert counted.sent_bytes == max(stats[r].bytes_sent for r in ranks)
        assert counted.received_bytes == max(stats[r].bytes_received for r in ranks)
        # of those, what the executor packs into its staging buffers (on CPU: fresh pages, copied in and out)
        assert counted.staged_sent_bytes == max(stats[r].bytes_staged_sent for r in ranks)
        assert counted.staged_received_bytes == max(stats[r].bytes_staged_received for r in ranks)
    if (tp, pp, rtp) == (1, 1, 2):  # every engine slice is cut from the rank's own full copy
        assert traffic[0].crossing_bytes == 0
    elif (tp, rtp) == (2, 1):  # the row-parallel weights' column slices cross packed
        assert traffic[0].staged_received_bytes > 0


def test_plan_inputs_carry_the_runs_sync_plan():
    """run/memory_plan.py::plan_inputs plans the sync the run builds (run/setup.py: WeightSyncConfig.build)."""
    from run.compose import compose
    from run.memory_plan import plan_inputs, sync_staged_bytes

    cfg = compose("tiny_cpu_pp", [])
    staged = plan_inputs(cfg).sync_staged_bytes
    mesh = cfg.mesh()
    assert len(staged) == cfg.actor.pp
    plan = cfg.weight_sync.build(cfg.model.shape(), mesh, 0, dtype=cfg.model.dtype).plan  # what rank 0 runs
    for stage in range(cfg.actor.pp):
        ranks = [r for r in range(mesh.world_size) if mesh.actor_coords(r).pp_rank == stage]
        assert staged[stage] == plan.max_staged_bytes(ranks) > 0
    assert staged == sync_staged_bytes(cfg.model.shape(), mesh, cfg.weight_sync.bucket_mb << 20, 4)


def test_verify_checksums_do_not_add_to_the_staging():
    """verify_sync runs after the executor freed its buckets: the phase holds the larger of the two."""
    from planner import device_preset, make_plan
    from planner.sizes import VERIFY_BYTES_PER_ELEMENT, largest_engine_tensor_elements

    s = shape()
    common = dict(
        actor=dict(tp=2), rollout=dict(engine="native", tp=1), shape=s, device=device_preset("cpu"), dtype="float32"
    )
    common.update(sequences_per_step=WORLD, sync_bucket_bytes=BUCKET)
    checksums = VERIFY_BYTES_PER_ELEMENT * largest_engine_tensor_elements(s, 1)
    for staged in (0, checksums // 2, checksums * 2):
        plan = make_plan(make_inputs(**common, sync_staged_bytes=(staged,), verify_sync=True))
        assert plan.phase("weight_sync").components["sync_bucket"] == max(staged, checksums)
