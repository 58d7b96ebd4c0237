"""Issue 30's device and node accounting: every communicator the step uses, the host memory of a node per phase,
the never-measured CUDA terms in the headroom, and megatron's optimizer CPU offload as a lever."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from modelspec.shape import ModelShape
from planner import PlanInputs, device_preset, make_plan
from planner.comms import NCCL_PROTOCOL_BUFFER_BYTES, VLLM_CUSTOM_ALL_REDUCE_BYTES, nccl_collective_bytes
from planner.host import checkpoint_staging_bytes, engine_sleep_copy_bytes, host_plan
from planner.plan import _stage
from planner.report import headroom_beyond_uncertainty_bytes, recommend_optimizer_offload_fraction, uncertainty_bytes
from planner.sizes import actor_stage_param_count, power_of_two_bytes
from run.compose import compose
from run.memory_plan import plan_inputs
from tests.dist import run_ranks
from tests.planner_inputs import make_inputs, merged

QWEN32B = ModelShape.from_architecture("Qwen2.5-32B-Instruct")
MIB, GIB = 2**20, 2**30


def qwen32b(*layers: dict, **overrides) -> PlanInputs:
    """qwen32b_8xh100's layout: actor TP=8, vLLM TP=4 (2 replicas), one 8x H100 node."""
    base = dict(
        actor=dict(tp=8),
        rollout=dict(tp=4, max_model_len=768, kv_cache_bytes=8 * GIB),
        shape=QWEN32B,
        device=device_preset("H100-80GB"),
        sequences_per_step=64,
        prompt_tokens=256,
        response_tokens=512,
        ranks_per_node=8,
    )
    return make_inputs(**merged(base, *layers, overrides))


def names(inp: PlanInputs) -> set[str]:
    return {c.name for c in inp.communicators}


# ---------------------------------------------------------------- item 3: communicators
def test_each_communicator_the_layout_uses_is_counted_from_nccls_documented_buffers():
    inp = qwen32b()
    assert names(inp) == {
        "world",
        "megatron TP",
        "megatron MODEL_PARALLEL",  # the non-distributed optimizer's grad norm
        "vLLM tp (PyNccl)",
        "vLLM tp (torch device_group)",
        "vLLM dp (PyNccl)",
        "vLLM custom all-reduce",
        "vLLM symmetric memory",
    }
    ring = nccl_collective_bytes(24)  # cuda.json's nccl_channels estimate
    assert ring == 24 * (4 * MIB + 512 * 1024 + 4800 * 1024) == 24 * NCCL_PROTOCOL_BUFFER_BYTES
    by_name = {c.name: c for c in inp.communicators}
    assert by_name["megatron TP"].bytes == ring and by_name["vLLM tp (PyNccl)"].ranks == 4
    assert by_name["vLLM dp (PyNccl)"].ranks == 2
    assert by_name["vLLM custom all-reduce"].bytes == VLLM_CUSTOM_ALL_REDUCE_BYTES == 32 * MIB
    assert by_name["vLLM symmetric memory"].bytes == 32 * MIB  # capability 9.0, TP 4
    # the weight sync's point-to-point buffers ride on the world communicator, per peer
    peers = replace(inp, sync_peers=5).communicators[0]
    assert peers.name == "world" and peers.bytes == ring + 5 * 2 * 2 * 4 * MIB
    assert inp.num_communicators == 6
    assert inp.comm_bytes == sum(c.bytes for c in inp.communicators)  # nccl_bytes_per_communicator: 0 +- 32 MiB
    assert replace(inp, comm_bytes_per_communicator=MIB).comm_bytes == inp.comm_bytes + 6 * MIB


def test_the_layout_decides_the_communicators():
    pp_dp = qwen32b(actor=dict(tp=4, pp=2), rollout=dict(tp=8), actor_dp=1, sequences_per_step=64)
    assert {"megatron PP", "megatron TP", "megatron MODEL_PARALLEL"} <= names(pp_dp)
    assert "vLLM dp (PyNccl)" not in names(pp_dp)  # one replica
    assert "vLLM symmetric memory" in names(pp_dp)
    dp = qwen32b(actor=dict(tp=4), actor_dp=2, distributed_optimizer=True)
    assert "megatron DP" in names(dp) and "megatron MODEL_PARALLEL" not in names(dp)  # grad norm: its own group
    assert "vLLM symmetric memory" not in names(qwen32b(device=device_preset("A100-80GB")))  # capability 8.0
    cpu = qwen32b(rollout=dict(engine="native"), device=device_preset("cpu"), attention="unfused")
    assert cpu.communicators == () and cpu.comm_bytes == 0  # gloo: no device buffers


INTRA_DIST_OPT = "megatron INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE"


def test_the_distributed_optimizers_grad_norm_group_is_a_communicator_of_its_own():
    """megatron-core 0.16.1 reduces the distributed optimizer's grad norm over parallel_state's
    INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP, a process group of its own over the world's ranks (one optimizer
    instance): counted beside "world" and "megatron DP" wherever the actor builds the distributed optimizer (DP > 1,
    or the optimizer-offload fraction) on more than one rank; never with the non-distributed optimizer."""
    ring = nccl_collective_bytes(24)
    dp = qwen32b(actor=dict(tp=4), actor_dp=2, distributed_optimizer=True)
    by_name = {c.name: c for c in dp.communicators}
    assert {"world", "megatron DP", INTRA_DIST_OPT} <= set(by_name)
    assert by_name[INTRA_DIST_OPT].ranks == by_name["world"].ranks == 8 and by_name[INTRA_DIST_OPT].bytes == ring
    assert by_name["megatron DP"].ranks == 2
    without = qwen32b(actor=dict(tp=4), actor_dp=2, distributed_optimizer=False)  # the count it adds: one
    assert dp.num_communicators == without.num_communicators  # MODEL_PARALLEL (4 ranks) there, this one here
    assert INTRA_DIST_OPT not in names(without) and INTRA_DIST_OPT not in names(qwen32b())  # TP=8, DP=1
    # the hybrid CPU optimizer at DP=1: the distributed optimizer, so its group over TP x PP, not MODEL_PARALLEL
    offload = qwen32b(actor=dict(optimizer_offload_fraction=0.5), distributed_optimizer=True)
    assert INTRA_DIST_OPT in names(offload) and "megatron MODEL_PARALLEL" not in names(offload)
    assert offload.num_communicators == qwen32b().num_communicators and offload.comm_bytes == qwen32b().comm_bytes
    one_gpu = qwen32b(actor=dict(tp=1), rollout=dict(tp=1), ranks_per_node=1, distributed_optimizer=True)
    assert INTRA_DIST_OPT not in names(one_gpu)  # one rank: no peer, no communicator
    launch = plan_inputs(compose("memory_cpu", ["cluster.device=H100-80GB", "cluster.procs_per_node=2", "actor.tp=1"]))
    assert launch.actor_dp == 2 and launch.distributed_optimizer and INTRA_DIST_OPT in names(launch)


def _grad_norm_groups(rank, world_size, hf_dir):
    """One DP=2 train step of the actor (megatron's DistributedOptimizer) on gloo, recording the groups of every
    all-reduce megatron's grad norm runs (clip_grads.py calls torch.distributed.all_reduce at call time)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=1, pp=1)
    actor = Actor(hf_dir, ActorConfig(micro_batch_size=2, lr=1e-4, grad_clip=1.0), dims)
    intra = mpu.get_intra_distributed_optimizer_instance_group()
    seen = []
    real_norm = clip_grads.get_grad_norm_fp32

    def norm(*args, **kwargs):
        seen.append(kwargs.get("grad_stats_parallel_group"))
        return real_norm(*args, **kwargs)

    clip_grads.get_grad_norm_fp32 = megatron_optimizer.get_grad_norm_fp32 = norm  # bound by name in optimizer.py
    ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=torch.Generator().manual_seed(rank))
    batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    batch.old_logprobs = actor.compute_logprobs(batch)
    actor.train_step(batch, PolicyLoss(PolicyLossConfig()))
    return dict(
        optimizer=actor.optimizer_name,
        intra_ranks=dist.get_process_group_ranks(intra),
        norm_on_intra=bool(seen) and all(g is intra for g in seen),
        intra_is_world=intra is dist.group.WORLD,
        intra_is_dp=intra is mpu.get_data_parallel_group(with_context_parallel=True) or intra is dims.dp_group,
        intra_is_model_parallel=intra is mpu.get_model_parallel_group(),
        optimizer_group_is_intra=actor.trainer.optimizer.get_grad_stats_parallel_group() is intra,
    )


def test_megatrons_grad_norm_runs_on_the_intra_distributed_optimizer_group_not_the_world(tiny_model_dirs):
    """What the count above rests on, on real ranks (gloo): the actor's DP=2 step takes megatron's grad norm on
    INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP, a group of both ranks that is neither the default group nor DP."""
    for result in run_ranks(_grad_norm_groups, 2, tiny_model_dirs["qwen2"]):
        assert result == dict(
            optimizer="megatron-core DistributedOptimizer",
            intra_ranks=[0, 1],
            norm_on_intra=True,
            intra_is_world=False,
            intra_is_dp=False,
            intra_is_model_parallel=False,
            optimizer_group_is_intra=True,
        ), result


def test_never_measured_cuda_terms_and_the_device_total_count_in_the_headroom():
    plan = make_plan(qwen32b())
    spread = uncertainty_bytes(plan)
    for name in ("fused_activation_factor", "train_workspace_bytes", "nccl_channels", "device_total_bytes"):
        assert spread[name] > 0, name
    assert spread["device_total_bytes"] == plan.inputs.device.total_uncertainty_bytes
    assert headroom_beyond_uncertainty_bytes(plan) == plan.headroom_bytes - sum(spread.values())
    # the activation factor's uncertainty is 0.37 x the peak's activations (train)
    train = plan.phase("train").components["activations"]
    assert plan.peak_phase == "train" and spread["fused_activation_factor"] == int(0.37 * train)


# ---------------------------------------------------------------- item 4: host memory per node
def test_cuda_host_plan_counts_pinned_buffers_staging_and_the_sleep_copy():
    inp = qwen32b(checkpoint_saves=True)
    plan = make_plan(inp)
    st = _stage(inp, plan.pp_stage)
    host = host_plan(plan)
    peak = host.peak.components
    assert peak["offload_pinned"] == st.actor_params + st.optimizer  # exact storages: params + Adam (grads: none)
    assert peak["checkpoint_staging"] == checkpoint_staging_bytes(plan) > st.actor_params + st.optimizer
    assert host.peak_phase == "save_checkpoint" and peak["engine_sleep_copy"] == 0  # sleep level 2 keeps none
    assert host.peak_bytes_per_node == 8 * host.peak.rank_bytes and host.fits
    # each staged tensor is one power-of-two pinned block: a 32B TP=8 rank's fc1 [2 x 27648 / 8, 5120] bf16
    assert power_of_two_bytes(2 * 27648 // 8 * 5120 * 2) == 128 * MIB
    no_saves = host_plan(make_plan(replace(inp, checkpoint_saves=False)))
    assert no_saves.peak.components["checkpoint_staging"] == 0
    level1 = host_plan(make_plan(inp.with_rollout(sleep_level=1)))
    assert level1.peak.components["engine_sleep_copy"] == engine_sleep_copy_bytes(plan) >= plan.engine_weight_bytes
    small = replace(inp, device=device_preset("H100-80GB", host_memory_bytes=512 * GIB))
    assert host_plan(make_plan(small)).fits is False


def test_cuda_host_plan_has_the_export_hf_phase_where_the_device_plan_has_it():
    """A run that exports HF weights plans export_hf on the device (nothing there on CUDA) and on the host: the
    files written tensor by tensor beside the kept staging; without saves the export's params-only save stages
    the params (power-of-two pinned blocks, kept), with saves it reuses the save's blocks."""
    from colocation.phases import EXPORT_PHASE
    from planner.plan import hf_file_writing_bytes

    for saves in (True, False):
        plan = make_plan(qwen32b(checkpoint_saves=saves, hf_exports=True))
        host = host_plan(plan)
        names = [p.name for p in host.phases]
        assert EXPORT_PHASE in plan.names and names[-1] == EXPORT_PHASE, names
        export, rollout = host.phases[-1].components, next(p for p in host.phases if p.name == "rollout").components
        assert export["hf_file_writing"] == hf_file_writing_bytes(plan.inputs) > 0
        staging = checkpoint_staging_bytes(plan) if saves else checkpoint_staging_bytes(plan, params_only=True)
        assert export["checkpoint_staging"] == staging == rollout["checkpoint_staging"]
        assert 0 < checkpoint_staging_bytes(plan, params_only=True) < checkpoint_staging_bytes(plan)
        assert export["offload_pinned"] == rollout["offload_pinned"] > 0
    no_export = host_plan(make_plan(qwen32b(checkpoint_saves=True)))
    assert EXPORT_PHASE not in [p.name for p in no_export.phases]


def test_cpu_host_plan_is_the_device_plan_plus_the_offloaded_page_cache():
    """On CPU the device is the host: each phase's rank bytes are its device plan (RSS, validated by make
    validate-plan) plus the runtime level; the offloaded state sits in the page cache beside it."""
    cfg = compose("tiny_cpu")
    plan = make_plan(plan_inputs(cfg, 4))
    host = host_plan(plan)
    st = _stage(plan.inputs, plan.pp_stage)
    for device_phase in plan.phases:
        phase = next(p for p in host.phases if p.name == device_phase.name)
        assert phase.components["rank"] == device_phase.predicted_bytes + plan.runtime_overhead_bytes
    rollout = next(p for p in host.phases if p.name == "rollout")
    assert rollout.components["offload_page_cache"] == st.actor_params + st.optimizer  # all offloaded there
    assert host.ranks_per_node == 2 and host.node_memory_bytes > 0


def test_cluster_host_memory_gib_overrides_the_presets_ram():
    inp = plan_inputs(compose("qwen32b_8xh100", ["cluster.host_memory_gib=512"]))
    assert inp.device.host_memory_bytes == 512 * GIB and inp.device.host_memory_source == "cluster.host_memory_gib"
    assert host_plan(make_plan(inp)).fits is False  # ~1.3 TiB per node after the first save
    with pytest.raises(Exception, match="cluster.host_memory_gib=-1"):
        compose("qwen32b_8xh100", ["cluster.host_memory_gib=-1"])


# ---------------------------------------------------------------- item 5: the optimizer offload lever
def test_optimizer_offload_fraction_moves_adams_moments_to_the_host():
    base = qwen32b(distributed_optimizer=True)
    f = 0.25
    half = base.with_actor(optimizer_offload_fraction=f)
    count = actor_stage_param_count(QWEN32B, 8, 1, 0)
    moved = (
        make_plan(base).phase("train").components["optimizer"] - make_plan(half).phase("train").components["optimizer"]
    )
    assert abs(moved - f * count * 8) <= 1  # m and v, fp32; the fp32 main params stay
    assert host_plan(make_plan(half)).peak.components["hybrid_optimizer"] == round(count * f * 16)
    with pytest.raises(ValueError, match="distributed optimizer"):
        qwen32b(actor=dict(optimizer_offload_fraction=0.1))


def test_make_plan_recommends_the_smallest_fraction_and_qwen32b_uses_one_with_4_gib_beyond():
    cfg = compose("qwen32b_8xh100")
    inp = plan_inputs(cfg)
    plan = make_plan(inp)
    assert (
        inp.actor.optimizer_offload_fraction == cfg.actor.optimizer_offload_fraction > 0 and inp.distributed_optimizer
    )
    assert plan.fits and headroom_beyond_uncertainty_bytes(plan) >= 4 * GIB
    assert host_plan(plan).fits
    smallest = recommend_optimizer_offload_fraction(inp, 4 * GIB)
    assert smallest == inp.actor.optimizer_offload_fraction  # the yaml's is the search's
    below = inp.with_actor(optimizer_offload_fraction=round(smallest - 0.05, 2))
    assert headroom_beyond_uncertainty_bytes(make_plan(below)) < 4 * GIB
    with pytest.raises(Exception, match="optimizer_offload_fraction=0.3 needs megatron's optimizer on CUDA"):
        compose("tiny_cpu", ["actor.optimizer_offload_fraction=0.3"])


# ---------------------------------------------------------------- item 3: a CUDA validation set
@pytest.mark.parametrize("device", ["H100-80GB", "A100-40GB"])
def test_cuda_validation_set_plans_on_the_gpu_and_puts_each_communicator_under_the_plan(device):
    """`make validate-plan` on a GPU node runs tools/plan_runs.py::cuda_validation_set (here only planned: no GPU):
    every configuration fits its GPU, none is in the CUDA fit set, and together they use every kind of
    communicator the planner counts for those layouts."""
    from tools.plan_runs import cuda_fit_set, cuda_validation_set, spec_config
    from tools.validate_plan import VALIDATION_SET, validation_set

    specs = cuda_validation_set(device)
    fit = {s.all_overrides for s in cuda_fit_set(device)}
    used = set()
    for spec in specs:
        assert spec.all_overrides not in fit, spec.name
        inp = plan_inputs(spec_config(spec), 4)  # "4+4=": memory_cpu's digit_sum prompt (no checkpoint built)
        assert inp.device.name == device and make_plan(inp).fits, spec.name
        used |= names(inp)
    assert {"megatron TP", "megatron PP", "megatron DP", "vLLM tp (PyNccl)", "vLLM dp (PyNccl)"} <= used
    assert "vLLM custom all-reduce" in used
    assert validation_set() == VALIDATION_SET  # no GPU here: the CPU set


# megatron's groups by the names planner/comms.py gives their communicators
MEGATRON_GROUPS = {
    "megatron TP": "get_tensor_model_parallel_group",
    "megatron PP": "get_pipeline_model_parallel_group",
    "megatron DP": ("get_data_parallel_group", {"with_context_parallel": True}),
    "megatron DP (without CP)": "get_data_parallel_group",
    "megatron MODEL_PARALLEL": "get_model_parallel_group",
    "megatron INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE": "get_intra_distributed_optimizer_instance_group",
    "megatron TP x CP": "get_tensor_and_context_parallel_group",
    "megatron EP": "get_expert_model_parallel_group",
    "megatron expert TP": "get_expert_tensor_parallel_group",
    "megatron expert TP x EP": "get_expert_tensor_and_model_parallel_group",
    "megatron expert DP": "get_expert_data_parallel_group",
    "megatron expert TP x EP x PP": "get_expert_tensor_model_pipeline_parallel_group",
}
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
    "all_gather_object", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce",
)  # fmt: skip


def _moe_step_groups(rank, world_size, hf_dir, tp, ep):
    """One MoE actor step on gloo (log-probs, then train, aux loss on), naming the group of every collective it
    runs with more than one rank: each torch.distributed collective replaced, under every name a megatron or
    project module bound it to, by one that records its ``group`` first."""
    import inspect
    import sys
    import traceback

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=tp, pp=1, ep=ep)
    actor = Actor(hf_dir, ActorConfig(tp=tp, ep=ep, micro_batch_size=2, lr=1e-4, moe_aux_loss_coef=1e-3), dims)
    named = {}
    for name, getter in MEGATRON_GROUPS.items():
        fn, kwargs = getter if isinstance(getter, tuple) else (getter, {})
        named.setdefault(id(getattr(mpu, fn)(**kwargs)), name)
    named[id(dist.group.WORLD)] = "world"
    seen = set()
    dispatched = {"logprobs": [0, 0], "train": [0, 0]}  # the token dispatcher's collectives: [forward, backward]
    current = ["logprobs"]

    def recording(fn):
        signature = inspect.signature(fn)

        def run(*args, **kwargs):
            group = signature.bind(*args, **kwargs).arguments.get("group") or dist.group.WORLD
            if dist.get_world_size(group) > 1:
                seen.add(named.get(id(group), f"unnamed group of {dist.get_process_group_ranks(group)}"))
                frames = [(Path(f.filename).name, f.name) for f in traceback.extract_stack()]
                if any(name == "token_dispatcher.py" for name, _ in frames):
                    dispatched[current[0]][0] += 1
                elif ("mappings.py", "backward") in frames:  # an autograd backward of megatron's mappings
                    dispatched[current[0]][1] += 1
            return fn(*args, **kwargs)

        return run

    wrapped = {id(fn): (fn, recording(fn)) for fn in (getattr(dist, n) for n in COLLECTIVES)}
    prefixes = ("megatron.", "megatron_backend.", "torch.distributed")
    for module in [m for n, m in list(sys.modules.items()) if n.startswith(prefixes) and m is not None]:
        for attr, value in list(vars(module).items()):
            original, recorder = wrapped.get(id(value), (None, None))
            if value is original:
                setattr(module, attr, recorder)
    ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=torch.Generator().manual_seed(rank))
    batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    batch.old_logprobs = actor.compute_logprobs(batch)
    current[0] = "train"
    actor.train_step(batch, PolicyLoss(PolicyLossConfig()))
    from megatron_backend.memory import unique_storages

    return sorted(seen), actor.optimizer_name, len(unique_storages(actor.states.tensors("optimizer"))), dispatched


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1)])
def test_every_group_an_moe_step_runs_a_collective_on_is_a_counted_communicator(tiny_model_dirs, tp, ep):
    """planner/comms.py's communicators for an MoE actor (aux loss on) are the groups its step really uses, on two
    real ranks: EP 2 (DP 2, the distributed optimizer: the dispatcher's all-to-alls and per-expert counts, the
    router losses' DP mean) and TP 2 (expert TP 2, the non-distributed optimizer: the load-balancing loss over
    TP x CP, the routed tokens' gather, both grad norms' groups). The same step's optimizer state storages are the
    step-time model's count (planner/step_time.py::_optimizer_tensors: megatron's tensors, the distributed
    optimizer's shards)."""
    shape = ModelShape.from_pretrained(tiny_model_dirs["qwen3_moe"])
    results = run_ranks(_moe_step_groups, 2, tiny_model_dirs["qwen3_moe"], tp, ep)
    used, optimizer, _, dispatched = results[0]
    assert all(r[:2] == results[0][:2] for r in results)
    plan = make_inputs(
        shape=shape,
        device=device_preset("H100-80GB"),
        dtype="float32",
        actor=dict(tp=tp, ep=ep, micro_batch_size=2, moe_aux_loss_coef=1e-3),
        actor_dp=2 // tp,
        distributed_optimizer=optimizer == "megatron-core DistributedOptimizer",
        sequences_per_step=4 * (2 // tp),  # each DP rank passed the 4 sequences of its batch
        prompt_tokens=8,
        response_tokens=8,
        ranks_per_node=2,
    )
    counted = sorted(c.name for c in plan.communicators if c.name.startswith("megatron") or c.name == "world")
    assert used == counted, (used, counted)
    # the optimizer's state storages an offload copies out one by one (planner/step_time.py): Adam's two moments
    # and torch's step tensor per parameter tensor the rank steps, megatron's own tensors (a fused qkv, fc1 and
    # fc2 per local expert), with the distributed optimizer those its shard overlaps (the experts over expert DP)
    from planner.step_time import _optimizer_tensors

    local_spec = replace(plan, attention="unfused")  # the ranks ran megatron's local spec on CPU
    assert max(r[2] for r in results) == 3 * _optimizer_tensors(local_spec, 0), [r[2] for r in results]
    # the token dispatcher's collectives, each over 2 ranks (one ring step): what the step-time model counts per
    # micro-batch and MoE layer (planner/step_time.py::moe_dispatch_steps, from megatron's token_dispatcher.py)
    from planner.step_time import moe_dispatch_steps

    moe_layers = sum(shape.is_moe_layer(layer) for layer in range(shape.num_layers))
    for phase, train in (("logprobs", False), ("train", True)):
        forward, backward = dispatched[phase]
        passes = plan.micro_batches(train=train).count
        assert forward == passes * moe_dispatch_steps(plan, moe_layers, False), (phase, dispatched)
        if tp == 1:  # on one TP rank every backward of megatron's mappings is the dispatcher's
            assert forward + backward == passes * moe_dispatch_steps(plan, moe_layers, train), (phase, dispatched)
