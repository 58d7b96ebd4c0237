"""The step-time model: seconds per phase of one RL step, from counted work and a device's speeds.

For each phase (the step's table, colocation/phases.py, as the memory plan walks it) the work of the slowest rank is
counted from the model's shape, the layouts and the batch (:class:`PhaseWork`):

- ``flops``: dense math. A forward is 2 x the params a token meets (an MoE token meets its top-k experts) + causal
  attention's 2 x span x heads x d per layer; backward 2 x forward; full recompute one forward more. The engine runs
  every prompt token once (prefill) and every response token once (decode).
- ``memory_bytes``: bytes streamed from device memory that no FLOP count sees: every decode step reads the engine's
  weights and the KV cache its sequences have written, and its sampler passes over the [sequences, V] logits; an actor pass writes its activations and logits (the memory
  plan's per-token counts), backward as much again; the optimizer step reads and writes its states; a wake touches
  what it maps (weights, KV cache).
- ``host_bytes``: what an offload or onload copies over the host link (its state's bytes, the memory plan's sizes).
- ``link_bytes``: per link (``intra_node``, ``inter_node``), what one rank sends in collectives: TP's 4 all-reduces
  per layer in train (2 forward, 2 backward; 2 in a forward) of tokens x h, PP's activation sends, EP's all-to-all of
  the routed copies (dispatch and combine), DP's gradient reduction, the weight sync's engine weights.
- ``ops``: fixed costs by kind, in units of the device's ``op_seconds``: an actor layer's forward and backward (their
  torch ops counted on megatron's local layer: :data:`LOCAL_LAYER_OPS`, :data:`LOCAL_MODEL_OPS`), a micro-batch's
  pass (the schedule and the loss around the model), an engine layer's step, a parameter tensor an optimizer step or
  a sync handles, a phase.

seconds = flops / (peak x compute_efficiency) + memory_bytes / (bandwidth x memory_efficiency)
          + sum ops x op_seconds x its factor + host_bytes / (host link x host_efficiency)
          + sum link_bytes / (link x link_efficiency)

with the pipeline's bubble (pp - 1) / (micro-batches x vpp) stretching the actor's passes and, on CPU, a rank's share
of the cores its math and ops; on CUDA the kernel launches overlap the device's work (:func:`combined_seconds`). The efficiencies and op factors are fitted (planner/calibration/<kind>_time.json,
``make calibrate-time``), on the memory plan's fit set, and checked by ``make validate-time`` on runs that did not
fit them. Each phase names what bounds it (the largest term). Pure standard library, like the memory plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from colocation.phases import ACTOR_STATE, step_phases
from modelspec.family import layer_parts
from planner.calibration import Calibration, load
from planner.inputs import PlanInputs, StepLengths
from planner.plan import Plan, actor_stage_counts, optimizer_bytes_per_param, step_flags
from planner.sizes import (
    FP32_BYTES,
    actor_stage_expert_param_count,
    actor_stage_param_count,
    engine_param_count,
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    megatron_padded_vocab,
    stage_layers,
    vllm_padded_vocab,
)
from planner.speed import SpeedSpec

# torch ops of one decoder layer of megatron's local spec (megatron_backend/model.py, packed sequences), counted with
# torch.utils._python_dispatch.TorchDispatchMode on a real layer (tests/test_step_time.py pins them): forward and
# backward, Qwen2-like and with Qwen3's q/k norms, a micro-batch of unequal sequences (one sequence alone: 2 more)
LOCAL_LAYER_OPS = {"forward": 131, "backward": 121}
# the same count's ops outside the layers (embedding, final norm, output layer): per micro-batch and pass
LOCAL_MODEL_OPS = {"forward": 25, "backward": 34}
QK_NORM_LAYER_OPS = {"forward": 13, "backward": 34}
TERMS = ("compute", "memory", "host", "link", "actor_ops", "engine_ops", "tensor_ops", "micro_batch_ops", "phase_ops")
# a fit's columns (raw_terms) -> the constant that scales each (planner/calibration TIME_CONSTANTS) and its term
COLUMN_CONSTANT = {
    "compute": "compute_efficiency",
    "memory": "memory_efficiency",
    "host": "host_efficiency",
    "link": "link_efficiency",
    "actor_ops": "actor_op_factor",
    "actor_backward_ops": "actor_backward_op_factor",
    "native_ops": "native_layer_step_ops",
    "vllm_ops": "vllm_layer_step_ops",
    "tensor_ops": "param_tensor_ops",
    "micro_batch_ops": "micro_batch_ops",
    "phase_ops": "phase_ops",
}
COLUMN_TERM = {"native_ops": "engine_ops", "vllm_ops": "engine_ops", "actor_backward_ops": "actor_ops"}
EFFICIENCIES = ("compute_efficiency", "memory_efficiency", "host_efficiency", "link_efficiency")


@dataclass
class PhaseWork:
    """One phase's work on its slowest rank (see the module doc)."""

    flops: float = 0.0
    memory_bytes: float = 0.0
    host_bytes: float = 0.0
    link_bytes: dict[str, float] = field(default_factory=dict)
    actor_ops: float = 0.0  # forward
    actor_backward_ops: float = 0.0  # autograd's: each op's node is also the engine's to schedule
    engine_layer_steps: float = 0.0
    param_tensors: float = 0.0
    micro_batch_passes: float = 0.0  # a micro-batch's forward or backward: the schedule's and the loss's fixed cost
    bubble: float = 0.0  # the pipeline's idle fraction of the actor's passes


@dataclass(frozen=True)
class PhaseTime:
    name: str
    seconds: float
    terms: dict[str, float]  # seconds by term (TERMS)
    bound: str  # the largest term

    def __str__(self) -> str:
        return f"{self.name}: {self.seconds * 1e3:.1f} ms ({self.bound})"


@dataclass(frozen=True)
class StepTime:
    phases: tuple[PhaseTime, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def phase(self, name: str) -> PhaseTime:
        return next(p for p in self.phases if p.name == name)

    @property
    def bound(self) -> str:
        """What bounds the step: the largest term summed over phases, with the phase that spends most on it."""
        totals = {t: sum(p.terms[t] for p in self.phases) for t in TERMS}
        term = max(totals, key=totals.get)
        return f"{term} ({max(self.phases, key=lambda p: p.terms[term]).name})"


def time_constants(device_kind: str) -> Calibration:
    return load(f"{device_kind}_time")


# ---------------------------------------------------------------- counts
def _layer_ops(inp: PlanInputs, kind: str) -> int:
    return LOCAL_LAYER_OPS[kind] + (QK_NORM_LAYER_OPS[kind] if inp.shape.qk_norm else 0)


def _param_tensors(inp: PlanInputs, layers) -> int:
    return sum(len(layer_parts(inp.shape, layer)) for layer in layers) + 3  # embedding, final norm, output layer


def _actor_forward_flops(inp: PlanInputs, stage: int, tokens: float, span: float) -> float:
    """A forward of ``tokens`` tokens (each attending to ``span`` on average) on one rank of pipeline stage ``stage``."""
    s, a = inp.shape, inp.actor
    params = actor_stage_param_count(s, a.tp, a.pp, stage, a.ep, a.etp)
    experts = actor_stage_expert_param_count(s, a.tp, a.pp, stage, a.ep, a.etp)
    vocab_rows = megatron_padded_vocab(s.vocab_size, a.tp) // a.tp * s.hidden_size
    if stage == 0:
        params -= vocab_rows  # the embedding is a lookup
    if experts:  # a token meets its top-k experts of E / ep local ones: k x ep / E of the local expert params
        params += experts * (s.moe_top_k * a.ep / s.num_experts - 1)
    layers = len(stage_layers(s, a.pp, stage))
    attention = 2 * tokens * span * s.num_heads * s.head_dim / a.tp * layers  # causal: half of 4 t s H d
    return 2 * params * tokens + attention


def _engine_work(inp: PlanInputs, lengths: StepLengths) -> PhaseWork:
    """Rollout on one engine rank: prefill of its prompts, then decode steps until its longest response ends."""
    s, r = inp.shape, inp.rollout
    world = inp.actor.tp * inp.actor.pp * inp.actor_dp
    replicas = max(1, world // r.tp)
    seqs = math.ceil(inp.sequences_per_step / replicas)
    waves = math.ceil(seqs / r.max_num_seqs)
    steps = waves * max(1, lengths.longest_response)
    prompt, response = lengths.mean_prompt, lengths.mean_response
    params = engine_param_count(s, r.tp, *inp.engine_expert_split)
    active = params
    if s.is_moe:  # a token meets its top-k of the E experts: the rank's expert params x k / (E / ep) it holds
        ep, etp = inp.engine_expert_split
        expert_params = len(s.moe_layers) * s.num_experts // ep * 3 * s.hidden_size * s.moe_intermediate_size // etp
        active = params - expert_params * (1 - s.moe_top_k * ep / s.num_experts)
    e = inp.element_bytes
    tokens = seqs * (prompt + response)
    span = prompt + response / 2
    attention = 2 * tokens * span * s.num_heads * s.head_dim / r.tp * s.num_layers
    kv_read = seqs * response * span * kv_bytes_per_token(s, r.tp, e)
    # the sampler, per decode step over the [seqs, V] fp32 logits (rollout/native/sampling.py; vLLM's sampler alike):
    # logsumexp reads them, the temperature's copy writes, softmax reads and writes, multinomial's draws read and write
    sampler = seqs * response * vllm_padded_vocab(s.vocab_size) * FP32_BYTES * 6
    tp_bytes = tokens * 2 * s.num_layers * s.hidden_size * e * 2 * (r.tp - 1) / r.tp
    return PhaseWork(
        flops=2 * active * tokens + attention,
        memory_bytes=steps * params * e + kv_read + sampler,
        link_bytes={"intra_node": tp_bytes},
        engine_layer_steps=(steps + waves) * s.num_layers,  # decode steps + one prefill per wave
    )


def _actor_pass_work(inp: PlanInputs, stage: int, train: bool) -> PhaseWork:
    """A log-prob pass (``train=False``) or the train step's forwards and backwards, on a rank of ``stage``."""
    s, a = inp.shape, inp.actor
    mb = inp.micro_batches(train=train)
    tokens = mb.count * mb.model_tokens
    layers = len(stage_layers(s, a.pp, stage))
    forward = _actor_forward_flops(inp, stage, tokens, mb.attention_span / 2)
    e = inp.element_bytes
    passes = 1
    ops = mb.count * (layers * _layer_ops(inp, "forward") + LOCAL_MODEL_OPS["forward"])
    backward_ops = 0
    if train:
        passes = 3 + (1 if a.recompute == "full" else 0)
        backward_ops = mb.count * (layers * _layer_ops(inp, "backward") + LOCAL_MODEL_OPS["backward"])
        if a.recompute == "full":
            ops *= 2
    # TP: 2 all-reduces of [tokens, h] per layer and pass direction; PP: the activations sent on; EP: the routed copies
    activation = tokens * s.hidden_size * e
    tp_bytes = activation * 2 * layers * (2 if train else 1) * 2 * (a.tp - 1) / a.tp
    pp_bytes = activation * (2 if train else 1) if a.pp > 1 else 0
    moe_layers = sum(1 for layer in stage_layers(s, a.pp, stage) if s.is_moe_layer(layer))
    ep_bytes = activation * s.moe_top_k * 2 * moe_layers * (2 if train else 1) * (a.ep - 1) / a.ep if a.ep > 1 else 0
    # bytes the pass writes to fresh memory (on CPU each buffer of a page or more is a fresh mapping, faulted in:
    # colocation/host_memory.py): every layer's activations (what megatron keeps for backward, planner.sizes), the
    # logits in the dtype and the log-prob pass's fp32 rows and their exp on the last stage; backward as much again
    kept = sum(
        layer_activation_bytes_per_token(
            s, a.tp, e, inp.attention, sparse=s.is_moe_layer(layer), etp=a.etp, packed=a.remove_padding
        )
        for layer in stage_layers(s, a.pp, stage)
    )
    logits = (e + 8) * megatron_padded_vocab(s.vocab_size, a.tp) // a.tp if stage == a.pp - 1 else 0
    written = tokens * (kept + logits) * (2 if train else 1)
    work = PhaseWork(
        flops=forward * passes,
        memory_bytes=written,
        actor_ops=ops,
        actor_backward_ops=backward_ops,
        micro_batch_passes=mb.count * (2 if train else 1),
        link_bytes=_by_link(inp, {"tp": tp_bytes, "pp": pp_bytes, "ep": ep_bytes}),
        bubble=(a.pp - 1) / (mb.count * (a.vpp or 1)),
    )
    if train:  # the optimizer step: read and write params, grads and states; DP's gradient reduction
        params, expert_params = actor_stage_counts(inp, stage)
        state_bytes = (
            params * (2 * e + optimizer_bytes_per_param(e)) / (inp.actor_dp if inp.distributed_optimizer else 1)
        )
        work.memory_bytes += 2 * state_bytes
        work.param_tensors += _param_tensors(inp, stage_layers(s, a.pp, stage))
        if inp.actor_dp > 1:
            dp = inp.actor_dp
            link = _by_link(inp, {"dp": params * e * 2 * (dp - 1) / dp})
            for name, value in link.items():
                work.link_bytes[name] = work.link_bytes.get(name, 0.0) + value
    return work


def _by_link(inp: PlanInputs, bytes_by_group: dict[str, float]) -> dict[str, float]:
    """Collective bytes by the link they cross: a group within one node uses NVLink (CPU: memory), else the network.
    Megatron orders ranks TP, then EP/DP..., then PP; a group spans nodes when its stride x size exceeds a node."""
    a, node = inp.actor, inp.ranks_per_node
    spans = {"tp": a.tp, "ep": a.tp * a.ep, "dp": a.tp * inp.actor_dp, "pp": a.tp * inp.actor_dp * a.pp}
    out: dict[str, float] = {}
    for group, value in bytes_by_group.items():
        if value:
            link = "intra_node" if spans[group] <= node else "inter_node"
            out[link] = out.get(link, 0.0) + value
    return out


def phase_work(plan: Plan, lengths: StepLengths | None = None) -> dict[str, PhaseWork]:
    """Every phase's work on the slowest rank (the pipeline stage whose sum is largest is taken per phase)."""
    inp = plan.inputs
    lengths = lengths or inp.planned_lengths()
    if lengths != inp.planned_lengths():
        inp = inp.at_lengths(lengths, plan.kv_cache_bytes)
    flags = step_flags(inp)
    engine_sleeps = inp.engine_profile.sleeps
    sizes = {"weights": plan.engine_weight_bytes, "kv_cache": plan.kv_cache_bytes}
    stages = range(inp.actor.pp)
    # the actor's state as the memory plan sizes it (its planned stage)
    state_bytes = {
        comp: max(p.components.get(comp, 0) for p in plan.phases)
        for comp in ("actor_params", "actor_grads", "optimizer", "ref_params")
    }
    engine_tensors = _param_tensors(inp, range(inp.shape.num_layers))
    out: dict[str, PhaseWork] = {}
    for phase in step_phases(flags):
        if not phase.every_step:
            continue
        work = PhaseWork()
        if phase.name == "rollout":
            work = _engine_work(inp, lengths)
        elif phase.name in ("old_logprob", "ref_logprob") and (phase.name == "old_logprob" or inp.reference_model):
            work = max((_actor_pass_work(inp, st, train=False) for st in stages), key=_size)
        elif phase.name == "train":
            work = max((_actor_pass_work(inp, st, train=True) for st in stages), key=_size)
        elif phase.name == "weight_sync":
            work.link_bytes = {"intra_node": plan.engine_weight_bytes}
            work.param_tensors = engine_tensors
        for state in (*phase.adds, *phase.drops):
            if state in (*ACTOR_STATE, "ref_params"):  # an offload or onload copies it over the host link
                work.host_bytes += state_bytes[state]
            elif state in sizes and state in phase.adds and engine_sleeps:  # a wake maps and touches it
                work.memory_bytes += sizes[state]
        out[phase.name] = work
    return out


def _size(work: PhaseWork) -> float:
    return work.flops + work.actor_ops * 1e6 + work.param_tensors


def raw_terms(work: PhaseWork, inp: PlanInputs, speed: SpeedSpec) -> dict[str, float]:
    """Each term's seconds at efficiency 1 and op factor 1 (a fit's columns; the engine's ops under its own name)."""
    over = speed.oversubscription(inp.ranks_per_node)
    stretch = over * (1 + work.bubble)
    compute_stretch = speed.compute_stretch(inp.ranks_per_node) * (1 + work.bubble)
    return {
        "compute": work.flops / speed.flops(inp.dtype) * compute_stretch,
        "memory": work.memory_bytes / speed.memory_bytes_per_s * over,
        "host": work.host_bytes / speed.host_bytes_per_s,
        "link": sum(b / getattr(speed, f"{link}_bytes_per_s") for link, b in work.link_bytes.items()),
        "actor_ops": work.actor_ops * speed.op_seconds * stretch,
        "actor_backward_ops": work.actor_backward_ops * speed.op_seconds * stretch,
        f"{inp.rollout.engine}_ops": work.engine_layer_steps * speed.op_seconds * over,
        "tensor_ops": work.param_tensors * speed.op_seconds * over,
        "micro_batch_ops": work.micro_batch_passes * speed.op_seconds * stretch,
        # a phase that moves nothing and runs nothing (an onload of what stays resident) costs nothing
        "phase_ops": speed.op_seconds * over if _does_work(work) else 0.0,
    }


def _does_work(work: PhaseWork) -> bool:
    return bool(work.flops or work.memory_bytes or work.host_bytes or work.engine_layer_steps or work.param_tensors)


def coefficient(constants: Calibration, column: str) -> float:
    """What multiplies a raw term: 1 / efficiency, or the op factor."""
    name = COLUMN_CONSTANT[column]
    return 1.0 / constants.value(name) if name in EFFICIENCIES else constants.value(name)


def scaled_terms(raw: dict[str, float], constants: Calibration) -> dict[str, float]:
    """Each term's seconds: the raw terms times their constants' coefficients, the engines' ops as ``engine_ops``."""
    terms = dict.fromkeys(TERMS, 0.0)
    for column, seconds in raw.items():
        terms[COLUMN_TERM.get(column, column)] += seconds * coefficient(constants, column)
    return terms


def combined_seconds(terms: dict[str, float], device_kind: str) -> float:
    """A phase's seconds from its terms. On CPU one core launches an op and runs it: everything adds up. On CUDA the
    host launches kernels while the device runs earlier ones: the device's work (compute, memory) and the launches
    overlap, the slower of the two counts; host copies, collectives and the phase's own cost add."""
    if device_kind == "cpu":
        return sum(terms.values())
    device = terms["compute"] + terms["memory"]
    launches = terms["actor_ops"] + terms["engine_ops"] + terms["tensor_ops"] + terms["micro_batch_ops"]
    return max(device, launches) + terms["host"] + terms["link"] + terms["phase_ops"]


def phase_seconds(name: str, work: PhaseWork, inp: PlanInputs, speed: SpeedSpec, constants: Calibration) -> PhaseTime:
    terms = scaled_terms(raw_terms(work, inp, speed), constants)
    return PhaseTime(name, combined_seconds(terms, speed.kind), terms, max(terms, key=terms.get))


def predict_step_time(
    plan: Plan, speed: SpeedSpec, constants: Calibration | None = None, lengths: StepLengths | None = None
) -> StepTime:
    """Seconds per phase of one step of ``plan``'s run on a device of ``speed`` (``lengths``: a step's recorded
    lengths; None: the plan's own), the every-step phases only (save_checkpoint, eval and export_hf run on some)."""
    if speed.kind != plan.inputs.device.kind:
        raise ValueError(f"speed {speed.name!r} is a {speed.kind} device; the plan is for {plan.inputs.device.kind}")
    constants = constants or time_constants(speed.kind)
    works = phase_work(plan, lengths)
    return StepTime(tuple(phase_seconds(n, w, plan.inputs, speed, constants) for n, w in works.items()))
