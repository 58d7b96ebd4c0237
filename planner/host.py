"""Host memory per node: what a node's ranks hold in RAM in every phase, against the node's RAM.

Per rank, on CUDA:

- ``offload_pinned``: the pinned buffers megatron_backend/memory.py registers at the first offload and keeps for
  the run (``cudaHostRegister`` of exactly the storage's bytes: no rounding): params when ``offload.params``,
  the optimizer's states when ``offload.optimizer``, the reference actor's params when it offloads them. Grads
  are released without a host copy. Every phase: the buffers stay registered while the state is on the device.
- ``hybrid_optimizer``: with ``actor.optimizer_offload_fraction`` f, megatron's HybridDeviceOptimizer
  (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) keeps for a fraction f of the rank's
  distributed-optimizer shard a pinned fp32 copy of the params, a pinned fp32 gradient and CPUAdam's moments on
  the host: 16 bytes per offloaded parameter, every phase.
- ``engine_sleep_copy``: vLLM's sleep level 1 backs every weight allocation up to host
  (vllm/device_allocator/cumem.py ``sleep``: ``torch.empty(size, device="cpu", pin_memory=True)`` per cumem
  allocation), i.e. torch's caching host allocator, which rounds each block up to a power of two and keeps it
  after the wake frees it: every phase from the first sleep on. Counted per weight tensor (vLLM layout,
  planner/sizes.py) rounded up to its 2 MiB segment, then to a power of two. Level 2 (the default) keeps none.
- ``checkpoint_staging``: a megatron synchronous save (megatron_backend/dist_checkpoint.py ->
  ``dist_checkpointing.save``) stages every tensor this rank writes in host memory first
  (megatron/core/dist_checkpointing/strategies/filesystem_async.py ``FileSystemWriterAsync.preload_tensors``:
  ``tensor.to("cpu", non_blocking=True)``, called from async_utils.py ``AsyncRequest.execute_sync``): pinned
  blocks of the caching host allocator, a power of two each, kept after the save. The worst rank writes its
  params (replica 0) and its optimizer shard: param, fp32 main param, exp_avg, exp_avg_sq per tensor. From the
  first save on (``trainer.save_every`` > 0). Not the offloaded copies: the loop saves after ``train``, when
  the state is on the device and the pinned buffers still hold the previous step's values; and megatron's writer
  cannot write from them without a copy either: a CPU tensor that is a view of a larger storage is cloned
  (filesystem_async.py ``_clone_if_needed``), and every offloaded parameter or state is a view of one flat
  buffer per storage. A run that exports HF weights but never saves stages its params the same way in the
  export's params-only save (megatron_backend/hf_export.py::save_live), kept from the first export on; one
  that also saves reuses the save's cached blocks of those sizes.
- ``hf_file_writing``: in ``export_hf`` (``trainer.export_every`` / ``export_at_end``), the HF files written
  tensor by tensor from that save: one HF tensor plus the two stored chunks DCP's reader keeps
  (planner/plan.py ``hf_file_writing_bytes``), host memory beside the device's state.
- ``reference_check``: in ``weight_sync``, the weight sync's reference check (weight_sync/reference.py): the rank's
  block clones of the sampled tensors, every rank's blocks unpickled from all_gather_object and the full HF tensors
  assembled from them, gathered over a gloo group: all host memory (planner/plan.py ``reference_check_bytes``).
- ``runtime``: the process besides those (Python, torch with CUDA, NCCL, megatron-core, vLLM in-process):
  ``host_runtime_bytes``, an estimate until a GPU run's RSS is read.
- ``data``: the task's records (the data file's bytes; ``PlanInputs.data_host_bytes``).
- ``routing`` (MoE, when the engine returns each completion's routing): the step's completions' routing, the
  rank's batch of it and a pass's micro-batches, int16 (planner/sizes.py ``routing_host_bytes``), every phase
  (from the rollout's end to the step's). On CPU it is in the rank's RSS beside its device plan.

On CPU the device is the host: a rank's RSS is its device plan (validated against measured RSS by ``make
validate-plan``), so the host plan per rank is that phase's plan plus its runtime level, plus what the offloaded
state holds in the page cache (megatron_backend/memory.py writes it to a temp file: outside the RSS, not
validated) and, in ``save_checkpoint``, the clones megatron's writer makes of the params (views of the DDP
buffer). The node holds ``ranks_per_node`` such ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocation.phases import EXPORT_PHASE
from planner.plan import (
    PHASES,
    Plan,
    _stage,
    actor_stage_counts,
    hf_file_writing_bytes,
    optimizer_host_bytes,
    reference_check_bytes,
)
from planner.sizes import (
    FP32_BYTES,
    actor_stage_tensor_elements,
    engine_tensor_elements,
    optimizer_bytes_per_param,
    power_of_two_bytes,
    routing_host_bytes,
)

HOST_COMPONENTS = (
    "offload_pinned",
    "hybrid_optimizer",
    "engine_sleep_copy",
    "checkpoint_staging",
    "hf_file_writing",
    "reference_check",
    "offload_page_cache",
    "rank",
    "data",
    "routing",
)
SAVE_PHASE = "save_checkpoint"
CUDA_SEGMENT_BYTES = 2 * 2**20  # the caching allocator's large-segment rounding (vLLM's cumem pool allocations)


@dataclass(frozen=True)
class HostPhase:
    name: str
    components: dict[str, int]  # one rank's bytes

    @property
    def rank_bytes(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class HostPlan:
    phases: tuple[HostPhase, ...]
    ranks_per_node: int
    node_memory_bytes: int | None
    node_memory_source: str

    @property
    def peak(self) -> HostPhase:
        return max(self.phases, key=lambda p: (p.rank_bytes, p.name == SAVE_PHASE))  # a tie: where it starts

    @property
    def peak_phase(self) -> str:
        return self.peak.name

    @property
    def peak_bytes_per_node(self) -> int:
        return self.peak.rank_bytes * self.ranks_per_node

    @property
    def fits(self) -> bool | None:
        """None: the node's RAM is unknown."""
        return None if self.node_memory_bytes is None else self.peak_bytes_per_node <= self.node_memory_bytes

    def to_json(self) -> dict:
        return {
            "peak_bytes_per_node": self.peak_bytes_per_node,
            "node_memory_bytes": self.node_memory_bytes,
            "node_memory_source": self.node_memory_source,
            "peak_phase": self.peak_phase,
            "fits": self.fits,
            "ranks_per_node": self.ranks_per_node,
            "peak_components_per_rank": dict(self.peak.components),
            "phases": [{"name": p.name, "rank_bytes": p.rank_bytes, "components": p.components} for p in self.phases],
        }


def checkpoint_staging_bytes(plan: Plan, params_only: bool = False) -> int:
    """What a CUDA save stages on the worst rank: each tensor it writes as a power-of-two pinned block
    (``params_only``: an HF export's params-only save)."""
    inp = plan.inputs
    e = inp.element_bytes
    main = optimizer_bytes_per_param(e) // FP32_BYTES - 2  # fp32 main params of a 16-bit model
    # exp_avg and exp_avg_sq; the hybrid optimizer's host fraction is already host tensors of their own: not
    # views, so megatron's writer neither clones nor pins them (filesystem_async.py _clone_if_needed)
    moments = 2 * (1 - inp.actor.optimizer_offload_fraction)
    total = 0
    # the routed experts' optimizer states shard over the expert-DP group, the others' over DP (plan.optimizer_shards)
    for experts, group in ((False, inp.actor_dp), (True, inp.expert_dp)):
        shard = group if inp.distributed_optimizer else 1
        for n in actor_stage_tensor_elements(
            inp.shape, inp.actor.tp, inp.actor.pp, plan.pp_stage, inp.actor.ep, inp.expert_tp, experts
        ):
            total += power_of_two_bytes(n * e)
            if not params_only:
                total += round((main + moments) * power_of_two_bytes(-(-n * FP32_BYTES // shard)))
    return total


def engine_sleep_copy_bytes(plan: Plan) -> int:
    """vLLM's level-1 sleep copy of one engine rank's weights (CUDA): per tensor, its segment, a power of two."""
    inp = plan.inputs
    e = inp.element_bytes
    total = 0
    for n in engine_tensor_elements(inp.shape, inp.rollout.tp, *inp.engine_expert_split):
        segment = -(-n * e // CUDA_SEGMENT_BYTES) * CUDA_SEGMENT_BYTES
        total += power_of_two_bytes(segment)
    return total


def host_plan(plan: Plan) -> HostPlan:
    """Every phase's host bytes per rank (and ``save_checkpoint``), the node's peak against its RAM."""
    inp = plan.inputs
    st = _stage(inp, plan.pp_stage)
    phases = []
    routing = 0
    if inp.routed_experts:
        routing = routing_host_bytes(
            inp.shape, inp.sequences_per_step, inp.sequences_per_step // inp.actor_dp, inp.seq_len
        )
    if inp.on_cuda:
        pinned = (
            (st.actor_params if inp.actor.offload.params else 0)
            + (st.optimizer if inp.actor.offload.optimizer else 0)
            + (st.ref_params if inp.reference_model and inp.actor.offload.ref_params else 0)
        )
        sleep_copy = (
            engine_sleep_copy_bytes(plan) if inp.rollout.engine == "vllm" and inp.rollout.sleep_level == 1 else 0
        )
        staging = checkpoint_staging_bytes(plan) if inp.checkpoint_saves else 0
        if inp.hf_exports and not inp.checkpoint_saves:  # the export's params-only save, cached the same way
            staging = checkpoint_staging_bytes(plan, params_only=True)
        runtime = int(inp.constants.value("host_runtime_bytes"))
        base = dict.fromkeys(HOST_COMPONENTS, 0)
        hybrid = optimizer_host_bytes(inp, *actor_stage_counts(inp, plan.pp_stage))
        base.update(
            offload_pinned=pinned,
            hybrid_optimizer=hybrid,
            engine_sleep_copy=sleep_copy,
            rank=runtime,
            data=inp.data_host_bytes,
            routing=routing,
        )
        reference = reference_check_bytes(inp, plan.pp_stage)[1]
        for name in PHASES:  # every phase alike: the buffers are kept for the run, the staging after a save
            check = {"reference_check": reference} if name == "weight_sync" else {}
            phases.append(HostPhase(name, {**base, "checkpoint_staging": staging, **check}))
        if inp.checkpoint_saves:
            phases.append(HostPhase(SAVE_PHASE, {**base, "checkpoint_staging": staging}))
        if inp.hf_exports:  # after the save, as in the step
            writing = hf_file_writing_bytes(inp)
            phases.append(HostPhase(EXPORT_PHASE, {**base, "checkpoint_staging": staging, "hf_file_writing": writing}))
    else:
        offloaded = {"actor_params": st.actor_params, "optimizer": st.optimizer, "ref_params": st.ref_params}
        flags = {"actor_params": inp.actor.offload.params, "optimizer": inp.actor.offload.optimizer}
        flags["ref_params"] = inp.reference_model and inp.actor.offload.ref_params
        for p in plan.phases:
            page_cache = sum(b for c, b in offloaded.items() if flags[c] and not p.components[c])
            components = dict.fromkeys(HOST_COMPONENTS, 0)
            components.update(
                offload_page_cache=page_cache,
                rank=p.predicted_bytes + plan.runtime_overhead_bytes,
                data=inp.data_host_bytes,
                routing=routing,
            )
            phases.append(HostPhase(p.name, components))
        if inp.checkpoint_saves:  # after train, everything resident: the params' clones beside it
            train = plan.phase("train")
            resident = train.predicted_bytes - train.components["activations"] - train.components["logits"]
            components = dict.fromkeys(HOST_COMPONENTS, 0)
            components.update(
                checkpoint_staging=st.actor_params,
                rank=resident + plan.runtime_overhead_bytes,
                data=inp.data_host_bytes,
                routing=routing,
            )
            phases.append(HostPhase(SAVE_PHASE, components))
    return HostPlan(tuple(phases), inp.ranks_per_node, inp.device.host_memory_bytes, inp.device.host_memory_source)
