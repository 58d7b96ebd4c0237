"""The analytical memory plan: bytes per device in every phase of one RL step, itemized.

What each phase holds follows the step's table, ``colocation/phases.py`` (the one ``run/loop.py::rl_step``
runs): the state each phase adds and drops, and its transients, whose bytes ``_phases`` sizes here. The
step starts in ``rollout`` with the engine awake (weights + KV cache) and the actor holding what its offload
flags keep (params unless ``offload_params``, and so on). A phase holds the union of what is resident when
it starts and when it ends (offloads peak at their start, onloads and wakes at their end), plus its
transients. ``save_checkpoint``, which runs on save steps only, is not planned; ``eval``, at the step
boundaries that evaluate, is when the run evaluates (``eval_sequences``): its transient is the engine's
rollout working set for the eval batch; ``export_hf`` is when the run exports (``hf_exports``): its
transient is what the export holds beside the resident state (:func:`export_staging_bytes`).

Always resident: communicator buffers and the engine's persistent reserve (vLLM's CUDA graphs); the
reference actor's params too unless ``offload_ref_params``. The plan is for the worst rank: every pipeline stage is planned (the
first holds the embedding and the most in-flight micro-batches, the last the output layer and the
logits) and the stage with the highest peak is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import configs
from colocation.engines import ENGINE_PROFILES, EngineProfile, KvSizing
from colocation.phases import EVAL_PHASE, EXPORT_PHASE, StepFlags, phase_names, step_phases, wake_window_phases
from configs.rollout import AUTO, MIN_KV_CACHE_BYTES
from planner.inputs import PlanInputs, ReferenceSample, StepLengths
from planner.sizes import (
    FP32_BYTES,
    VERIFY_BYTES_PER_ELEMENT,
    actor_stage_expert_param_count,
    actor_stage_fc1_elements,
    actor_stage_param_count,
    engine_activation_bytes,
    engine_moe_bytes_per_token,
    engine_param_count,
    in_flight_layers,
    kv_bytes_per_token,
    largest_actor_weight_elements,
    largest_engine_tensor_elements,
    largest_hf_tensor_elements,
    layer_activation_bytes_per_token,
    layer_forward_bytes_per_token,
    local_layer_forward_bytes,
    local_packed_attention_padding_bytes_per_token,
    local_packed_layer_forward_bytes,
    logits_bytes,
    moe_layer_kinds,
    native_engine_activation_bytes,
    optimizer_bytes_per_param,
    routing_device_bytes,
    stage_ends_activation_bytes_per_token,
    unfused_attention_bytes,
)

# The step's phases in order (colocation/phases.py: the one table the loop, the planner and the timeline read);
# a plan of a run that evaluates has the eval phase first, of one that exports export_hf after train (Plan.names)
PHASES = phase_names(saves=False)
COMPONENTS = (
    "actor_params",
    "actor_grads",
    "optimizer",
    "activations",
    "logits",
    "ref_params",
    "engine_weights",
    "kv_cache",
    "engine_reserve",
    "comm_buffers",
    "sync_bucket",
    "reference_check",
    "export_staging",
)
# state that comes and goes between phases (colocation.phases.STATE, memory tags) -> its component
_COMPONENT = {
    "actor_params": "actor_params",
    "actor_grads": "actor_grads",
    "optimizer": "optimizer",
    "ref_params": "ref_params",
    "weights": "engine_weights",
    "kv_cache": "kv_cache",
}


@dataclass(frozen=True)
class PhasePlan:
    name: str
    components: dict[str, int]
    # what is resident when the phase starts (before its changes and transients): the phase's measured rise
    # above its starting level is predicted_bytes - start_bytes (tools/validate_plan.py checks it)
    start_components: dict[str, int] = field(default_factory=dict)

    @property
    def start_bytes(self) -> int:
        return sum(self.start_components.values())

    @property
    def predicted_bytes(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class _Stage:
    """What one pipeline stage's rank holds, everything but the KV cache fixed."""

    stage: int
    actor_params: int
    actor_grads: int
    optimizer: int
    ref_params: int
    train_activations: int
    forward_activations: int
    train_logits: int  # last stage only: the log-prob pass's peak over the largest train micro-batch
    forward_logits: int  # last stage only: the same, forward-only (old/ref_logprob micro-batches)


def _layer_bytes(inp: PlanInputs, mb, recomputed: tuple[str, ...] = (), train: bool = True) -> int:
    """What one layer keeps for backward for micro-batch ``mb`` (``recomputed``: selective modules); with
    ``train=False``, one layer's working set in a forward without grad (counted, not scaled: nothing is kept)."""
    s, e, tp, etp = inp.shape, inp.element_bytes, inp.actor.tp, inp.expert_tp
    # an MoE model's layers: the larger of a dense and a sparse layer's when they mix (mlp_only_layers)
    packed = inp.attention == "unfused" and inp.actor.remove_padding
    if not train and packed:
        # without grad nothing is kept: the layer's widest moment over the micro-batch's sequences, padded to its
        # longest for torch's flash kernel (megatron_backend/model.py, VarlenDotProductAttention)
        return max(
            local_packed_layer_forward_bytes(
                s, tp, e, mb.model_tokens, mb.padded_tokens, mb.sequences, sparse, etp, inp.routed_copies_ratio
            )
            for sparse in moe_layer_kinds(s)
        )
    if not train and inp.attention == "unfused":  # padded rows: megatron's attention over all of them at once
        scores = unfused_attention_bytes(s, tp, e, mb.sequences, mb.attention_span)
        return max(
            local_layer_forward_bytes(
                s, tp, e, mb.model_tokens, mb.model_tokens, scores, sparse, etp, inp.routed_copies_ratio
            )
            for sparse in moe_layer_kinds(s)
        )
    if train:
        per_token = max(
            layer_activation_bytes_per_token(
                s, tp, e, inp.attention, recomputed, sparse, etp, inp.sequence_parallel_on, inp.routed_copies_ratio,
                packed,
            )
            for sparse in moe_layer_kinds(s)
        )  # fmt: skip
    else:
        per_token = max(
            layer_forward_bytes_per_token(s, tp, e, sparse, etp, inp.routed_copies_ratio)
            for sparse in moe_layer_kinds(s)
        )
    per_layer = mb.model_tokens * per_token
    if packed and train:  # what the attention keeps per padded row: the sequences x the longest
        per_layer += mb.padded_tokens * local_packed_attention_padding_bytes_per_token(s, tp)
    scores = 0
    if inp.attention == "unfused" and not packed and "core_attn" not in recomputed:
        scores = unfused_attention_bytes(s, tp, e, mb.sequences, mb.attention_span, kept=True)
    # megatron's local spec (CPU) runs RMSNorm, RoPE, SwiGLU and attention unfused: autograd keeps more per
    # token than the fused count above; the factor is fitted by `make calibrate` (planner/calibration/cpu.json)
    # on train rises of short sequences, so it covers the per-token tensors only: the [b, Hq/t, s, s] scores are
    # counted as they are (with the factor on them, 166-token rows were over-predicted by 20%)
    return round(per_layer * (inp.activation_factor if train else 1.0)) + scores


def train_activation_bytes(inp: PlanInputs, layers: int, layers_per_chunk: int, micro_batches_in_flight: int) -> int:
    """Activations one stage keeps for ``layers`` in-flight layers of the largest train micro-batch.

    none: every layer's kept tensors. selective: without the recomputed modules', plus one layer's
    recomputed part in backward. full/uniform: units of n layers keep only their input, one unit's
    layers recompute at a time. full/block: the first n of each chunk's layers keep only their input.
    Plus the stage input of each micro-batch in flight.
    """
    mb = inp.micro_batches(train=True)
    full = _layer_bytes(inp, mb)
    stage_input = mb.model_tokens * inp.shape.hidden_size * inp.element_bytes // inp.sequence_parallel_split
    if inp.actor.recompute == "selective":
        kept = _layer_bytes(inp, mb, tuple(inp.recompute_modules))
        activations = layers * kept + (full - kept)
    elif inp.actor.recompute == "full" and inp.actor.recompute_method == "uniform":
        unit = min(inp.actor.recompute_num_layers or 1, layers_per_chunk)
        activations = math.ceil(layers / unit) * stage_input + unit * full
    elif inp.actor.recompute == "full":  # block
        recomputed = min(inp.actor.recompute_num_layers or layers_per_chunk, layers_per_chunk)
        fraction = recomputed / layers_per_chunk
        activations = round(layers * (fraction * stage_input + (1 - fraction) * full)) + full
    else:
        activations = layers * full
    return activations + micro_batches_in_flight * stage_input


def train_backward_bytes(inp: PlanInputs, stage: int, logits_pass: int = 0) -> int:
    """What train holds beside the kept activations and the log-prob pass, on a rank of ``stage`` holding
    the largest train micro-batch: the largest weight's gradient before DDP's
    hook adds it into main_grad (sizes.largest_actor_weight_elements) and a fixed workspace
    (``train_workspace_bytes``). The weight gradients come after the log-prob pass's backward (``logits_pass``,
    last stage), whose buffers are freed by then: the stage holds the larger of the two."""
    s, e = inp.shape, inp.element_bytes
    weight_grad = max(0, largest_actor_weight_elements(s, inp.actor.tp, inp.actor.pp, stage) * e - logits_pass)
    return weight_grad + int(inp.constants.value("train_workspace_bytes"))


def logprob_pass_bytes(inp: PlanInputs, train: bool) -> int:
    """The last stage's log-prob/entropy pass over the largest micro-batch (sizes.logits_bytes)."""
    mb = inp.micro_batches(train=train)
    chunked = inp.actor.logprob_chunk_tokens is not None
    return logits_bytes(
        inp.shape,
        inp.actor.tp,
        inp.element_bytes,
        mb.model_tokens,
        num_rows=mb.response_tokens,
        chunk_tokens=inp.actor.logprob_chunk_tokens,
        train=train,
        keep_softmax=not chunked or (inp.entropy_grad and not inp.actor.entropy_recompute),
        entropy_grad=train and inp.entropy_grad,
        output_copy=not inp.actor.remove_padding and mb.sequences > 1,
    )


def _stage(inp: PlanInputs, stage: int) -> _Stage:
    s, e, pp = inp.shape, inp.element_bytes, inp.actor.pp
    count, expert_count = actor_stage_counts(inp, stage)
    params = count * e
    layers = in_flight_layers(s.num_layers, pp, inp.actor.vpp, stage, inp.num_micro_batches)
    layers_per_chunk = s.num_layers // (pp * (inp.actor.vpp or 1))
    micro_batches_in_flight = max(1, layers // (s.num_layers // pp))
    forward_mb = inp.micro_batches(train=False)
    forward_input = forward_mb.model_tokens * s.hidden_size * e // inp.sequence_parallel_split
    last = stage == pp - 1
    # a forward without grad holds the residual stream and one layer's working set, then (last stage) the
    # log-prob pass beside the final hidden state: one after the other, so the activations count what the
    # layers hold beyond the log-prob pass
    forward_logits = logprob_pass_bytes(inp, train=False) if last else 0
    forward_layer = _layer_bytes(inp, forward_mb, train=False)
    train_logits = logprob_pass_bytes(inp, train=True) if last else 0
    # megatron's DistributedOptimizer (DP > 1 or an optimizer offload, any device): a DP rank holds 1/DP of Adam's
    # m, v and of the fp32 main params of 16-bit params (fp32 params are their own, viewed; optimizer_device_bytes);
    # its DDP buffers also pad each param to
    # 64 elements and a bucket to lcm(DP, 128) (distributed/param_and_grad_buffer.py): < 64 x (e + 4) bytes a
    # tensor, not counted. An MoE model's routed experts (E / ep per rank) shard over the expert-DP group instead
    optimizer = optimizer_device_bytes(inp, count, expert_count)
    train_activations = train_activation_bytes(inp, layers, layers_per_chunk, micro_batches_in_flight)
    # the embedding's ids (each micro-batch in flight on the first stage) and the final norm (the last stage's one)
    local, split = inp.attention == "unfused", inp.sequence_parallel_split
    ids = stage_ends_activation_bytes_per_token(s, inp.actor.tp, e, local, first=stage == 0, last=False, split=1)
    norm = stage_ends_activation_bytes_per_token(s, inp.actor.tp, e, local, first=False, last=last, split=split)
    train_activations += inp.micro_batches(train=True).model_tokens * (micro_batches_in_flight * ids + norm)
    train_activations += train_backward_bytes(inp, stage, train_logits)
    # the DistributedOptimizer's grad sync (DDP finish_grad_sync, after the last backward: activations and
    # logits freed) is a reduce_scatter_tensor of the fp32 grad buffer; gloo runs it as an all-reduce of a
    # copy of the whole input (measured: +100 MB RSS for a 100 MB buffer; all_gather_into_tensor: none).
    # NCCL reduces in place. The fixed train workspace is held beside either.
    if inp.distributed_optimizer and not inp.on_cuda:
        workspace = int(inp.constants.value("train_workspace_bytes"))
        train_activations = workspace + max(train_activations - workspace, count * FP32_BYTES - train_logits)
    # MoE: the routing of the micro-batch in flight, per router of the stage (old/ref_logprob share the count:
    # old_logprob compares with or replays it, ref_logprob replays it only with routing replay)
    forward_routing = 0
    if inp.routed_experts:
        forward_routing = routing_device_bytes(s, pp, stage, forward_mb.model_tokens // split)
    if inp.routing_replay:
        train_activations += routing_device_bytes(s, pp, stage, inp.micro_batches(train=True).model_tokens // split)
    return _Stage(
        stage=stage,
        actor_params=params,
        actor_grads=count * FP32_BYTES,  # megatron DDP main_grad buffers, fp32 (grad_reduce_in_fp32)
        optimizer=optimizer,
        ref_params=params if inp.reference_model else 0,
        train_activations=train_activations,
        forward_activations=forward_input + forward_routing + max(0, forward_layer - forward_logits),
        train_logits=train_logits,
        forward_logits=forward_logits,
    )


def actor_stage_counts(inp: PlanInputs, stage: int) -> tuple[int, int]:
    """(params, routed-expert params among them) one actor rank of ``stage`` holds (planner/sizes.py)."""
    s, tp, pp, ep, etp = inp.shape, inp.actor.tp, inp.actor.pp, inp.actor.ep, inp.expert_tp
    return (
        actor_stage_param_count(s, tp, pp, stage, ep, etp),
        actor_stage_expert_param_count(s, tp, pp, stage, ep, etp),
    )


def optimizer_shards(inp: PlanInputs, count: int, expert_count: int) -> list[tuple[int, int]]:
    """(params, the group the distributed optimizer shards them over): the dense params over DP, the routed experts
    over the expert-DP group (megatron/core/optimizer/__init__.py: a second optimizer over the expert params with
    ``intra_expt_dp_group``); unsharded without the distributed optimizer."""
    if not inp.distributed_optimizer:
        return [(count, 1)]
    return [(count - expert_count, inp.actor_dp), (expert_count, inp.expert_dp)]


def optimizer_device_bytes(inp: PlanInputs, count: int, expert_count: int = 0) -> int:
    """The optimizer's bytes on one rank's device for ``count`` params (``expert_count`` of them routed experts):
    Adam's moments and (16-bit models) fp32 main params, sharded by the distributed optimizer (:func:`optimizer_shards`);
    with ``optimizer_offload_fraction`` f the moments
    of a fraction f of them are on the host (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py: the
    offloaded params' fp32 main copies stay on the device, their moments go to the host's CPUAdam)."""
    moments = 2 * FP32_BYTES
    main = optimizer_bytes_per_param(inp.element_bytes) - moments
    per_param = main + moments * (1 - inp.actor.optimizer_offload_fraction)
    return sum(round(n * per_param) // shard for n, shard in optimizer_shards(inp, count, expert_count))


def optimizer_host_bytes(inp: PlanInputs, count: int, expert_count: int = 0) -> int:
    """What the hybrid optimizer holds on the host for ``count`` params (hybrid_optimizer.py): a fraction f of
    the shard as a pinned fp32 param copy, a pinned fp32 gradient and CPUAdam's two fp32 moments."""
    per_param = inp.actor.optimizer_offload_fraction * 4 * FP32_BYTES
    return sum(round(n * per_param) // shard for n, shard in optimizer_shards(inp, count, expert_count))


def step_flags(inp: PlanInputs) -> StepFlags:
    """The flags that decide which state each phase of the step moves (colocation.phases; PlanInputs has each)."""
    return configs.step_flags(inp.actor, inp.rollout, reference_model=inp.reference_model)


def _phases(inp: PlanInputs, st: _Stage, kv_cache_bytes: int) -> tuple[PhasePlan, ...]:
    """Every phase's components for one stage, walking the step's table (colocation.phases.step_phases):
    its state changes, and the bytes of each phase's transients."""
    weights = engine_param_count(inp.shape, inp.rollout.tp, *inp.engine_expert_split) * inp.element_bytes
    sizes = {
        "actor_params": st.actor_params,
        "actor_grads": st.actor_grads,
        "optimizer": st.optimizer,
        "engine_weights": weights,
        "kv_cache": kv_cache_bytes,
        "ref_params": st.ref_params,
    }
    persistent_reserve = inp.engine_persistent_bytes
    # an engine that repacks its weights (vLLM's CPU build, layerwise reload) materializes the layers'
    # unprocessed weights beside the repacked ones until it repacks them again (measured: the engine's weights)
    reload = weights if inp.engine_profile.repacks_weights(inp.device.kind) else 0
    rollout_activations = engine_rollout_activation_bytes(inp)
    eval_activations = engine_rollout_activation_bytes(inp, inp.eval_sequences) if inp.eval_sequences else 0
    rollout_reserve = persistent_reserve + rollout_activations
    retained = 0 if inp.on_cuda else min(rollout_activations, int(inp.constants.value("heap_retention_bytes")))
    sleep_reserve = persistent_reserve + retained if retained else 0
    bucket = sync_staging_bytes(inp, st, weights)
    # each kind of transient (colocation.phases.TRANSIENTS) -> the components it raises, and to what
    transient_bytes = {
        "engine_activations": {"engine_reserve": rollout_reserve},
        "eval_activations": {"engine_reserve": persistent_reserve + eval_activations},
        # on CPU the rollout's small freed allocations stay in the heap (RSS) until the sleep trims it (malloc_trim)
        "rollout_heap": {"engine_reserve": sleep_reserve} if sleep_reserve else {},
        "forward_pass": {"activations": st.forward_activations, "logits": st.forward_logits},
        "train_pass": {"activations": st.train_activations, "logits": st.train_logits},
        "sync_bucket": {
            "sync_bucket": bucket,
            # execute_sync frees its buckets, then verify, the reference check and the engine's reload
            # (finish_weight_update) run one after another (weight_sync/sync.py, run/shared_device.py): the check
            # holds what it needs beyond the others' freed memory
            "reference_check": max(0, reference_check_bytes(inp, st.stage)[0] - bucket - reload),
            "engine_reserve": persistent_reserve + reload,
        },
        "hf_export": {"export_staging": export_staging_bytes(inp, st)},
    }
    flags = step_flags(inp)
    resident = set(flags.resident_at_step_start())
    start = set(resident)
    # an engine that cannot sleep keeps its weights and KV cache through engine_sleep (its profile says)
    engine_state = set() if inp.engine_profile.sleeps else {"weights", "kv_cache"}
    planned = {EVAL_PHASE: bool(inp.eval_sequences), EXPORT_PHASE: inp.hf_exports}  # save_checkpoint: never
    out = []
    for phase in step_phases(flags):
        if not phase.every_step and not planned.get(phase.name, False):
            continue
        after = (resident | set(phase.adds)) - (set(phase.drops) - engine_state)
        components = dict.fromkeys(COMPONENTS, 0)
        for state in resident | after:  # offloads peak at their start, onloads and wakes at their end
            components[_COMPONENT[state]] = sizes[_COMPONENT[state]]
        components["comm_buffers"] = inp.comm_bytes
        components["engine_reserve"] = persistent_reserve
        start_components = {k: v for k, v in components.items() if k not in _COMPONENT.values()}
        start_components.update({c: sizes[c] if s in resident else 0 for s, c in _COMPONENT.items()})
        if "rollout_heap" in phase.transients and sleep_reserve:
            start_components["engine_reserve"] = sleep_reserve  # it starts where rollout left the heap
        for transient in phase.transients:
            components.update(transient_bytes[transient])
        out.append(PhasePlan(phase.name, components, start_components))
        resident = after
    assert resident == start, "the step must end where it started"
    assert tuple(p.name for p in out) == phase_names(
        saves=False, evaluates=bool(inp.eval_sequences), exports=inp.hf_exports
    )
    return tuple(out)


def export_staging_bytes(inp: PlanInputs, st: _Stage) -> int:
    """What ``export_hf`` (megatron_backend/hf_export.py::save_live) holds on a rank of stage ``st`` beside the
    resident state, in its two steps, one after the other (the larger counts):

    1. the params-only torch_dist save (``dist_checkpointing.save``): megatron's writer
       (filesystem_async.py, ``prepare_write_data``) clones every tensor it writes that is a view of a larger
       storage, all of them at once before writing: with the distributed optimizer every param (views of DDP's
       param buffer), else the gated MLP's fc1 halves. On CUDA it copies to the host (not device memory);
    2. the HF files, tensor by tensor (``write_files``): one HF tensor in the export's dtype (the run's) and the
       stored chunks DCP reads into it (FileSystemReader.read_data: each ``torch.load`` ed chunk stays
       referenced until the next one is loaded, so two; a chunk is one saving rank's shard of one parameter,
       at most the largest weight at the actor's TP, fc1 counted whole). Host memory: on CUDA, nothing on
       the device.
    """
    if inp.on_cuda:
        return 0
    e = inp.element_bytes
    if inp.distributed_optimizer:
        staged = st.actor_params
    else:
        staged = actor_stage_fc1_elements(inp.shape, inp.actor.tp, inp.actor.pp) * e
    return max(staged, hf_file_writing_bytes(inp))


def hf_file_writing_bytes(inp: PlanInputs) -> int:
    """What an HF export's file writing holds (step 2 of :func:`export_staging_bytes`; host memory on CUDA too):
    the largest HF tensor in the export's dtype plus the two stored chunks DCP's reader keeps."""
    chunk = largest_actor_weight_elements(inp.shape, inp.actor.tp, 1, 0)  # pp=1: every weight, the vocab tables
    return (largest_hf_tensor_elements(inp.shape) + 2 * chunk) * inp.element_bytes


def sync_staging_bytes(inp: PlanInputs, st: _Stage, engine_weight_bytes: int) -> int:
    """What the weight sync holds beyond the actor's and the engine's tensors on a rank of stage ``st``.

    weight_sync/execute.py runs the sync plan one bucket at a time and frees a bucket's buffers before the
    next: per bucket a rank allocates one flat send buffer per peer for the transfers it packs and one flat
    receive buffer per peer for those it unpacks (``[sum of the packed slices' numel]`` each, the actor's
    dtype). Packed are the column (dim 1) slices, e.g. o_proj / down_proj ``[h, I/t]`` cut from a row-parallel
    shard, and row slices under 1 MiB (``weight_sync.transfers.is_direct``); row slices of >= 1 MiB (gate / up
    ``[I/t, h]``, vocab rows) go from the shard straight into the engine parameter, and local copies (the
    slices a rank's own actor shard holds) need no buffer. The peak is the largest bucket's staged bytes,
    ``inp.sync_staged_bytes[stage]`` (run/memory_plan.py plans the sync from both sides' layouts and takes
    ``SyncPlan.max_staged_bytes`` over the stage's ranks; memory_cpu at actor TP=2 -> engine TP=1: 27.9 MiB
    of a 64 MiB bucket). Without it, the bound: what the rank sends (its actor shard) plus what it receives
    (its engine shard), at most a bucket; 0 when PP = 1 and actor TP = engine TP (every copy local).

    ``weight_sync.verify`` runs after the executor has freed its buffers: it checksums one slice at a time,
    its int64 bits, position weights and their product alive together (weight_sync/verify.py::checksum,
    3 x 8 bytes per element of the largest slice, at most an engine tensor), so the phase holds the larger
    of the two, not their sum.
    """
    if inp.sync_staged_bytes is not None:
        staged = inp.sync_staged_bytes[st.stage]
    elif inp.actor.pp == 1 and inp.actor.tp == inp.rollout.tp:
        staged = 0
    else:
        staged = min(inp.sync_bucket_bytes, st.actor_params + engine_weight_bytes)
    if not inp.verify_sync:
        return staged
    return max(
        staged,
        VERIFY_BYTES_PER_ELEMENT * largest_engine_tensor_elements(inp.shape, inp.rollout.tp, *inp.engine_expert_split),
    )


def reference_sample(inp: PlanInputs) -> ReferenceSample | None:
    """The reference check the plan counts: a step's recorded one (``inp.reference_layer``), else the largest
    (:func:`reference_check_bytes` of every layer's; the first check, a layer with the vocab tensors, in a model
    whose layers are alike). None: no check (``weight_sync.check_every=0``, or none in the recorded step)."""
    samples = inp.reference_check or ()
    if not samples or (inp.reference_layer is not None and inp.reference_layer < 0):
        return None
    if inp.reference_layer is not None:
        return samples[inp.reference_layer % len(samples)]
    return max(samples, key=lambda s: sum(_reference_bytes(inp, s, stage) for stage in range(len(s.own))))


def reference_check_bytes(inp: PlanInputs, stage: int) -> tuple[int, int]:
    """(device, host) bytes the weight sync's reference check holds at its peak on a rank of ``stage``
    (weight_sync/reference.py; the sample: :func:`reference_sample`). 0 with ``weight_sync.check_every=0``. On CPU
    the host's RSS is the device's (the first); on CUDA it is all the host's (the second)."""
    sample = reference_sample(inp)
    if sample is None:
        return 0, 0
    # on CUDA the check gathers over its own gloo group (weight_sync/reference.py::host_group): all host memory
    return (0, _reference_bytes(inp, sample, stage)) if inp.on_cuda else (_reference_bytes(inp, sample, stage), 0)


def _reference_bytes(inp: PlanInputs, sample: ReferenceSample, stage: int) -> int:
    """The reference check's peak on CPU (gloo), where every byte is the host's, per rank of ``stage``, from the
    code: megatron_backend/checkpoint.py::gather_hf_tensors clones the rank's blocks of the sample (``own``) and
    all-gathers them with torch.distributed's all_gather_object (torch 2.13, distributed_c10d.py), which pickles
    them into a byte tensor resized to the largest rank's (1 x largest), gathers every rank's into one
    [W x largest] tensor through gloo's flat output of the same size (freed when the all_gather returns), and
    unpickles rank by rank: the rank's bytes read out (``tobytes``, largest) and its pickled storages held while
    they load (the unpickler's memo, largest) beside the blocks already unpickled (``gathered`` in all). Then the
    full HF tensors (``full``) are filled from the unpickled blocks, the serialized ones freed: the largest of the
    three moments. memory_cpu at DP=2 (rank 0 sends all 14.5 MiB of a layer): 7 x 14.5 = 101.5 MiB counted, the
    weight_sync rise measured 101.4 MiB (make validate-plan, memory_cpu_resident_all_at_once)."""
    e, largest, w = inp.element_bytes, sample.largest * inp.element_bytes, sample.ranks
    own, gathered = sample.own[stage] * e, sample.gathered * e
    all_gather = own + (1 + 2 * w) * largest
    unpickling = own + (1 + w) * largest + 2 * largest + gathered
    return max(all_gather, unpickling, own + gathered + sample.full * e)


def engine_rollout_activation_bytes(inp: PlanInputs, sequences: int | None = None) -> int:
    """What the engine takes beyond weights, KV cache and CUDA graphs while it generates ``sequences`` over
    all replicas (None: the step's rollout, ``sequences_per_step``). vLLM on CUDA: its
    profiled peak (max_num_batched_tokens, max_num_seqs). native, and vLLM on CPU: the same working set for
    the batch it really runs
    (its replica's sequences, all prompts prefilled at once unless max_num_batched_tokens caps them); its
    activation reserve is headroom kept out of the KV cache, not memory it allocates. The native engine's working set
    is its own forward's, counted (sizes.native_engine_activation_bytes: prefill, the longest decode, the sampler)."""
    if not inp.engine_profile.profiles_activations(inp.device.kind):  # eager: the batch it really runs
        replicas = inp.actor.tp * inp.actor.pp * inp.actor_dp // inp.rollout.tp
        total = inp.sequences_per_step if sequences is None else sequences
        seqs = min(inp.rollout.max_num_seqs, math.ceil(total / replicas))
        prefill = seqs * inp.prompt_tokens
        if inp.rollout.max_num_batched_tokens:
            prefill = min(prefill, max(inp.rollout.max_num_batched_tokens, inp.prompt_tokens))
        # the RSS holds more than the live tensors counted: the heap keeps freed blocks of other sizes, and a fixed
        # workspace sits beside them (both calibrated: engine_activation_factor, engine_workspace_bytes; 1 and 0
        # where never fitted)
        sampler_tensors = inp.engine_profile.sampler_tensors(inp.device.kind)
        if inp.rollout.engine == "native":  # its own forward, counted from its source
            moe = _engine_moe(inp, inp.rollout.engine)
            working = native_engine_activation_bytes(
                inp.shape,
                inp.rollout.tp,
                inp.element_bytes,
                prefill_seqs=min(seqs, max(1, prefill // inp.prompt_tokens)),
                prompt_tokens=inp.prompt_tokens,
                decode_seqs=seqs,
                response_tokens=inp.response_tokens,
                max_tokens=inp.rollout.max_new_tokens,
                block_size=inp.kv_block_size,
                sampler_vocab_tensors=sampler_tensors,
                moe_bytes_per_token=engine_moe_bytes_per_token(
                    inp.shape, moe["expert_tp"] or inp.rollout.tp, inp.element_bytes, moe["moe_workspace"]
                )
                if inp.shape.is_moe
                else 0,
            )
        else:
            working = engine_activation_bytes(
                inp.shape,
                inp.rollout.tp,
                inp.element_bytes,
                prefill,
                seqs,
                sampler_tensors,
                **_engine_moe(inp, inp.rollout.engine),
            )
        constants = inp.constants
        return round(working * constants.value("engine_activation_factor")) + int(
            constants.value("engine_workspace_bytes")
        )
    return engine_activation_bytes(
        inp.shape,
        inp.rollout.tp,
        inp.element_bytes,
        inp.vllm_batched_tokens,
        inp.rollout.max_num_seqs,
        inp.engine_profile.sampler_tensors(inp.device.kind),
        **_engine_moe(inp, inp.rollout.engine),
    )


def _engine_moe(inp: PlanInputs, engine: str) -> dict:
    """sizes.engine_activation_bytes' MoE arguments for ``engine`` on this plan's layout: its MoE path, the expert
    TP of its experts' rows, and the replicas whose tokens its MoE layers gather."""
    return dict(
        moe_workspace=engine_moe_workspace(engine),
        expert_tp=inp.engine_expert_split[1],
        gathered_replicas=inp.engine_moe_gathered_replicas,
    )


def engine_moe_workspace(engine: str) -> str:
    """The MoE path an engine runs (sizes.engine_moe_bytes_per_token): the native engine's own, vLLM's fused_moe."""
    return "native" if engine == "native" else "fused_moe"


@dataclass(frozen=True)
class Overflow:
    phase: str
    predicted_bytes: int
    over_bytes: int  # predicted_bytes - budget_bytes


@dataclass(frozen=True)
class Plan:
    """The predicted bytes of every phase on the worst rank, and what they mean for the KV cache."""

    inputs: PlanInputs
    phases: tuple[PhasePlan, ...]
    pp_stage: int  # the pipeline stage planned (the one with the highest peak)
    kv_cache_bytes: int  # the KV cache the phases hold (configured, or the recommendation for auto)
    kv_cache_source: str  # "kv_cache_bytes" | "gpu_memory_utilization" | "auto"
    largest_safe_kv_cache_bytes: int  # the most KV cache every phase leaves room for (0 if none)
    kv_limiting_phase: str  # the phase holding the KV cache that leaves it the least room
    recommended_kv_cache_bytes: int  # largest safe, capped at what max_num_seqs sequences can use
    min_kv_cache_bytes: int  # one max_model_len sequence: less and the engine refuses to start
    kv_bytes_per_token: int
    engine_weight_bytes: int
    rollout_engine_reserve_bytes: int
    notes: tuple[str, ...] = field(default=())

    def at_lengths(self, lengths: StepLengths) -> Plan:
        """This plan evaluated at a step's recorded lengths (:meth:`PlanInputs.at_lengths`), the same KV cache."""
        return make_plan(self.inputs.at_lengths(lengths, self.kv_cache_bytes))

    # ------------------------------------------------------------ device budget
    @property
    def capacity_bytes(self) -> int:
        return self.inputs.device.total_bytes

    @property
    def runtime_overhead_bytes(self) -> int:
        return self.inputs.runtime_bytes

    @property
    def margin_bytes(self) -> int:
        return self.inputs.margin_bytes

    @property
    def budget_bytes(self) -> int:
        """What the project's tensors may hold: device total - runtime overhead - fragmentation margin."""
        return self.capacity_bytes - self.runtime_overhead_bytes - self.margin_bytes

    # ------------------------------------------------------------ results
    @property
    def names(self) -> tuple[str, ...]:
        """The planned phases' names in order (PHASES, after the eval phase when the run evaluates)."""
        return tuple(p.name for p in self.phases)

    def phase(self, name: str) -> PhasePlan:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r}; phases are {self.names}")

    def measurable_bytes(self, name: str) -> int:
        """What a run measures in phase ``name`` if the plan is right: its prediction plus the runtime overhead
        (the measurement includes the CUDA context or, on CPU, what the process allocates beside the tensors)."""
        return self.phase(name).predicted_bytes + self.runtime_overhead_bytes

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.predicted_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.predicted_bytes

    @property
    def peak_phase(self) -> str:
        return self.peak.name

    @property
    def wake_window_peak(self) -> PhasePlan:
        """The largest phase from ``wake_weights`` to ``wake_kv_cache``, where staged and all-at-once differ."""
        window = wake_window_phases()
        return max((p for p in self.phases if p.name in window), key=lambda p: p.predicted_bytes)

    @property
    def overflows(self) -> tuple[Overflow, ...]:
        return tuple(
            Overflow(p.name, p.predicted_bytes, p.predicted_bytes - self.budget_bytes)
            for p in self.phases
            if p.predicted_bytes > self.budget_bytes
        )

    @property
    def kv_cache_too_small(self) -> bool:
        return self.kv_cache_bytes < self.min_kv_cache_bytes

    @property
    def fits(self) -> bool:
        return not self.overflows and not self.kv_cache_too_small

    @property
    def headroom_bytes(self) -> int:
        """Budget left at the peak (negative: the overflow)."""
        return self.budget_bytes - self.peak_bytes

    @property
    def kv_wake_phase(self) -> str:
        return "wake_kv_cache" if self.inputs.rollout.wake_strategy == "staged" else "wake_weights"

    def kv_cache_tokens(self, kv_cache_bytes: int | None = None) -> int:
        """Tokens a KV cache of ``kv_cache_bytes`` (default: the planned one) holds, in whole blocks."""
        kv = self.kv_cache_bytes if kv_cache_bytes is None else kv_cache_bytes
        block = self.kv_bytes_per_token * self.inputs.kv_block_size
        return kv // block * self.inputs.kv_block_size

    def equivalent_utilization(self, kv_cache_bytes: int | None = None) -> dict[str, float]:
        """The ``gpu_memory_utilization`` that yields ``kv_cache_bytes`` under each engine's meaning (its
        profile's sizing rule, ``colocation.engines``). vLLM on CUDA: fraction of the device's total memory for
        weights + KV cache + reserve (CUDA graphs, profiled activations). native, and vLLM on CPU: weights + KV
        cache + activation reserve, of the device total (on CPU, of ``rollout.cpu_capacity_gb``)."""
        inp = self.inputs
        kv = self.kv_cache_bytes if kv_cache_bytes is None else kv_cache_bytes
        return {
            name: profile.utilization(kv, _sizing(inp, profile, self.engine_weight_bytes))
            for name, profile in ENGINE_PROFILES.items()
        }

    @property
    def recommended_gpu_memory_utilization(self) -> float:
        """The recommended KV cache as this engine's ``gpu_memory_utilization`` (rounded down, 3 decimals)."""
        value = self.equivalent_utilization(self.recommended_kv_cache_bytes)[self.inputs.rollout.engine]
        return math.floor(value * 1000) / 1000


def _sizing(inp: PlanInputs, profile: EngineProfile, weights: int) -> KvSizing:
    """What an engine's KV sizing rule (``EngineProfile.kv_cache_bytes``) takes, on this plan's device."""
    profiled = None
    if profile.profiles_activations(inp.device.kind):  # its reserve: runtime + the profiled activation peak
        profiled = inp.persistent_bytes_of(profile) + engine_activation_bytes(
            inp.shape,
            inp.rollout.tp,
            inp.element_bytes,
            inp.vllm_batched_tokens,
            inp.rollout.max_num_seqs,
            profile.sampler_tensors(inp.device.kind),
            **_engine_moe(inp, profile.name),
        )
    return KvSizing(
        device_kind=inp.device.kind,
        device_total_bytes=inp.device.total_bytes,
        capacity_bytes=inp.utilization_capacity_bytes,
        weight_bytes=weights,
        activation_reserve_bytes=inp.native_activation_reserve_bytes,
        profiled_reserve_bytes=profiled,
    )


def make_plan(inp: PlanInputs) -> Plan:
    """Predict every phase on the worst rank and size the KV cache (see the module doc)."""
    weights = engine_param_count(inp.shape, inp.rollout.tp, *inp.engine_expert_split) * inp.element_bytes
    rollout_reserve = inp.engine_persistent_bytes + engine_rollout_activation_bytes(inp)
    per_token = kv_bytes_per_token(inp.shape, inp.rollout.tp, inp.element_bytes)
    block = per_token * inp.kv_block_size
    blocks_per_seq = math.ceil(inp.engine_max_model_len / inp.kv_block_size)
    useful_kv = inp.rollout.max_num_seqs * blocks_per_seq * block
    budget = inp.device.total_bytes - inp.runtime_bytes - inp.margin_bytes
    stages = [_stage(inp, stage) for stage in range(inp.actor.pp)]

    # The KV cache is the one free variable: each phase that holds it leaves budget - (everything else)
    # for it; the smallest such room over phases and stages is the largest safe KV (a tie: the earlier phase)
    room, _, limiting_phase = min(
        (budget - (p.predicted_bytes - p.components["kv_cache"]), index, p.name)
        for st in stages
        for index, p in enumerate(_phases(inp, st, kv_cache_bytes=1))
        if p.components["kv_cache"]
    )
    largest_safe = max(0, room) // block * block
    recommended = min(largest_safe, useful_kv)
    if inp.rollout.kv_cache_bytes is not None:
        kv, source = inp.rollout.kv_cache_bytes, "kv_cache_bytes"
    elif inp.rollout.utilization is not None:
        sized = inp.engine_profile.kv_cache_bytes(inp.rollout.utilization, _sizing(inp, inp.engine_profile, weights))
        kv, source = max(0, sized), "gpu_memory_utilization"
    else:
        kv, source = recommended, "auto"
    kv = kv // block * block
    if inp.engine_profile.caps_kv_cache_at_max_num_seqs:
        kv = min(kv, useful_kv)  # the engine allocates no more than max_num_seqs sequences can use
    plans = [_phases(inp, st, kv) for st in stages]
    worst = max(range(len(stages)), key=lambda i: max(p.predicted_bytes for p in plans[i]))
    notes = []
    if inp.actor.pp > 1:
        notes.append(f"planned for pipeline stage {worst} of {inp.actor.pp} (the highest peak)")
    return Plan(
        inputs=inp,
        phases=plans[worst],
        pp_stage=worst,
        kv_cache_bytes=kv,
        kv_cache_source=source,
        largest_safe_kv_cache_bytes=largest_safe,
        kv_limiting_phase=limiting_phase,
        recommended_kv_cache_bytes=recommended,
        min_kv_cache_bytes=blocks_per_seq * block,
        kv_bytes_per_token=per_token,
        engine_weight_bytes=weights,
        rollout_engine_reserve_bytes=rollout_reserve,
        notes=tuple(notes),
    )


# ---------------------------------------------------------------- side by side
VARIANT_FLAGS = ("params", "grads", "optimizer")  # actor.offload.*


def with_kv_cache(inp: PlanInputs, kv_cache_bytes: int) -> PlanInputs:
    """``inp`` with the engine's KV cache fixed at ``kv_cache_bytes`` (``rollout.kv_cache_bytes``), to compare
    plans at one cache; unchanged when that is below any cache a run may set (no KV cache fits: nothing to fix)."""
    if kv_cache_bytes < MIN_KV_CACHE_BYTES:
        return inp
    return inp.with_rollout(kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=AUTO)


def variants(inp: PlanInputs) -> list[tuple[str, Plan]]:
    """The plan, the other wake strategy and each offload flag flipped, all with the same KV cache bytes."""
    base = make_plan(inp)
    fixed = with_kv_cache(inp, base.kv_cache_bytes)
    other = "all_at_once" if inp.rollout.wake_strategy == "staged" else "staged"
    out = [("as configured", base), (f"wake_strategy={other}", make_plan(fixed.with_rollout(wake_strategy=other)))]
    for flag in VARIANT_FLAGS:
        value = not getattr(inp.actor.offload, flag)
        out.append((f"offload.{flag}={str(value).lower()}", make_plan(fixed.with_offload(**{flag: value}))))
    return out


# ---------------------------------------------------------------- the check before the KV cache wakes
@dataclass(frozen=True)
class FitCheck:
    fits: bool
    phase: str
    needed_bytes: int
    free_bytes: int
    shortfall_bytes: int
    fitting_kv_cache_bytes: int | None  # a KV cache that fits the measured free memory (None: none does)
    line: str


def phase_growth_bytes(plan: Plan, name: str) -> dict[str, int]:
    """Bytes ``name`` allocates per component beyond what the phase before it held."""
    index = plan.names.index(name)
    before = plan.phases[index - 1].components  # the phase before the first is the previous step's last
    return {k: v - before[k] for k, v in plan.phases[index].components.items() if v > before[k]}


def check_fits(plan: Plan, measured_free_bytes: int, phase: str | None = None) -> FitCheck:
    """Compare the free memory measured just before ``phase`` (default: the KV-cache wake) with the plan.

    Needed: what the phase allocates, plus the engine's rollout activations that come right after the
    wake. The line names the phase, the shortfall and a ``rollout.kv_cache_bytes`` that fits.
    """
    name = phase or plan.kv_wake_phase
    growth = phase_growth_bytes(plan, name)
    rollout_extra = max(
        0, plan.phase("rollout").components["engine_reserve"] - plan.phase(name).components["engine_reserve"]
    )
    needed = sum(growth.values()) + (rollout_extra if "kv_cache" in growth else 0)
    shortfall = max(0, needed - measured_free_bytes)
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in growth.items())
    if "kv_cache" in growth and rollout_extra:
        parts += f", rollout engine activations {_gib(rollout_extra)}"
    if not shortfall:
        line = f"{name}: needs {_gib(needed)} ({parts}), {_gib(measured_free_bytes)} free: fits"
        return FitCheck(True, name, needed, measured_free_bytes, 0, plan.kv_cache_bytes, line)
    block = plan.kv_bytes_per_token * plan.inputs.kv_block_size
    fitting = (plan.kv_cache_bytes - shortfall) // block * block if "kv_cache" in growth else None
    if fitting is not None and fitting >= plan.min_kv_cache_bytes:
        util = plan.equivalent_utilization(fitting)[plan.inputs.rollout.engine]
        fix = (
            f"rollout.kv_cache_bytes={fitting} ({_gib(fitting)}, {plan.kv_cache_tokens(fitting)} tokens; "
            f"gpu_memory_utilization={math.floor(util * 1000) / 1000} for {plan.inputs.rollout.engine}) fits"
        )
    else:
        fitting = None
        fix = "no KV cache fits: offload more of the actor (actor.offload.*) or use wake_strategy=staged"
    line = (
        f"{name} would overflow: needs {_gib(needed)} ({parts}) but {_gib(measured_free_bytes)} is free, "
        f"short by {_gib(shortfall)}; {fix}"
    )
    return FitCheck(False, name, needed, measured_free_bytes, shortfall, fitting, line)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
