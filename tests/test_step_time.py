"""The step-time model's plumbing (planner/step_time.py), its counted op constants against a real megatron layer, and
its fit (tools/calibrate_time.py) and check (tools/validate_time.py) on rows whose constants are known. No
wall-clock time is asserted here: make validate-time compares the model with measured runs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from modelspec import ModelShape
from planner import make_plan
from planner.calibration import load
from planner.devices import DeviceSpec, device_preset
from planner.speed import SPEED_PRESETS, speed_preset
from planner.step_time import (
    CHECKSUM_OPS,
    CHECKSUM_READ_BYTES_PER_ELEMENT,
    CHECKSUM_WRITTEN_BYTES_PER_ELEMENT,
    COLUMN_CONSTANT,
    EFFICIENCIES,
    LOCAL_LAYER_OPS,
    LOCAL_MODEL_OPS,
    MOE_LAYER_OPS,
    QK_NORM_LAYER_OPS,
    _does_work,
    all_gather_object_written_bytes,
    coefficient,
    logprob_bytes_per_logit,
    phase_work,
    predict_step_time,
)
from tests.dist import run_ranks
from tests.planner_inputs import CPU_SPEED as CPU
from tests.planner_inputs import make_inputs as planner_inputs


def make_inputs(**fields):
    """The tiny model on a CPU rank: 8 sequences of 32 + 64 tokens, packed, 2 micro-batches."""
    device = DeviceSpec(name="cpu", kind="cpu", total_bytes=8 * 2**30, host_memory_bytes=16 * 2**30)
    defaults = dict(shape=ModelShape.from_pretrained("tiny:qwen2"), device=device, dtype="float32")
    defaults.update(sequences_per_step=8, prompt_tokens=32, response_tokens=64, ranks_per_node=1)
    return planner_inputs(actor=dict(micro_batch_size=4, remove_padding=True), **{**defaults, **fields})


def _ops_per_layer(rank: int, world_size: int, family: str, experts: int = 0) -> dict[str, tuple[int, int]]:
    """Torch ops of a forward and a backward of megatron's local model with 2 and with 4 layers (packed); ``experts``:
    every layer an MoE layer of that many experts."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_backend.model import build_gpt_chunks, moe_kwargs
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    dims = initialize_model_parallel(tp=world_size, pp=1, vpp=None)
    lengths = (16, 24, 24)  # a micro-batch of packed sequences of unequal lengths, the common case
    tokens = sum(lengths)
    cu = torch.tensor([0, 16, 40, 64], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=24, max_seqlen_kv=24)
    out = {}
    for layers in (2, 4):
        shape = dataclasses.replace(ModelShape.from_pretrained(f"tiny:{family}"), num_layers=layers)
        if experts:
            shape = dataclasses.replace(shape, num_experts=experts, moe_layers=tuple(range(layers)))
        [model] = build_gpt_chunks(shape, dims, moe=moe_kwargs(shape, dims))
        ids = torch.randint(0, shape.vocab_size, (1, tokens))
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        Count.ops = 0
        with Count():
            y = model(ids, positions, attention_mask=None, packed_seq_params=params)
        forward = Count.ops
        Count.ops = 0
        with Count():
            y.float().sum().backward()
        out[layers] = (forward, Count.ops)
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_counted_layer_ops_are_what_torch_dispatches(family):
    counts = run_ranks(_ops_per_layer, 1, family)[0]
    forward, backward = ((counts[4][i] - counts[2][i]) / 2 for i in range(2))
    qk = QK_NORM_LAYER_OPS if family == "qwen3" else {"forward": 0, "backward": 0}
    assert forward == LOCAL_LAYER_OPS["forward"] + qk["forward"]
    assert backward == LOCAL_LAYER_OPS["backward"] + qk["backward"]
    assert counts[2][0] - 2 * forward == LOCAL_MODEL_OPS["forward"]  # embedding, final norm, output layer
    assert counts[2][1] - 2 * backward == LOCAL_MODEL_OPS["backward"]


def test_the_counted_moe_layer_ops_are_what_torch_dispatches():
    """An MoE layer's ops beyond the dense layer's: a fixed part and a part per local expert (4 and 16 experts)."""
    counts = {e: run_ranks(_ops_per_layer, 1, "qwen3_moe", e)[0] for e in (4, 16)}
    dense = {k: LOCAL_LAYER_OPS[k] + QK_NORM_LAYER_OPS[k] for k in LOCAL_LAYER_OPS}
    for i, kind in enumerate(("forward", "backward")):
        fixed, per_expert = MOE_LAYER_OPS[kind]
        for experts, c in counts.items():
            assert (c[4][i] - c[2][i]) / 2 == dense[kind] + fixed + per_expert * experts, (kind, experts)


def test_every_step_phase_is_timed_and_only_those():
    plan = make_plan(make_inputs())
    step = predict_step_time(plan, CPU, load("cpu_time"))
    assert [p.name for p in step.phases] == [n for n in plan.names if n not in ("eval", "export_hf")]
    assert all(p.seconds >= 0 for p in step.phases)
    assert step.seconds == pytest.approx(sum(p.seconds for p in step.phases))
    assert step.phase("train").seconds > 0 and step.phase("rollout").seconds > 0


def test_an_offload_copies_out_at_the_host_rate_and_an_onload_in_at_its_own():
    """The offload's bytes cross out at ``host_bytes_per_s``, the onload's in at ``host_in_bytes_per_s`` (on CPU the
    probe's read back into fresh pages, slower than the write out), or at the same rate where only one is known (a
    datasheet's PCIe)."""
    from planner.step_time import raw_terms

    inp = make_inputs()
    work = phase_work(make_plan(inp))
    out, back = work["offload_optimizer"], work["onload_optimizer"]
    assert out.host_bytes == back.host_in_bytes > 0 and out.host_in_bytes == back.host_bytes == 0
    both_ways = dataclasses.replace(CPU, host_bytes_per_s=3e9, host_in_bytes_per_s=2e9)
    assert raw_terms(out, inp, both_ways)["host"] == pytest.approx(out.host_bytes / 3e9)
    assert raw_terms(back, inp, both_ways)["host"] == pytest.approx(back.host_in_bytes / 2e9)
    one_rate = dataclasses.replace(both_ways, host_in_bytes_per_s=None)
    assert raw_terms(back, inp, one_rate)["host"] == pytest.approx(back.host_in_bytes / 3e9)


def test_an_engines_steps_cost_beyond_their_layers():
    """The native engine's fixed cost per step (each decode step, each wave's prefill) outside its layers, beside the
    per-layer one: a 16-layer model has four times the layer steps of the 4-layer one and the same steps. vLLM's
    steps are its own column."""
    from planner.step_time import raw_terms, scaled_terms

    inp = make_inputs(rollout=dict(engine="native", max_num_seqs=8))
    deep = dataclasses.replace(inp, shape=dataclasses.replace(inp.shape, num_layers=4 * inp.shape.num_layers))
    rollout, deep_rollout = (phase_work(make_plan(i))["rollout"] for i in (inp, deep))
    steps = inp.planned_lengths().longest_response + 1  # one wave of 8: its decode steps and its prefill
    assert rollout.engine_steps == deep_rollout.engine_steps == steps
    assert deep_rollout.engine_layer_steps == 4 * rollout.engine_layer_steps == 4 * steps * inp.shape.num_layers
    raw = raw_terms(rollout, inp, CPU)
    assert raw["native_step_ops"] == pytest.approx(steps * CPU.op_seconds * CPU.oversubscription(1))
    constants = load("cpu_time")
    with_steps = constants.with_values(native_step_ops=constants.value("native_step_ops") + 300.0)
    more = scaled_terms(raw, with_steps)["engine_ops"] - scaled_terms(raw, constants)["engine_ops"]
    assert more == pytest.approx(300.0 * raw["native_step_ops"])  # an engine op, as the per-layer ones
    vllm = make_inputs(rollout=dict(engine="vllm"))  # vLLM's steps under its own constant
    vllm_raw = raw_terms(phase_work(make_plan(vllm))["rollout"], vllm, CPU)
    assert "native_step_ops" not in vllm_raw and vllm_raw["vllm_step_ops"] > 0


def test_the_work_follows_the_counts():
    inp = make_inputs()
    base = phase_work(make_plan(inp))
    longer_inputs = inp.with_rollout(max_new_tokens=2 * inp.response_tokens)
    longer = phase_work(make_plan(dataclasses.replace(longer_inputs, response_tokens=2 * inp.response_tokens)))
    assert longer["rollout"].engine_layer_steps > base["rollout"].engine_layer_steps
    assert longer["train"].flops > base["train"].flops
    # an offload copies its state over the host link; an onload of what stays resident moves nothing
    resident = phase_work(make_plan(inp.with_offload(optimizer=False)))
    assert base["offload_optimizer"].host_bytes > 0 and not _does_work(resident["offload_optimizer"])
    # each of the optimizer's storages goes to a host buffer of its own: Adam's two moments and torch's step per
    # parameter tensor on CPU; the onload frees them. megatron's tensors of tiny:qwen2 (q/k/v biases): per layer
    # linear_qkv's weight and bias, linear_proj, the two norms, fc1 and fc2; the embedding, final norm, output layer
    tensors = 7 * inp.shape.num_layers + 3
    assert base["offload_optimizer"].host_storages == 3 * tensors and base["onload_optimizer"].host_storages == 0
    assert base["train"].param_tensors == tensors  # the optimizer step steps each
    # grads are released and handed back zeroed (megatron_backend/actor_offload.py): nothing crosses to the host
    grads = base["onload_grads"].fresh_bytes
    assert not _does_work(base["offload_grads"]) and grads > 0 and base["onload_grads"].host_bytes == 0
    assert base["onload_grads"].host_in_bytes == 0
    # the train phase runs trainer.ppo_epochs train steps (run/loop.py); the rollout is the same
    epochs = phase_work(make_plan(dataclasses.replace(inp, ppo_epochs=3)))
    assert epochs["train"].flops == pytest.approx(3 * base["train"].flops)
    assert epochs["train"].param_tensors == 3 * base["train"].param_tensors
    assert epochs["rollout"] == base["rollout"]
    # full recompute runs one more forward
    recompute = phase_work(make_plan(inp.with_actor(recompute="full")))
    assert recompute["train"].flops == pytest.approx(base["train"].flops * 4 / 3)


def test_a_pipeline_pays_its_bubble_and_tp_its_all_reduces():
    inp = make_inputs()
    pp = phase_work(make_plan(dataclasses.replace(inp.with_actor(pp=2), actor_dp=1)))["train"]
    assert pp.bubble > 0
    tp = phase_work(make_plan(dataclasses.replace(inp.with_actor(tp=2), ranks_per_node=2)))["train"]
    assert tp.link_bytes["intra_node"] > 0 and not phase_work(make_plan(inp))["train"].link_bytes
    # the same group over two nodes of one rank each crosses the network
    assert set(phase_work(make_plan(inp.with_actor(tp=2)))["train"].link_bytes) == {"inter_node"}


def test_dp_reduces_fp32_main_grads_and_the_experts_over_their_own_group():
    """megatron DDP reduces the fp32 main grads (grad_reduce_in_fp32, megatron_backend/actor_train.py) whatever the
    model's dtype: a ring all-reduce sends 2 x 4 bytes x (n - 1) / n per param; the distributed optimizer's
    reduce-scatter 4 and its all-gather of the params their dtype's, each in its own count. The routed experts reduce
    over the expert-DP group: at EP = DP = 2 it is one rank, and they cross no link."""
    from planner.plan import actor_stage_counts

    for dtype, e in (("float32", 4), ("bfloat16", 2)):
        inp = dataclasses.replace(make_inputs(dtype=dtype), actor_dp=2, ranks_per_node=2)
        params, _ = actor_stage_counts(inp, 0)
        ring = phase_work(make_plan(inp))["train"]
        assert ring.link_bytes == {"intra_node": pytest.approx(params * 8 / 2)}, dtype
        assert ring.reduce_scatter_bytes == ring.all_gather_bytes == {}
        sharded = phase_work(make_plan(dataclasses.replace(inp, distributed_optimizer=True)))["train"]
        assert sharded.link_bytes == {}
        assert sharded.reduce_scatter_bytes == {"intra_node": pytest.approx(params * 4 / 2)}, dtype
        assert sharded.all_gather_bytes == {"intra_node": pytest.approx(params * e / 2)}, dtype
    moe_shape = ModelShape.from_pretrained("tiny:qwen3_moe")
    moe = make_inputs(shape=moe_shape, dtype="bfloat16", actor_dp=2, ranks_per_node=2).with_actor(ep=2)
    assert moe.expert_dp == 1
    params, experts = actor_stage_counts(moe, 0)
    assert experts > 0
    works = [phase_work(make_plan(dataclasses.replace(moe, distributed_optimizer=d)))["train"] for d in (False, True)]
    # the EP all-to-all is the same in both; the dense params' ring sends 8 / 2 bytes each, the experts nothing
    assert works[0].link_bytes["intra_node"] - works[1].link_bytes["intra_node"] == pytest.approx(
        4 * (params - experts)
    )
    assert works[1].reduce_scatter_bytes == {"intra_node": pytest.approx(4 * (params - experts) / 2)}


def test_the_distributed_optimizers_collectives_on_cpu_run_at_gloos_measured_rates():
    """On CPU the reduce-scatter's bytes take the probe's gloo reduce-scatter rate and the all-gather's its
    all-gather rate (tools/speed_probe.py), with no constant (the column has none to fit); unmeasured (a CUDA
    device, or a CPU speed without the probe's rates) they cross the link as every collective's bytes do."""
    from planner.step_time import COLUMN_CONSTANT, raw_terms

    inp = dataclasses.replace(make_inputs(), actor_dp=2, ranks_per_node=2, distributed_optimizer=True)
    work = phase_work(make_plan(inp))["train"]
    scattered, gathered = work.reduce_scatter_bytes["intra_node"], work.all_gather_bytes["intra_node"]
    measured = dataclasses.replace(CPU, gloo_reduce_scatter_bytes_per_s=3e8, gloo_all_gather_bytes_per_s=5e8)
    raw = raw_terms(work, inp, measured)
    assert raw["buckets"] == pytest.approx(scattered / 3e8 + gathered / 5e8)
    assert COLUMN_CONSTANT["buckets"] is None
    unmeasured = raw_terms(work, inp, dataclasses.replace(CPU, gloo_reduce_scatter_bytes_per_s=None))
    assert unmeasured["buckets"] == 0
    assert unmeasured["link"] - raw["link"] == pytest.approx((scattered + gathered) / CPU.intra_node_bytes_per_s)


def test_the_cpu_optimizer_step_is_torchs_adamw_pass_by_pass():
    """On CPU megatron steps with torch's AdamW (no TE or apex), one op at a time: per shard param 64 bytes through
    mapped memory and 8 into fresh tensors (the sqrt and its division), 8 more with weight decay, and a 16-bit model's
    copy from the fp32 masters (4 + 2); DDP's 1 / dp scaling reads and writes every local fp32 grad. Counted against
    the ops torch's own AdamW runs on a CPU tensor (torch's dispatcher sees each)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from planner.plan import actor_stage_counts, optimizer_shards
    from planner.step_time import torch_adamw_bytes_per_param

    class Passes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mapped = self.fresh = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor) and a.dim()]
            read = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
            if not tensors:  # the step count's scalar
                return out
            if func._schema.name.endswith("_"):  # in place: its first argument written back
                self.mapped += read + tensors[0].numel() * tensors[0].element_size()
            elif isinstance(out, torch.Tensor) and out.dim():
                self.mapped += read
                self.fresh += out.numel() * out.element_size()
            return out

    n = 4096
    for decay in (0.0, 0.1):
        param = torch.nn.Parameter(torch.randn(n))
        optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=decay, foreach=None)
        param.grad = torch.randn(n)
        optimizer.step()  # the states exist
        with Passes() as passes:
            optimizer.step()
        assert (passes.mapped / n, passes.fresh / n) == torch_adamw_bytes_per_param(4, decay > 0), decay
    assert torch_adamw_bytes_per_param(2, False) == (64 + 6, 8)

    inp = dataclasses.replace(make_inputs(dtype="float32"), actor_dp=2, ranks_per_node=2, distributed_optimizer=True)
    params, experts = actor_stage_counts(inp, 0)
    shard = sum(count / ranks for count, ranks in optimizer_shards(inp, params, experts))
    on_one = phase_work(make_plan(dataclasses.replace(inp, actor_dp=1, distributed_optimizer=False)))["train"]
    on_two = phase_work(make_plan(inp))["train"]
    # the step over half the params, and the grads' scaling over all of them
    assert on_one.memory_bytes - on_two.memory_bytes == pytest.approx(64 * (params - shard) - 8 * params)


def test_an_oversubscribed_pipeline_pays_the_larger_of_its_bubble_and_the_cores_share():
    """4 ranks on 2 cores: a stage waiting in the bubble leaves its core to another, so a pass's ops take the longer
    of the critical path (1 + bubble) and the node's work over its cores (2), not their product; on 1 rank per
    core the bubble alone."""
    from planner.step_time import raw_terms

    inp = dataclasses.replace(make_inputs().with_actor(pp=2), actor_dp=2)
    for ranks, stretch in ((4, 2.0), (2, None)):
        at = dataclasses.replace(inp, ranks_per_node=ranks)
        work = phase_work(make_plan(at))["train"]
        assert 0 < work.bubble <= 1
        raw = raw_terms(work, at, CPU)["actor_ops"]
        expected = work.actor_ops * CPU.op_seconds * (stretch or 1 + work.bubble)
        assert raw == pytest.approx(expected)


def test_each_constant_scales_its_term():
    plan = make_plan(make_inputs())
    constants = load("cpu_time").with_values(phase_ops=1000.0)
    step = predict_step_time(plan, CPU, constants)
    for name, term, factor in (("compute_efficiency", "compute", 0.5), ("phase_ops", "phase_ops", 2.0)):
        mutated = predict_step_time(plan, CPU, constants.with_values(**{name: constants.value(name) * factor}))
        assert mutated.phase("train").terms[term] == pytest.approx(2 * step.phase("train").terms[term])
    assert step.phase("train").terms["compute"] > 0


def test_a_cuda_preset_times_a_large_model_by_its_compute():
    shape = ModelShape.from_pretrained("arch:Qwen2.5-32B-Instruct")
    inputs = planner_inputs(
        shape=shape,
        device=device_preset("H100-80GB"),
        dtype="bfloat16",
        actor=dict(tp=8, micro_batch_size=4),
        rollout=dict(tp=8),
        sequences_per_step=64,
        prompt_tokens=512,
        response_tokens=1024,
        ranks_per_node=8,
    )
    plan = make_plan(inputs)
    step = predict_step_time(plan, speed_preset("H100-80GB"))
    assert step.phase("train").bound == "compute"
    assert step.seconds > 1.0


def test_a_device_without_a_speed_profile_is_named():
    with pytest.raises(ValueError, match="no speed profile for device 'V100'"):
        speed_preset("V100")
    with pytest.raises(ValueError, match="measured"):
        speed_preset("cpu")
    assert all(p.source["flops"] for p in SPEED_PRESETS.values())  # every datasheet figure cites its source


def _synthetic_rows(coefficients: dict[str, float]):
    """Rows whose seconds are known: per column, rows it dominates (0.2-1 s), and rows that mix them."""
    rng = np.random.default_rng(0)
    rows = []
    for column in coefficients:
        for _ in range(3):
            raw = {c: float(rng.uniform(0, 0.01)) / coefficients[c] for c in coefficients}
            raw[column] = float(rng.uniform(0.2, 1.0)) / coefficients[column]
            rows.append((column, raw, sum(raw[c] * coefficients[c] for c in raw)))
    for i in range(10):
        raw = {c: float(rng.uniform(0, 0.3)) / coefficients[c] for c in coefficients}
        rows.append((f"mixed{i}", raw, sum(raw[c] * coefficients[c] for c in raw)))
    return rows


def test_the_fit_recovers_known_constants_and_validation_catches_each_mutation():
    from tools.calibrate_time import fit
    from tools.validate_time import check_run, mutations

    # every constant nonzero (a fitted 0 would leave its term out of the rows)
    loaded = load("cpu_time")
    names = [name for name in COLUMN_CONSTANT.values() if name is not None]  # None: a measured rate, not fitted
    # every constant nonzero, and each efficiency below 1 (the fit holds them at most 1)
    values = {name: loaded.value(name) or 100.0 for name in names}
    values.update({name: min(values[name], 0.9) for name in EFFICIENCIES})
    constants = loaded.with_values(**values)
    truth = {c: coefficient(constants, c) for c in COLUMN_CONSTANT}
    rows = _synthetic_rows(truth)
    fitted = fit({"a": rows[::2], "b": rows[1::2]}, constants)
    measured = {c for c, name in COLUMN_CONSTANT.items() if name is None}
    assert set(fitted) == set(truth) - measured  # the draws' and the counted ops' seconds are measured rates'
    for column, value in fitted.items():
        assert value == pytest.approx(truth[column], rel=1e-6)
    assert check_run("synthetic", rows, constants)["passed"]
    for name in names:  # each constant off by 2x fails the check
        for factor in (2.0, 0.5):
            wrong = constants.with_values(**{name: constants.value(name) * factor})
            assert not check_run("synthetic", rows, wrong)["passed"], f"{name} x{factor} went unnoticed"
    # make validate-time ARGS=--mutations: the same on every fitted constant, and each measured rate's seconds
    # doubled or zeroed, each caught by the row its term dominates
    found = mutations({"synthetic": rows}, constants)
    assert len(found) == 2 * len(COLUMN_CONSTANT)
    assert [m["mutation"] for m in found if not m["caught_by"]] == []
    assert all(not m["too_small"] and m["largest_move_of_tolerance"] >= 1 for m in found)


def test_a_mutation_that_moves_no_check_by_its_tolerance_is_too_small_to_see():
    """tools/validate_time.py::largest_move: each check's move over its tolerance (a phase's 25% or 50 ms, the
    step's 15%), the largest of them; under 1 no check could catch the mutation."""
    from tools.validate_time import largest_move

    def result(rollout_s: float, log_s: float) -> dict:
        phases = {"rollout": (rollout_s, 1.0), "log": (log_s, 0.01)}
        return {
            "predicted_step_s": rollout_s + log_s,
            "measured_step_s": 1.01,
            "phases": {k: {"predicted_s": p, "measured_s": m} for k, (p, m) in phases.items()},
        }

    base = [result(0.9, 0.01)]
    assert largest_move(base, base) == 0
    # the log phase 40 ms more: under its 50 ms floor (0.8), the step 0.04 / 0.1515 (0.26)
    assert largest_move(base, [result(0.9, 0.05)]) == pytest.approx(0.8)
    # the rollout 300 ms more: 1.2 of its 250 ms, 1.98 of the step's 151.5 ms
    assert largest_move(base, [result(1.2, 0.01)]) == pytest.approx(0.3 / 0.1515)


def _full_width_bytes(fn, full: int) -> tuple[float, list[str]]:
    """Bytes per element that ``fn``'s dispatched torch ops read and write in tensors of ``full`` elements or more
    (each such argument read, each such result written), and the ops. Left out: views (no bytes move), the
    one-element-per-row ops (gather, scatter_add_) and zeros_like (planner/step_time.py counts the logits' zeroed
    gradient with the output layer's write)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    skip = {"gather", "scatter_add_", "zeros_like"}
    counted: list[tuple[str, float]] = []

    class Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if func.is_view or name in skip:
                return out
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in tensors if t.numel() >= full)
            if moved:
                counted.append((name, moved / full))
            return out

    with Bytes():
        fn()
    return sum(b for _, b in counted), [n for n, _ in counted]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("keep_softmax", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_log_prob_pass_moves_the_counted_bytes(dtype, keep_softmax, entropy_grad):
    """logprob_bytes_per_logit against what megatron_backend/logprobs.py's fused pass dispatches, forward and
    backward, over every row of a [64, 512] logits tensor."""
    import torch

    from megatron_backend.logprobs import fused_logprobs_entropy

    num_rows, vocab = 64, 512
    logits = torch.randn(num_rows, vocab, dtype=getattr(torch, dtype), requires_grad=True)
    rows, target = torch.arange(num_rows), torch.randint(0, vocab, (num_rows,))
    out = {}

    def forward():
        out["lp"], out["entropy"] = fused_logprobs_entropy(logits, rows, target, 0, vocab, None, 1024, keep_softmax)

    def backward():
        loss = out["lp"].sum() + (out["entropy"].sum() if entropy_grad else 0)
        loss.backward()

    e = logits.element_size()
    forward_bytes, _ = _full_width_bytes(forward, num_rows * vocab)
    backward_bytes, _ = _full_width_bytes(backward, num_rows * vocab)
    assert forward_bytes == logprob_bytes_per_logit(e, False, keep_softmax, entropy_grad)
    assert backward_bytes == logprob_bytes_per_logit(e, True, keep_softmax, entropy_grad)


def test_the_native_sampler_dispatches_the_counted_ops():
    """sampler_bytes_per_logit counts the kernels inside logsumexp, softmax and multinomial from torch's source; here
    the ops themselves are pinned: which full-width ops the native sampler dispatches (a new pass fails it)."""
    import torch

    from rollout.engine import SamplingParams
    from rollout.native.sampling import Sampler

    sampler = Sampler(SamplingParams(temperature=1.0, max_tokens=4, seed=0), torch.device("cpu"))
    for dtype, cast in ((torch.float32, []), (torch.bfloat16, ["_to_copy"])):
        logits = torch.randn(64, 512, dtype=dtype)
        _, ops = _full_width_bytes(lambda: sampler(logits), 64 * 512)  # noqa: B023
        assert ops == [*cast, "logsumexp", "div", "_softmax", "multinomial"]


def test_vllms_cpu_build_unpacks_and_repacks_its_weights_around_a_sync():
    """rollout/vllm_engine.py on CPU: the sync gives each layer back its unprocessed weights (new, zeroed) and repacks
    them after (new copies): two fresh writes and one read of the engine's weights more than the native engine's
    sync; on CUDA the kernels use the loaded weights and the syncs are the same."""
    for device, repacked in ((None, True), (device_preset("H100-80GB"), False)):
        inp = make_inputs() if device is None else make_inputs(device=device, dtype="bfloat16")
        native_plan, vllm_plan = (make_plan(inp.with_rollout(engine=engine)) for engine in ("native", "vllm"))
        native, vllm = (phase_work(p)["weight_sync"] for p in (native_plan, vllm_plan))
        weights = vllm_plan.engine_weight_bytes
        assert weights == native_plan.engine_weight_bytes > 0
        assert vllm.fresh_bytes - native.fresh_bytes == (2 * weights if repacked else 0)
        assert vllm.memory_bytes - native.memory_bytes == (weights if repacked else 0)


def test_the_sync_checksum_dispatches_the_counted_ops_and_bytes():
    """weight_sync.verify's checksum of a row slice: CHECKSUM_OPS dispatched ops (views included), and per element
    the slice's read plus the int64 buffers' counted writes and reads (a new pass or a wider dtype fails it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from weight_sync.verify import checksum

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(256, 96).to(dtype).narrow(0, 64, 128)
        with Ops() as ops:
            checksum(rows)
        assert ops.count == CHECKSUM_OPS
        moved, _ = _full_width_bytes(lambda: checksum(rows), rows.numel())  # noqa: B023
        assert moved == rows.element_size() + CHECKSUM_WRITTEN_BYTES_PER_ELEMENT + CHECKSUM_READ_BYTES_PER_ELEMENT


_GATHER_PAGES = """
import json, os, resource, torch, torch.distributed as dist
from colocation.host_memory import configure_host_allocator
configure_host_allocator()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
blocks = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB, as gather_hf_tensors' clones
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ratios = []
for _ in range(3):
    before = faults()
    out = [None]
    dist.all_gather_object(out, blocks)
    ratios.append((faults() - before) * resource.getpagesize() / (8 << 20))
    del out
dist.destroy_process_group()
print(json.dumps(ratios))
"""


def test_all_gather_object_writes_the_counted_copies_into_fresh_pages():
    """reference_check_work counts torch's all_gather_object (gloo) as 8 writes of the object into fresh memory on
    one rank (4 pickling, the gathered tensor, its bytes, 2 unpickling): its page faults under the run's allocator
    (colocation/host_memory.py) say how many copies of an 8 MiB object it made (measured 8.0; a count of 7 or 9
    fails)."""
    import json
    import subprocess
    import sys

    from run.launch import free_port

    env = {**os.environ, "PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", _GATHER_PAGES], capture_output=True, text=True, env=env, check=True)
    copies = json.loads(out.stdout.splitlines()[-1])
    counted = all_gather_object_written_bytes(own=1, largest=1, gathered=1, ranks=1)
    assert all(abs(c - counted) < 0.5 for c in copies), (copies, counted)


def test_a_skinny_gemm_is_timed_at_its_row_count_between_the_measured_ones():
    """SpeedSpec.gemm_seconds_per_byte: the measured value at a measured row count, log-log between two, the first
    below it (the weight is read whatever the rows), growing with the rows past the last; None without a table."""
    table = {"float32": {"1": 1e-10, "4": 4e-10, "16": 8e-10}}  # JSON's string keys
    speed = dataclasses.replace(CPU, gemm_seconds_per_weight_byte=table)
    assert speed.gemm_seconds_per_byte("float32", 4) == pytest.approx(4e-10)
    assert speed.gemm_seconds_per_byte("float32", 2) == pytest.approx(2e-10)  # halfway in log rows
    assert speed.gemm_seconds_per_byte("float32", 0.5) == pytest.approx(1e-10)
    assert speed.gemm_seconds_per_byte("float32", 32) == pytest.approx(16e-10)
    assert speed.gemm_seconds_per_byte("bfloat16", 4) is None and CPU.gemm_seconds_per_byte("float32", 4) is None
    with pytest.raises(ValueError, match="gemm_seconds_per_weight_byte"):
        dataclasses.replace(CPU, gemm_seconds_per_weight_byte={"float32": {"0": 1e-10}})


def test_the_probes_gemm_table_is_the_planned_weights_mean_by_their_bytes():
    """tools/speed_probe.py: each shape's seconds per byte weighted by its bytes (out x in x how many); the planned
    weights are measured in the planned dtype only, and a bad request is refused before anything is timed."""
    from tools.speed_probe import measure_cpu_speed, mixed_gemm_table

    tables = {(4, 2): {1: 1.0, 8: 10.0}, (2, 2): {1: 4.0, 8: 1.0}}
    # bytes 4 x 2 x 3 = 24 and 2 x 2 x 2 = 8
    assert mixed_gemm_table(tables, {(4, 2): 3, (2, 2): 2}) == pytest.approx({1: 7 / 4, 8: 31 / 4})
    with pytest.raises(ValueError, match="dtype=None: gemm_weights are measured in the planned dtype"):
        measure_cpu_speed({(768, 512): 1})
    with pytest.raises(ValueError, match="every \\(out, in\\) and count must be >= 1"):
        measure_cpu_speed({(768, 0): 1}, "float32")
    recorded = dataclasses.replace(CPU, gemm_weights=[[768, 512, 8]])  # speed.json's lists
    assert recorded.gemm_weights == ((768, 512, 8),)


def test_the_native_engines_gemms_run_at_their_row_counts():
    """The native engine's linears (rollout/native/model.py) as {rows: weight bytes}: per wave a prefill of the
    prompts' tokens, then a decode step per response token of the wave's running sequences; the lm_head on the
    sampled rows. An MoE layer runs each local expert on its own rows: of R rows' top-k choices over E experts, a
    local one is hit with probability 1 - (1 - k/E)^R. Without a measured table (a CUDA profile) the same GEMMs
    cost their FLOPs at the peak and their weights read once at the bandwidth, as before they had rows."""
    from planner.sizes import engine_param_count, vllm_padded_vocab
    from planner.step_time import raw_terms

    inp = make_inputs(rollout=dict(engine="native", max_num_seqs=8))
    plan = make_plan(inp)
    lengths = inp.planned_lengths()
    rollout = phase_work(plan)["rollout"]
    s, e = inp.shape, inp.element_bytes
    table = vllm_padded_vocab(s.vocab_size) * s.hidden_size * e
    layers = engine_param_count(s, 1) * e - 2 * table  # less the embedding and the lm_head (its norms' few bytes in)
    steps = lengths.longest_response  # one wave of the 8 sequences
    prefill_rows, decode_rows = 8 * lengths.mean_prompt, 8 * lengths.mean_response / steps
    assert (prefill_rows, decode_rows) == (8 * 32, 8)  # the 8 sampled rows of prefill are a decode step's
    assert rollout.gemms == pytest.approx({prefill_rows: layers, 8: table + steps * (layers + table)})
    # without a table: the FLOPs of every linear at the peak, each weight read once per pass
    raw = raw_terms(rollout, inp, CPU)
    flops = 2 * (prefill_rows * layers + 8 * table + steps * decode_rows * (layers + table)) / e
    attention = rollout.flops
    assert raw["compute"] * CPU.flops("float32") == pytest.approx((flops + attention) * CPU.compute_stretch(1))
    assert raw["gemm"] == 0
    # with one: the measured seconds per weight byte at each row count, FLOPs and reads included
    measured = dataclasses.replace(CPU, gemm_seconds_per_weight_byte={"float32": {"1": 1e-10, "256": 2e-9}})
    raw = raw_terms(rollout, inp, measured)
    expected = sum(b * measured.gemm_seconds_per_byte("float32", r) for r, b in rollout.gemms.items())
    assert raw["gemm"] == pytest.approx(expected * CPU.compute_stretch(1))
    assert raw["compute"] * CPU.flops("float32") == pytest.approx(attention * CPU.compute_stretch(1))

    moe = make_inputs(shape=ModelShape.from_pretrained("tiny:qwen3_moe"), rollout=dict(engine="native", max_num_seqs=8))
    gemms = phase_work(make_plan(moe), lengths)["rollout"].gemms
    ms, k, num = moe.shape, moe.shape.moe_top_k, moe.shape.num_experts
    expert = 3 * ms.hidden_size * ms.moe_intermediate_size * e * len(ms.moe_layers)
    hit = num * (1 - (1 - k / num) ** decode_rows)
    # a decode step's experts: the hit ones, each on its share of the rows' k choices
    assert gemms[decode_rows * k / hit] == pytest.approx(steps * expert * hit)
    assert decode_rows * k / hit > decode_rows * k / num


def test_the_native_engines_collectives_on_cpu_are_gloos_at_the_measured_all_reduce():
    """On CPU the native engine's collectives are torch.distributed's on gloo (rollout/native/model.py): their ring
    steps are timed at the probe's 2-rank gloo all-reduce (two steps each), nothing fitted or stretched; unmeasured, they are
    collective steps at the fitted constant. vLLM's CPU build all-reduces in shared memory and NCCL runs on CUDA:
    their steps stay the fitted ones."""
    from planner.step_time import raw_terms

    native = dataclasses.replace(make_inputs(rollout=dict(engine="native", tp=2)).with_actor(tp=2), ranks_per_node=2)
    lengths = native.planned_lengths()
    rollout = phase_work(make_plan(native))["rollout"]
    # per decode step and per prefill: the embedding's and 2 per layer's all-reduces (2 (tp - 1) steps each), the
    # logits' all-gather and the sampled tokens' broadcast (tp - 1 each)
    forwards = lengths.longest_response + 1
    assert rollout.gloo_steps == forwards * (2 * (1 + 2 * native.shape.num_layers) + 2)
    assert rollout.collective_steps == 0
    measured = dataclasses.replace(CPU, cores=2, gloo_all_reduce_seconds=1e-3)
    raw = raw_terms(rollout, native, measured)
    assert raw["gloo"] == pytest.approx(rollout.gloo_steps * 1e-3 / 2)
    assert raw["collective_ops"] == 0
    unmeasured = raw_terms(rollout, native, dataclasses.replace(CPU, cores=2))
    assert unmeasured["gloo"] == 0
    assert unmeasured["collective_ops"] == pytest.approx(rollout.gloo_steps * CPU.op_seconds)
    # 4 ranks on the 2 cores (two TP-2 engines): each group's all-reduce at the measured rate, not stretched by the
    # oversubscription as an op is (measured: two groups on 2 cores all-reduce no slower than one)
    crowded = dataclasses.replace(native, ranks_per_node=4)
    assert raw_terms(rollout, crowded, measured)["gloo"] == pytest.approx(rollout.gloo_steps * 1e-3 / 2)
    assert raw_terms(rollout, crowded, measured)["phase_ops"] == pytest.approx(2 * raw["phase_ops"])

    vllm = phase_work(make_plan(native.with_rollout(engine="vllm")))["rollout"]
    assert vllm.gloo_steps == 0 and vllm.collective_steps > 0
    assert raw_terms(vllm, native, measured)["gloo"] == 0


def test_the_optimizer_step_reads_and_writes_each_ranks_shard_the_experts_over_expert_dp():
    """With the distributed optimizer each rank steps its shard (planner.plan.optimizer_shards): the dense params'
    over DP, the routed experts' over the expert-DP group, which at EP = DP = 2 is one rank: every expert's
    param, grad and states are read and written on each rank, as the memory plan holds them."""
    from planner.plan import actor_stage_counts
    from planner.step_time import torch_adamw_bytes_per_param

    moe = make_inputs(shape=ModelShape.from_pretrained("tiny:qwen3_moe"), actor_dp=2, ranks_per_node=2).with_actor(ep=2)
    assert not moe.on_cuda
    params, experts = actor_stage_counts(moe, 0)
    mapped, fresh = torch_adamw_bytes_per_param(moe.element_bytes, weight_decay=False)  # param, grad, states
    works = [phase_work(make_plan(dataclasses.replace(moe, distributed_optimizer=d)))["train"] for d in (False, True)]
    # the dense half of the shard saved, the experts whole on both
    assert works[0].memory_bytes - works[1].memory_bytes == pytest.approx((params - experts) * mapped / 2)
    assert works[0].fresh_bytes - works[1].fresh_bytes == pytest.approx((params - experts) * fresh / 2)


def test_the_distributed_optimizer_steps_the_tensors_its_shard_overlaps():
    """megatron's DDP buffer holds the tensors in reverse order, each from a multiple of 64 elements, in buckets of
    at least max(40M, 1M x DP) elements padded to a multiple of lcm(DP, 128), each split evenly over DP; a rank
    steps every tensor its shard overlaps (a tensor cut by a shard's edge is stepped by both ranks)."""
    from planner.step_time import _shard_tensors

    assert _shard_tensors([10, 10, 10, 10], 1) == 4 and _shard_tensors([], 2) == 0
    assert _shard_tensors([10, 10, 10, 10], 2) == 2
    assert _shard_tensors([1, 100, 1], 2) == 2  # the large one cut in two
    assert _shard_tensors([30, 10], 2) == 1  # reversed: [0, 10) and [64, 94) of 128: one in each half
    assert _shard_tensors([200, 10], 2) == 2  # [0, 10) and [64, 264) of 384: rank 0's [0, 192) holds both
    assert _shard_tensors([5] * 8, 4) == 2
    # two buckets (40M elements each at least), each sharded on its own: one tensor per rank in each
    assert _shard_tensors([40_000_000, 40_000_000], 2) == 2


def _layer_param_names(rank: int, world_size: int, family: str) -> list[str]:
    """The first decoder layer's parameter names in megatron's local model, in the order the model registers them."""
    from megatron_backend.model import build_gpt_chunks
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    shape = ModelShape.from_pretrained(f"tiny:{family}")
    [model] = build_gpt_chunks(shape, initialize_model_parallel(tp=world_size, pp=1, vpp=None))
    prefix = "decoder.layers.0."
    return [name.split(prefix, 1)[1] for name, _ in model.named_parameters() if prefix in name]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_the_planners_layer_order_is_the_order_megatron_registers(family):
    """DDP's buffer, and so the distributed optimizer's shards (_shard_tensors), follow the order the model registers
    its parameters: modelspec.family.megatron_layer_param_order gives it, a linear's bias after its weight (Qwen2's
    qkv bias), the experts one by one."""
    from modelspec.family import megatron_layer_param_order

    names = run_ranks(_layer_param_names, 1, family)[0]
    assert any(name.endswith("bias") for name in names) or family == "qwen3_moe"
    assert names == sorted(names, key=megatron_layer_param_order)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize(("tp", "pp", "ep", "te_norms"), [(1, 1, 1, False), (2, 2, 1, False), (1, 2, 2, True)])
def test_the_planners_actor_tensors_are_megatrons_layout(family, tp, pp, ep, te_norms):
    """planner.sizes.actor_stage_param_tensors (the planner may not import megatron_backend) holds the tensors
    megatron_backend/layout.py lays out on a rank, each of its size, and as many elements as the plan counts."""
    from megatron_backend.layout import RankLayout, local_param_shapes
    from planner.sizes import actor_stage_param_count, actor_stage_param_tensors

    shape = ModelShape.from_pretrained(f"tiny:{family}")
    ep = ep if shape.is_moe else 1
    for stage in range(pp):
        dense, experts = actor_stage_param_tensors(shape, tp, pp, stage, ep, te_norms=te_norms)
        layout = RankLayout(
            tp=tp, pp=pp, vpp=None, tp_rank=0, pp_rank=stage, te_norms=te_norms, ep=ep, grouped_experts=te_norms
        )
        shapes = local_param_shapes(shape, layout)
        assert sorted(dense + experts) == sorted(int(np.prod(s)) for s in shapes.values())
        assert len(experts) == sum(".experts." in name for _, name in shapes)
        assert sum(dense + experts) == actor_stage_param_count(shape, tp, pp, stage, ep)


def test_the_weight_syncs_exchange_on_cpu_runs_at_gloos_measured_exchange_rate():
    """The sync's point-to-point sends and receives (weight_sync/transport.py's batch_isend_irecv; the busier
    direction's bytes, SyncTraffic.crossing_bytes) are exchange bytes: on CPU timed at the probe's measured gloo
    exchange, nothing fitted; unmeasured (CUDA), over the link with the collectives' bytes, as before. Their staged
    part is written fresh and copied."""
    from planner.inputs import SyncTraffic
    from planner.step_time import raw_terms

    traffic = (SyncTraffic(local_bytes=1 << 20, sent_bytes=48 << 20, received_bytes=40 << 20, checksums=8),)
    inp = dataclasses.replace(make_inputs().with_actor(tp=2).with_rollout(tp=1), sync_traffic=traffic)
    sync = phase_work(make_plan(inp))["weight_sync"]
    assert sum(sync.exchange_bytes.values()) == 48 << 20
    measured = dataclasses.replace(CPU, gloo_exchange_bytes_per_s=1e9)
    raw, unmeasured = raw_terms(sync, inp, measured), raw_terms(sync, inp, CPU)
    assert raw["exchange"] == pytest.approx((48 << 20) / 1e9)
    assert unmeasured["exchange"] == 0
    # unmeasured, the same bytes cross the link (at the copy's rate, the fitted efficiency applied later)
    assert unmeasured["link"] - raw["link"] == pytest.approx((48 << 20) / CPU.intra_node_bytes_per_s)
    # what the executor packs (weight_sync/execute.py): a fresh buffer each; the sent ones read from the shard, the
    # received ones read again and written into the engine's tensors
    staged = dataclasses.replace(traffic[0], staged_sent_bytes=8 << 20, staged_received_bytes=6 << 20)
    packed = phase_work(make_plan(dataclasses.replace(inp, sync_traffic=(staged,))))["weight_sync"]
    assert packed.fresh_bytes - sync.fresh_bytes == 14 << 20
    assert packed.memory_bytes - sync.memory_bytes == (8 << 20) + 2 * (6 << 20)


def test_the_reference_checks_gather_runs_at_gloos_all_gather_rate_and_its_copies_read_their_sources():
    """weight_sync/reference.py's check on CPU: its all_gather_object crosses at the probe's gloo all-gather rate
    (SpeedSpec.gloo_all_gather_bytes_per_s, nothing fitted; unmeasured, over the link as before), and every copy it
    makes into fresh memory reads its source, but for the bytes gloo receives from the other ranks."""
    from planner.inputs import ReferenceSample
    from planner.step_time import raw_terms, reference_check_work

    mib = 1 << 20  # elements; fp32
    sample = ReferenceSample(own=(3 * mib,), largest=3 * mib, gathered=5 * mib, full=5 * mib, ranks=2)
    inp = dataclasses.replace(make_inputs(), reference_check=(sample,))
    work = reference_check_work(inp)
    assert (
        work.all_gather_bytes == {"intra_node": 4 * 3 * mib} and not work.link_bytes
    )  # one rank's 3 Mi from the other
    copies = {  # elements each copy writes (gather_hf_tensors; torch 2.13's all_gather_object) and, after, reads
        "clones": (3, 3),
        "pickling, 4 copies": (4 * 3, 4 * 3),
        "the gathered [2 x 3 Mi] tensor: its own part copied, the other received": (2 * 3, 3),
        "tobytes of each rank's": (2 * 3, 2 * 3),
        "unpickling, 2 copies of every rank's blocks": (2 * 5, 2 * 5),
        "the full tensors, filled from the blocks": (5, 5),
    }
    assert work.fresh_bytes == 4 * mib * sum(w for w, _ in copies.values())
    compared = 2 * 5  # the full tensors' slices and the engine's
    assert work.memory_bytes == 4 * mib * (sum(r for _, r in copies.values()) + compared)
    measured = dataclasses.replace(CPU, gloo_all_gather_bytes_per_s=1e9, gloo_reduce_scatter_bytes_per_s=1e9)
    raw, unmeasured = raw_terms(work, inp, measured), raw_terms(work, inp, CPU)
    assert raw["buckets"] == pytest.approx(4 * 3 * mib / 1e9) and raw["link"] == 0
    assert unmeasured["buckets"] == 0
    assert unmeasured["link"] == pytest.approx(4 * 3 * mib / CPU.intra_node_bytes_per_s)


MIN_ROW_BYTES = 64  # [N, a few] tensors are left out: the norms' [N, 1], the scheduler's [N, max_tokens] log-probs


def _new_float_tensors(record):
    """A dispatch mode calling ``record(t)`` for each floating-point tensor an op returns whose storage is none of its
    inputs' (``reshape`` and ``to`` make one when they copy)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class NewTensors(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.is_floating_point() and t.untyped_storage().data_ptr() not in inputs | {0}:
                    record(t)
            return out

    return NewTensors()


def _new_tensor_sizes(run, smallest: int) -> dict[int, int]:
    """{bytes: how many} of the new floating-point tensors (:func:`_new_float_tensors`) of ``smallest`` bytes or more
    that ``run()`` allocates."""
    from collections import Counter

    sizes = Counter()

    def record(t):
        if t.untyped_storage().nbytes() >= smallest:
            sizes[t.untyped_storage().nbytes()] += 1

    with _new_float_tensors(record):
        run()
    return sizes


def _decode_step_new_tensors(engine, prompt_tokens: int, batch: int) -> dict[int, int]:
    """{bytes per row: how many} of the floating-point tensors of :data:`MIN_ROW_BYTES` a row or more that one decode
    step of ``engine`` allocates: a generate of three tokens less one of two, ``batch`` prompts of ``prompt_tokens``
    tokens, every sequence running."""
    from rollout.engine import SamplingParams

    prompts = [[1, *range(5, 4 + prompt_tokens)] for _ in range(batch)]
    counted = []
    for tokens in (2, 3):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0)
        counted.append(_new_tensor_sizes(lambda p=params: engine.generate(prompts, p), MIN_ROW_BYTES * batch))
    step = counted[1] - counted[0]
    assert all(size % batch == 0 for size in step), step
    return {size // batch: n for size, n in step.items()}


@pytest.mark.parametrize(
    ("family", "dtype"), [("qwen2", "float32"), ("qwen2", "bfloat16"), ("qwen3", "float32"), ("qwen3", "bfloat16")]
)
def test_the_native_engines_new_tensors_are_counted(tiny_model_dirs, family, dtype):
    """planner.sizes.native_new_tensor_bytes_per_row against what a real engine's decode step allocates (TP 1: fp32
    through TorchScript, 16-bit eager; Qwen2's qkv bias, Qwen3's q / k norms). What grows with the context (the
    gathered blocks, scores, masks) is told apart by its size: the step is taken at two contexts (15 and 40 cached
    tokens) and only the tensors both allocate at the same size per row are compared. The sampler's logsumexp and
    multinomial fill [N, V] tensors inside their kernels, out of the dispatcher's sight (their pages are counted in
    test_the_native_samplers_kernels_fault_their_counted_tensors)."""
    from configs.rollout import RolloutConfig
    from rollout.native import NativeEngine

    engine = NativeEngine(
        RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=8),
        tiny_model_dirs[family],
        device="cpu",
        dtype=dtype,
    )
    steps = [_decode_step_new_tensors(engine, prompt, 8) for prompt in (15, 40)]
    seen, counted = _seen_against_counted(engine.shape, 1, engine.dtype.itemsize, steps)  # fp32: TorchScript
    assert seen == counted


def _seen_against_counted(shape, rollout_tp: int, e: int, steps: list[dict[int, int]]) -> tuple:
    """(what a decode step allocated at both contexts alike, what planner.sizes counts of the :data:`MIN_ROW_BYTES`
    a row or more) for an eager decode step at ``rollout_tp``; the sampler's two kernel-internal tensors taken out."""
    from collections import Counter

    from planner.sizes import FP32_BYTES, native_new_tensor_bytes_per_row

    short, long = (Counter(step) for step in steps)
    seen = short & long  # the same size at both contexts
    assert long - seen, "a context-sized tensor (the gathered blocks) was expected at the longer context"
    counted = native_new_tensor_bytes_per_row(
        shape, rollout_tp, e, prefill=False, scripted=rollout_tp == 1 and e == FP32_BYTES and not shape.is_moe
    )
    expected = Counter(counted["token"]) + Counter(counted["sampled"])
    expected[shape.vocab_size * FP32_BYTES] -= 2  # logsumexp's and multinomial's, inside their kernels
    return seen, Counter({w: n for w, n in expected.items() if w >= MIN_ROW_BYTES and n > 0})


def _tp_decode_steps_new_tensors(rank: int, world_size: int, model_dir: str, dtype: str) -> tuple:
    """One engine rank of a TP ``world_size`` native engine: (its model's shape, :func:`_decode_step_new_tensors` at
    15 and 40 cached tokens, 8 sequences)."""
    import torch.distributed as dist

    from configs.rollout import RolloutConfig
    from rollout.native import NativeEngine

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    engine = NativeEngine(
        RolloutConfig(tp=world_size, cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=8),
        model_dir,
        group=dist.group.WORLD,
        device="cpu",
        dtype=dtype,
    )
    return engine.shape, [dict(_decode_step_new_tensors(engine, prompt, 8)) for prompt in (15, 40)]


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "float32"), ("qwen3", "bfloat16")])
def test_the_native_engines_tp2_new_tensors_are_counted(tiny_model_dirs, family, dtype):
    """The same list at engine TP 2 (two gloo ranks, eager): the embedding's masked copy, o_proj's and down's ``mm``
    then ``x +`` it, the lm_head's [P / 2] part, the two gathered parts and their concatenation, every layer's widths
    halved, on each rank alike."""

    ranks = run_ranks(_tp_decode_steps_new_tensors, 2, tiny_model_dirs[family], dtype)
    assert ranks[0] == ranks[1]
    shape, steps = ranks[0]
    seen, counted = _seen_against_counted(shape, 2, 4 if dtype == "float32" else 2, steps)
    assert seen == counted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_engines_moe_tensors_are_counted(tiny_model_dirs, dtype):
    """An MoE layer's new tensors against planner.sizes (Qwen3-MoE, TP 1, eager), over a whole generate (prefill and
    decode steps): inside ``NativeModel.moe`` each width's rows summed over its calls are the counted per-token
    entries (the router's logits, their fp32 copy and softmax, the zeroed output: N rows each per call) plus the
    counted per-expert entries (the gathered input, gate_up, silu, the product, fc2's output and its weighted copy:
    one row per routed (token, choice), N k per call at EP 1). The block's ``x +`` of the output is outside."""
    from collections import Counter

    from configs.rollout import RolloutConfig
    from planner.sizes import native_moe_tensor_bytes
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    engine = NativeEngine(
        RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=8),
        tiny_model_dirs["qwen3_moe"],
        device="cpu",
        dtype=dtype,
    )
    shape, model = engine.shape, engine.model
    assert shape.is_moe
    rows_by_width, calls = Counter(), []

    def record(t):  # {bytes per row: rows} of the new [rows, width] floating-point tensors
        if t.dim() == 2 and t.shape[0] and t.shape[1] * t.element_size() >= 64:
            rows_by_width[t.shape[1] * t.element_size()] += t.shape[0]

    moe = model.moe

    def counted_moe(x, w, layer):
        calls.append(x.shape[0])
        with _new_float_tensors(record):
            return moe(x, w, layer)

    model.moe = counted_moe
    engine.generate([[1, *range(5, 4 + n)] for n in (9, 14, 20)], SamplingParams(max_tokens=4, ignore_eos=True))
    per_token, per_expert_row = native_moe_tensor_bytes(shape, 1, engine.dtype.itemsize)
    tokens, expected = sum(calls), Counter()
    for width in per_token:
        expected[width] += tokens
    expected[shape.hidden_size * engine.dtype.itemsize] -= tokens  # the block's ``x +`` of the output
    for width in per_expert_row:
        expected[width] += tokens * shape.moe_top_k
    assert rows_by_width == Counter({w: n for w, n in expected.items() if w >= 64 and n > 0})


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "float32"), ("qwen3", "bfloat16")])
def test_the_native_engines_prefill_tensors_are_counted(tiny_model_dirs, family, dtype):
    """The same list for a prefill (``prefill=True``: eager, SDPA) against a real engine's: 8 prompts of 24 tokens, one
    token each (no decode step), every floating-point tensor of 512 bytes or more by its size: the per-token ones at
    8 x 24 rows, the sampled ones at 8. The [B, 1, L, L] mask is bool; the sampler's two kernel-internal tensors as
    above."""
    from collections import Counter

    from configs.rollout import RolloutConfig
    from planner.sizes import FP32_BYTES, native_new_tensor_bytes_per_row
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    seqs, length, smallest = 8, 24, 512
    engine = NativeEngine(
        RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=seqs),
        tiny_model_dirs[family],
        device="cpu",
        dtype=dtype,
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True, seed=0)
    sizes = _new_tensor_sizes(lambda: engine.generate([[1, *range(5, 4 + length)]] * seqs, params), smallest)
    counted = native_new_tensor_bytes_per_row(engine.shape, 1, engine.dtype.itemsize, prefill=True)
    expected = Counter()
    for kind, rows in (("token", seqs * length), ("sampled", seqs)):
        for width, n in counted[kind].items():
            expected[width * rows] += n
    expected[engine.shape.vocab_size * FP32_BYTES * seqs] -= 2  # logsumexp's and multinomial's, inside their kernels
    assert sizes == Counter({size: n for size, n in expected.items() if size >= smallest and n > 0})


_SAMPLER_PAGES = """
import json, resource, torch
from colocation.host_memory import configure_host_allocator
configure_host_allocator()
from rollout.engine import SamplingParams
from rollout.native.sampling import Sampler
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = {}
for dtype in ("float32", "bfloat16"):
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), torch.device("cpu"))
    logits = torch.randn(32, 16384).to(getattr(torch, dtype))
    sampler(logits)  # warm
    pages = []
    for _ in range(3):
        before = faults()
        sampler(logits)
        pages.append(faults() - before)
    out[dtype] = pages
print(json.dumps(out))
"""


def test_the_native_samplers_kernels_fault_their_counted_tensors():
    """The native sampler at temperature 1 on [32, 16384] logits, under the run's allocator
    (colocation/host_memory.py): each [32, V] fp32 tensor that planner.sizes.native_new_tensor_bytes_per_row counts
    for it (logsumexp's ``self - max`` and multinomial's draws inside their kernels, the temperature's quotient, the
    softmax; in 16-bit the ``float`` copy too) is a fresh mapping of 512 pages and one more for its header: the page
    faults of a call are exactly that many (measured 2052 and 2565; a tensor more or fewer is 513 off)."""
    import json
    import subprocess
    import sys

    from modelspec.tiny import tiny_hf_config
    from planner.sizes import FP32_BYTES, native_new_tensor_bytes_per_row

    out = subprocess.run([sys.executable, "-c", _SAMPLER_PAGES], capture_output=True, text=True, check=True)
    faults = json.loads(out.stdout.splitlines()[-1])
    shape = ModelShape.from_hf_config(tiny_hf_config("qwen2", vocab_size=16384))
    row = shape.vocab_size * FP32_BYTES
    for dtype, e in (("float32", 4), ("bfloat16", 2)):
        sampled = native_new_tensor_bytes_per_row(shape, 1, e, prefill=False)["sampled"]
        lm_head = 1 if shape.vocab_size * e == row else 0  # the lm_head's [N, P] logits: not the sampler's
        tensors = sampled[row] - lm_head
        assert faults[dtype] == [tensors * (32 * row // 4096 + 1)] * 3, (dtype, faults[dtype], tensors)


def test_the_actors_tp_all_reduces_on_cpu_are_gloos_at_the_measured_all_reduce():
    """On CPU the actor's TP all-reduces (megatron's mappings.py, megatron_backend/logprobs.py) run over gloo: their
    ring steps are timed at the probe's 2-rank all-reduce, nothing fitted (COLUMN_CONSTANT: None). PP's sends stay
    fitted collective steps; on CUDA (NCCL) the TP all-reduces do too."""
    from planner.step_time import raw_terms

    tp2 = dataclasses.replace(make_inputs().with_actor(tp=2), ranks_per_node=2)
    works = phase_work(make_plan(tp2))
    measured = dataclasses.replace(CPU, cores=2, gloo_all_reduce_seconds=1e-3)
    for name in ("old_logprob", "train"):
        work = works[name]
        assert work.actor_gloo_steps > 0 and work.collective_steps == 0, name
        raw = raw_terms(work, tp2, measured)
        assert raw["actor_gloo"] == pytest.approx(work.actor_gloo_steps * 1e-3 / 2)
        assert raw["collective_ops"] == 0 and raw["gloo"] == 0
        unmeasured = raw_terms(work, tp2, dataclasses.replace(CPU, cores=2))
        assert unmeasured["actor_gloo"] == 0
        assert unmeasured["collective_ops"] == pytest.approx(work.actor_gloo_steps * CPU.op_seconds)
    assert COLUMN_CONSTANT["actor_gloo"] is None
    # 4 ranks on the 2 cores (PP 2 x TP 2): a call waits for its partner's share of the cores, stretched as an op is
    # (measured inside tiny_cpu_pp_long_responses: 1.6-2.4 ms a call against the probe's 0.83), unlike the engine's
    crowded = dataclasses.replace(tp2, ranks_per_node=4)
    work = works["old_logprob"]
    assert raw_terms(work, crowded, measured)["actor_gloo"] == pytest.approx(2 * work.actor_gloo_steps * 1e-3 / 2)
    pp = phase_work(make_plan(dataclasses.replace(tp2.with_actor(pp=2), actor_dp=1, ranks_per_node=4)))["train"]
    assert pp.collective_steps > 0 and pp.actor_gloo_steps > 0
    on_cuda = dataclasses.replace(tp2, device=device_preset("H100-80GB"))
    cuda = phase_work(make_plan(on_cuda))["old_logprob"]
    assert cuda.actor_gloo_steps == 0 and cuda.collective_steps == works["old_logprob"].actor_gloo_steps


def _tp_all_reduces_per_phase(rank, world_size, hf_dir):
    """A TP=2 dense actor's log-prob pass, then one train step, on gloo: the all-reduces over the TP group in each."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=world_size, pp=1)
    actor = Actor(hf_dir, ActorConfig(tp=world_size, micro_batch_size=2, lr=1e-4), dims)
    tp_group = mpu.get_tensor_model_parallel_group()
    counts = {"logprobs": 0, "train": 0}
    current = ["logprobs"]
    all_reduce = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is tp_group:
            counts[current[0]] += 1
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting  # megatron's mappings.py and logprobs.py look it up at call time
    try:
        ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
        batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.old_logprobs = actor.compute_logprobs(batch)
        current[0] = "train"
        actor.train_step(batch, PolicyLoss(PolicyLossConfig()))
    finally:
        dist.all_reduce = all_reduce
    return counts


def test_the_actors_tp_all_reduces_are_counted(tiny_model_dirs):
    """The actor's TP all-reduces the step-time model times at gloo's measured all-reduce are the ones megatron and the
    log-prob pass run, on two real ranks: per micro-batch 2 per layer and pass direction, the embedding's forward,
    the output layer's backward and 4 per log-prob chunk."""

    shape = ModelShape.from_pretrained(tiny_model_dirs["qwen2"])
    ranks = run_ranks(_tp_all_reduces_per_phase, 2, tiny_model_dirs["qwen2"])
    assert ranks[0] == ranks[1]
    inp = make_inputs(shape=shape, sequences_per_step=4, prompt_tokens=8, response_tokens=8, ranks_per_node=2)
    inp = inp.with_actor(tp=2, micro_batch_size=2)
    works = phase_work(make_plan(inp))
    for phase, counted in (("logprobs", "old_logprob"), ("train", "train")):
        assert ranks[0][phase] == works[counted].actor_gloo_steps / 2, (phase, ranks[0])


def _actor_ops_by_micro_batches(rank, world_size, hf_dir):
    """Torch ops of a TP=1 actor's log-prob pass and train step at 2 and 4 micro-batches of 2 sequences, after a warm-up,
    then at 2 in 4 and in 8 log-prob chunks: (all, inside GPTModel.forward) for each."""
    import megatron.core.models.gpt.gpt_model as gpt_model
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.losses import PolicyLoss, PolicyLossConfig

    class Count(TorchDispatchMode):
        ops = 0
        in_model = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    forward = gpt_model.GPTModel.forward

    def counted_forward(self, *args, **kwargs):
        before = Count.ops
        out = forward(self, *args, **kwargs)
        Count.in_model += Count.ops - before
        return out

    gpt_model.GPTModel.forward = counted_forward
    actor = Actor(hf_dir, ActorConfig(tp=1, micro_batch_size=2, lr=1e-4), initialize_model_parallel(tp=1, pp=1))
    out, batches = {}, {}
    for sequences in (4, 4, 8):  # the first a warm-up: a first forward builds what later ones reuse
        ids = torch.randint(0, actor.shape.vocab_size, (sequences, 16), generator=torch.Generator().manual_seed(0))
        batch = TokenBatch(
            input_ids=ids, loss_mask=torch.ones(sequences, 15), advantages=torch.linspace(-1, 1, sequences)
        )
        Count.ops = Count.in_model = 0
        with Count():
            batch.old_logprobs = actor.compute_logprobs(batch)
        logprobs = (Count.ops, Count.in_model)
        Count.ops = Count.in_model = 0
        with Count():
            actor.train_step(batch, PolicyLoss(PolicyLossConfig()))
        batches[sequences] = batch
        counts = [logprobs, (Count.ops, Count.in_model)]
        out[sequences // 2] = counts
    # 2 micro-batches again (the 4th and 5th train steps: a 6th dispatches 63 ops fewer, whatever its chunks), each of
    # 30 response rows in 8- and 4-row log-prob chunks: 4 and 8 chunks where the others had 1
    for chunk in (8, 4):
        actor.config.logprob_chunk_tokens = chunk
        Count.ops = Count.in_model = 0
        with Count():
            actor.compute_logprobs(batches[4])
        logprobs = (Count.ops, Count.in_model)
        Count.ops = Count.in_model = 0
        with Count():
            actor.train_step(batches[4], PolicyLoss(PolicyLossConfig()))
        out[f"chunk{chunk}"] = [logprobs, (Count.ops, Count.in_model)]
    return out


def test_the_counted_loss_ops_are_what_torch_dispatches(tiny_model_dirs):
    """Per micro-batch, the ops outside the model's forward: in a log-prob pass (the log-prob pass over the logits, the
    schedule's forward_step) LOSS_OPS["forward"]; in train, beside the counted backward of the layers and the model,
    that and LOSS_OPS["backward"] (the train loss's own ops and the backward of both). Over several log-prob chunks
    LOSS_CHUNKED_OPS' (fixed, per chunk) instead."""
    from planner.step_time import LOSS_CHUNKED_OPS, LOSS_OPS

    [counts] = run_ranks(_actor_ops_by_micro_batches, 1, tiny_model_dirs["qwen2"])
    (lp2, train2), (lp4, train4) = counts[2], counts[4]
    per_micro_batch = {
        name: ((b[0] - a[0]) / 2, (b[1] - a[1]) / 2) for name, a, b in (("lp", lp2, lp4), ("tr", train2, train4))
    }
    lp_all, lp_model = per_micro_batch["lp"]
    assert lp_all - lp_model == LOSS_OPS["forward"]
    train_all, train_model = per_micro_batch["tr"]
    backward = 4 * LOCAL_LAYER_OPS["backward"] + LOCAL_MODEL_OPS["backward"]
    assert train_all - train_model - LOSS_OPS["forward"] - backward == LOSS_OPS["backward"]

    # several chunks: per micro-batch (fixed, per chunk) beside the same model ops, at 4 and at 8 chunks
    def outside(count):
        return count[0] - count[1]

    for pass_, kinds in ((0, ("forward",)), (1, ("forward", "backward"))):
        one = outside(counts[2][pass_]) / 2 - sum(LOSS_OPS[k] for k in kinds)  # the pass's ops beyond the loss's
        for chunks in (4, 8):
            chunked = outside(counts[f"chunk{32 // chunks}"][pass_]) / 2 - one
            assert chunked == sum(LOSS_CHUNKED_OPS[k][0] + chunks * LOSS_CHUNKED_OPS[k][1] for k in kinds), (
                pass_,
                chunks,
            )


def _weights_multiplied(run) -> dict[tuple[int, int], int]:
    """{(out, in): how many} of the distinct [out, in] weights ``run()`` multiplies rows by: the weight of each
    ``linear``, the matrix operand of each ``mm`` / ``addmm`` (``x @ w.t()``'s [in, out] transposed view), told apart
    by its storage and offset (an expert is a slice of its layer's [E, ...] tensor)."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[tuple[int, int], tuple[int, int]] = {}

    class Weights(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                w = args[-1]
                assert w.stride(0) == 1, f"{func}: a weight operand [in, out] is an [out, in] weight's view"
                seen[(w.untyped_storage().data_ptr(), w.storage_offset())] = (w.shape[1], w.shape[0])
            elif func == torch.ops.aten.linear.default:  # [out, in] as it is
                w = args[1]
                seen[(w.untyped_storage().data_ptr(), w.storage_offset())] = tuple(w.shape)
            return func(*args, **(kwargs or {}))

    with Weights():
        run()
    return Counter(seen.values())


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "float32"), ("qwen3", "bfloat16"), ("qwen3_moe", "float32")])
def test_the_native_engines_gemm_weights_are_counted(tiny_model_dirs, family, dtype):
    """planner.sizes.engine_gemm_weights (the shapes tools/speed_probe.py times the native engine's GEMMs at) against
    the weights a real engine's generate multiplies by (TP 1: fp32 TorchScript decode, 16-bit eager; Qwen3-MoE's
    router and every expert: 8 prompts of 15 tokens route to each)."""
    from configs.rollout import RolloutConfig
    from planner.sizes import engine_gemm_weights
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    engine = NativeEngine(
        RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=8),
        tiny_model_dirs[family],
        device="cpu",
        dtype=dtype,
    )
    prompts = [[1, *range(5 + b, 19 + b)] for b in range(8)]
    seen = _weights_multiplied(lambda: engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, seed=0)))
    assert seen == engine_gemm_weights(engine.shape, 1)
