"""What the planner needs to know about a run: :class:`PlanInputs` (keyword-only, checked on construction)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from colocation.engines import EngineProfile, engine_profile
from colocation.phases import WAKE_STRATEGIES  # the step's table owns them (colocation/phases.py)
from modelspec.dtypes import DTYPE_NAMES, element_bytes
from modelspec.mesh import check_actor_split, check_rollout_experts, check_rollout_split, uses_sequence_parallel
from modelspec.shape import ModelShape
from planner.calibration import Calibration, load
from planner.devices import GIB, MIB, DeviceSpec

RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
ATTENTION = ("flash", "unfused")

# The constants not derived from the model's shape (runtime overhead, vLLM's CPU runtime and CUDA graphs, NCCL
# buffers, the CPU local spec's activation factor, the margin) live in planner/calibration/<kind>.json, each with
# its source; PlanInputs.calibration (None: that file) and the per-run override fields below pick them.


def vllm_default_max_num_batched_tokens(
    device: DeviceSpec, rollout_tp: int, max_num_seqs: int, max_model_len: int
) -> int:
    """vLLM 0.32's ``max_num_batched_tokens`` when none is given to ``vllm.LLM`` (what its profile run sizes
    the activations for): ``EngineArgs.get_batch_defaults`` for the LLM class, by the device's total memory
    (>= 160 GiB: 16384; >= 70 GiB and not an A100: 16384; else 8192; CPU: 4096 x the engine's world size),
    capped at ``max_num_seqs x max_model_len`` (``_set_default_max_num_seqs_and_batched_tokens_args``).
    Restated here (the planner imports no vLLM); tests/test_vllm_engine.py pins it against the real one."""
    if device.kind == "cpu":
        default = 4096 * rollout_tp
    elif device.total_bytes >= 160 * GIB or (device.total_bytes >= 70 * GIB and "a100" not in device.name.lower()):
        default = 16384
    else:
        default = 8192
    return min(default, max_num_seqs * max_model_len)


@dataclass(frozen=True)
class MicroBatches:
    """How one pass splits a rank's sequences (the largest micro-batch)."""

    count: int  # micro-batches per pass
    sequences: int  # sequences in the largest
    model_tokens: int  # tokens the model runs on: sequences x padded length, or their real tokens packed
    response_tokens: int  # rows of the log-prob pass
    attention_span: float  # each sequence's attention length: the padded length, or (packed) its mean


@dataclass(frozen=True, kw_only=True)
class StepLengths:
    """The token lengths one step's sequences had, as the run records them (telemetry/metrics.py::step_lengths, per
    step in metrics.jsonl): the plan at launch assumes the longest prompt and ``max_new_tokens`` responses (a bound,
    since that is what can run out of memory); evaluated at these it predicts what the step held (the model that
    ``make validate-plan`` checks)."""

    longest_prompt: int
    longest_response: int
    longest_sequence: int  # prompt + response of the longest row: the padded width [B, S] of the rank's batch
    mean_prompt: float
    mean_response: float
    # MoE: the most routed copies an EP rank's experts received in the step's train pass, over balanced routing's
    # (train/moe/routed_copies_max_ratio; 1: balanced, or not recorded)
    routed_copies_ratio: float = 1.0


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """One rank's view of a run: model, layouts, offload and wake choices, batch sizes, engine and device.

    The engine's KV cache comes from ``kv_cache_bytes`` when set, else ``gpu_memory_utilization`` under
    the engine's meaning (vLLM: the fraction of the device's total memory for weights + KV cache +
    reserve; native: the same, of ``engine_capacity_bytes`` on CPU), else (both None: ``auto``) the
    largest KV cache that fits.
    """

    shape: ModelShape
    device: DeviceSpec
    dtype: str = "bfloat16"
    # actor (megatron-core)
    actor_tp: int = 1
    actor_pp: int = 1
    actor_vpp: int | None = None
    actor_dp: int = 1
    # expert parallel (MoE): each MoE layer's experts over actor_ep ranks, each expert's rows over actor_etp (None:
    # actor_tp, megatron's default); the experts' grads and optimizer states shard over the expert-DP group
    actor_ep: int = 1
    actor_etp: int | None = None
    # actor.sequence_parallel (megatron's at actor_tp > 1; null: on for an MoE model): the residual stream, norms
    # and the MoE router hold S / tp of the tokens (sequence_parallel_on)
    sequence_parallel: bool | None = None
    distributed_optimizer: bool = False  # megatron's distributed optimizer shards optimizer states over DP
    # megatron's optimizer CPU offload (HybridDeviceOptimizer, distributed optimizer only): this fraction of the
    # parameters keep their Adam moments on the host (their fp32 main params stay on the device: the step copies
    # the host's result back into them), beside a pinned fp32 copy and gradient there
    optimizer_offload_fraction: float = 0.0
    offload_params: bool = True
    offload_grads: bool = True
    offload_optimizer: bool = True
    micro_batch_size: int = 1
    # actor.remove_padding: micro-batches run on real tokens (THD), attention spans each sequence
    remove_padding: bool = False
    max_tokens_per_micro_batch: int | None = None  # token budget of train micro-batches (None: micro_batch_size)
    max_tokens_per_forward_micro_batch: int | None = None  # old/ref_logprob (None: 2 x the train budget)
    # "full": layers keep only their input and recompute in backward (recompute_method uniform: units
    # of recompute_num_layers layers; block: the first recompute_num_layers layers of each stage);
    # "selective": recompute_modules recompute (megatron's default core_attn)
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    logprob_chunk_tokens: int | None = None  # actor.logprob_chunk_tokens (None: the unfused pass)
    entropy_grad: bool = False  # an entropy term in the loss (algorithm.entropy_coef > 0)
    entropy_recompute: bool = True  # actor.entropy_recompute
    attention: str = "flash"  # "unfused": megatron's local spec (CPU) materializes [s, s] scores
    reference_model: bool = False  # a frozen reference actor (KL)
    offload_ref_params: bool = True  # its params on host except around ref_logprob (actor.offload.ref_params)
    # batch: every rank sees sequences_per_step / actor_dp sequences of prompt + response tokens
    sequences_per_step: int = 1
    # the eval batch at the step boundaries that evaluate: every eval problem x eval.n_samples (0: no eval)
    eval_sequences: int = 0
    # the run writes HF exports (trainer.export_every > 0 or trainer.export_at_end): the export_hf phase is planned
    hf_exports: bool = False
    prompt_tokens: int = 512
    response_tokens: int = 1024
    # average lengths (None: prompt_tokens / response_tokens, every sequence as long as it may be: the
    # worst case); with remove_padding or a token budget they decide the micro-batches' real tokens
    mean_prompt_tokens: int | None = None
    mean_response_tokens: int | None = None
    # the engine's max_tokens per sample (rollout.max_new_tokens), which sizes the native engine's per-row tables
    # whatever the responses' lengths (None: response_tokens; at_lengths keeps the launch's)
    max_new_tokens: int | None = None
    # MoE: the routed copies an EP rank's experts receive, as a multiple of balanced routing's (N k for N tokens); the
    # launch plan assumes balanced routing (1.0) or the capacity factor's bound, the plan at a step's recorded values
    # the step's (at_lengths); planner.report.routing_headroom says how far above it the plan still fits
    routed_copies_ratio: float = 1.0
    # MoE: megatron's expert capacity factor (actor.moe_expert_capacity_factor; None: no token is dropped), which
    # bounds the routed copies (planner.sizes.capacity_routed_copies_ratio: the launch plan's routed_copies_ratio)
    moe_expert_capacity_factor: float | None = None
    # rollout engine
    engine: str = "vllm"
    rollout_tp: int = 1
    rollout_ep: int = 1  # engine expert parallel: E / rollout_ep experts per engine rank (vLLM: 1 or the world)
    wake_strategy: str = "staged"
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    engine_capacity_bytes: int | None = None  # native engine on CPU: rollout.cpu_capacity_gb; None: device total
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    block_size: int | None = None  # None: the engine's default (colocation.engines: its profile)
    native_activation_reserve_bytes: int = 64 * MIB
    vllm_max_batched_tokens: int | None = None  # rollout.max_num_batched_tokens; None: vLLM's per-device default
    native_max_batched_tokens: int | None = None  # the native engine's prefill cap (rollout.max_num_batched_tokens)
    cuda_graph_bytes: int | None = None  # None: the calibration's vllm_cuda_graph_bytes for vLLM on CUDA
    sleep_level: int = 2  # rollout.sleep_level: 1 keeps a host copy of the engine's weights while asleep (vLLM)
    # host memory (planner/host.py)
    ranks_per_node: int = 1
    checkpoint_saves: bool = False  # trainer.save_every > 0
    data_host_bytes: int = 0  # the task's records in each rank (its data file's bytes)
    # MoE: the engine returns each completion's routing (RunConfig.returns_routed_experts), which the actor replays
    # (algorithm.routing_replay) or compares with its own (the routing-mismatch metric)
    routed_experts: bool = False
    routing_replay: bool = False
    # weight sync and device
    sync_peers: int | None = None  # the most ranks one rank exchanges weights with (run/memory_plan.py); None: bound
    sync_bucket_bytes: int = 512 * MIB
    # per actor pipeline stage, the most bytes one of its ranks stages in one bucket of the weight sync: the sync
    # plan's packed part (weight_sync.transfers.SyncPlan.max_staged_bytes, computed from both sides' layouts by
    # run/memory_plan.py). None: not computed; planned as the bucket's bound (planner/plan.py::sync_staging_bytes)
    sync_staged_bytes: tuple[int, ...] | None = None
    verify_sync: bool = False  # weight_sync.verify: int64 checksums of every slice after each sync
    margin_fraction: float | None = None  # None: the calibration's margin_fraction
    runtime_overhead_bytes: int | None = None  # None: launch_runtime_bytes + runtime_after_launch_bytes, or the fit
    # CPU: the rank's level beside its tensors as the run measured it at launch, before the first step
    # (telemetry.memory_timeline.MemoryProbe.runtime_level_bytes, the max over ranks); the plan's runtime level is this plus the
    # calibration's runtime_after_launch_bytes. None (make plan, before a launch): the fitted runtime_overhead_bytes
    launch_runtime_bytes: int | None = None
    # None: the calibration's nccl_bytes_per_communicator, per NCCL communicator beyond its counted buffers (CPU: 0)
    comm_bytes_per_communicator: int | None = None
    calibration: Calibration | None = None  # None: planner/calibration/<device kind>.json

    def __post_init__(self) -> None:
        s = self.shape
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPE_NAMES}")
        for name in ("actor_tp", "actor_pp", "actor_dp", "micro_batch_size", "sequences_per_step", "rollout_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction={self.optimizer_offload_fraction} must be in [0, 1]")
        if self.optimizer_offload_fraction and not (self.distributed_optimizer and self.on_cuda):
            raise ValueError("optimizer_offload_fraction > 0 needs megatron's distributed optimizer on CUDA")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={self.sleep_level} must be 1 or 2")
        if self.routing_replay and not self.routed_experts:
            raise ValueError("routing_replay=True needs routed_experts=True: it replays the routing the engine returns")
        if self.ranks_per_node < 1 or self.data_host_bytes < 0:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1, data_host_bytes >= 0")
        for name in ("prompt_tokens", "response_tokens", "max_num_seqs", "block_size", "vllm_max_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in (
            "max_tokens_per_micro_batch",
            "max_tokens_per_forward_micro_batch",
            "logprob_chunk_tokens",
            "recompute_num_layers",
            "mean_prompt_tokens",
            "mean_response_tokens",
            "max_new_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1, or None")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ValueError(f"moe_expert_capacity_factor={self.moe_expert_capacity_factor} must be > 0, or None")
        if not self.routed_copies_ratio > 0:
            raise ValueError(f"routed_copies_ratio={self.routed_copies_ratio} must be > 0 (1: balanced routing)")
        if (self.max_new_tokens or self.response_tokens) < self.response_tokens:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} is below response_tokens={self.response_tokens}: no response is "
                "longer than the engine's max_tokens; raise max_new_tokens or leave it None"
            )
        too_long = (self.mean_prompt_tokens or 0) > self.prompt_tokens
        if too_long or (self.mean_response_tokens or 0) > self.response_tokens:
            raise ValueError("mean_prompt_tokens / mean_response_tokens cannot exceed prompt_tokens / response_tokens")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={self.recompute_method!r} is not one of {RECOMPUTE_METHODS}")
        if not set(self.recompute_modules) <= set(RECOMPUTE_MODULES):
            raise ValueError(f"recompute_modules={self.recompute_modules} must be drawn from {RECOMPUTE_MODULES}")
        check_actor_split(s, self.actor_tp, self.actor_pp, self.actor_vpp)
        if self.actor_ep < 1 or (self.actor_etp is not None and self.actor_etp < 1):
            raise ValueError(f"actor_ep={self.actor_ep}, actor_etp={self.actor_etp} must be >= 1 (actor_etp None: TP)")
        if (self.actor_ep > 1 or self.actor_etp is not None) and not s.num_experts:
            raise ValueError(f"actor_ep={self.actor_ep} / actor_etp={self.actor_etp} need an MoE model; set 1 / None")
        if s.num_experts and s.num_experts % self.actor_ep:
            raise ValueError(f"actor_ep={self.actor_ep} must divide the model's {s.num_experts} experts")
        if s.num_experts and s.moe_intermediate_size % self.expert_tp:
            raise ValueError(f"actor_etp={self.expert_tp} must divide moe_intermediate_size={s.moe_intermediate_size}")
        if (self.actor_tp * self.actor_dp) % (self.actor_ep * self.expert_tp):
            raise ValueError(
                f"actor_ep={self.actor_ep} x expert TP {self.expert_tp} must divide actor_tp x actor_dp ="
                f" {self.actor_tp * self.actor_dp} (megatron carves expert parallel out of TP x DP)"
            )
        if self.actor_vpp is not None and self.actor_vpp > 1 and self.actor_pp < 2:
            raise ValueError(f"actor_vpp={self.actor_vpp} needs actor_pp >= 2; set actor_vpp=None")
        check_rollout_split(s, self.rollout_tp)
        check_rollout_experts(s, self.rollout_ep)
        world = self.actor_tp * self.actor_pp * self.actor_dp
        if self.engine_profile.experts_span_replicas and self.rollout_ep not in (1, world):
            raise ValueError(
                f"rollout_ep={self.rollout_ep}: {self.engine}'s expert parallel spans every engine rank; set 1 or {world}"
            )
        if self.eval_sequences < 0:
            raise ValueError(f"eval_sequences={self.eval_sequences} must be >= 0 (0: the run does not evaluate)")
        if self.sequences_per_step % self.actor_dp:
            raise ValueError(
                f"sequences_per_step={self.sequences_per_step} must split evenly over actor_dp={self.actor_dp}"
            )
        engine_profile(self.engine)  # ValueError naming the engines there are (colocation.engines)
        for name, choices in (
            ("wake_strategy", WAKE_STRATEGIES),
            ("recompute", RECOMPUTE),
            ("attention", ATTENTION),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is outside (0, 1]; or None to let the planner pick"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} must be >= 0, or None")
        if self.margin_fraction is not None and not 0.0 <= self.margin_fraction < 1.0:
            raise ValueError(f"margin_fraction={self.margin_fraction} must be in [0, 1)")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.sync_bucket_bytes < 1:
            raise ValueError(f"sync_bucket_bytes={self.sync_bucket_bytes} must be >= 1")
        staged = self.sync_staged_bytes
        if staged is not None and (len(staged) != self.actor_pp or min(staged) < 0):
            raise ValueError(f"sync_staged_bytes={staged} must give actor_pp={self.actor_pp} byte counts >= 0")

    # ---------------------------------------------------------------- derived sizes
    @property
    def element_bytes(self) -> int:
        return element_bytes(self.dtype)

    @property
    def expert_tp(self) -> int:
        """Expert TP: actor_etp, else actor_tp (megatron's expert_tensor_parallel_size default)."""
        return self.actor_etp or self.actor_tp

    @property
    def sequence_parallel_on(self) -> bool:
        """Whether the actor runs megatron's sequence parallelism (modelspec.mesh.uses_sequence_parallel)."""
        return uses_sequence_parallel(self.sequence_parallel, self.actor_tp, self.shape.is_moe)

    @property
    def sequence_parallel_split(self) -> int:
        """What the sequence-parallel region's per-token tensors are divided by: TP under it, else 1."""
        return self.actor_tp if self.sequence_parallel_on else 1

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel group's size (megatron: TP x DP = expert TP x EP x expert DP per stage)."""
        return self.actor_tp * self.actor_dp // (self.actor_ep * self.expert_tp)

    @property
    def engine_expert_split(self) -> tuple[int, int]:
        """(rollout EP, expert TP) of one engine rank's routed experts: E / rollout_ep experts, m / expert TP rows
        of each; an engine whose experts span its replicas (vLLM) splits every expert over all its ranks."""
        world = self.actor_tp * self.actor_pp * self.actor_dp
        if self.engine_profile.experts_span_replicas:  # rollout/layout.py engine_expert_split
            return (world, 1) if self.rollout_ep > 1 else (1, world)
        return self.rollout_ep, self.rollout_tp

    @property
    def engine_moe_gathered_replicas(self) -> int:
        """Replicas whose tokens an engine rank's MoE layers run on: vLLM's MoE layers span its data-parallel
        replicas and all-gather their tokens (sizes.engine_moe_bytes_per_token); 1 otherwise."""
        replicas = self.actor_tp * self.actor_pp * self.actor_dp // self.rollout_tp
        return replicas if self.shape.is_moe and self.engine_profile.experts_span_replicas else 1

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def sequences_per_rank(self) -> int:
        return self.sequences_per_step // self.actor_dp

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches(train=True).count

    @property
    def mean_seq_tokens(self) -> float:
        return (self.mean_prompt_tokens or self.prompt_tokens) + (self.mean_response_tokens or self.response_tokens)

    @property
    def forward_max_tokens(self) -> int | None:
        if self.max_tokens_per_forward_micro_batch is not None:
            return self.max_tokens_per_forward_micro_batch
        return None if self.max_tokens_per_micro_batch is None else 2 * self.max_tokens_per_micro_batch

    def planned_lengths(self, routed_copies_ratio: float | None = None) -> StepLengths:
        """The lengths these inputs plan with, as a step would record them (:meth:`at_lengths` of them changes
        nothing); ``routed_copies_ratio``: another MoE routing than these inputs' (None: theirs)."""
        return StepLengths(
            longest_prompt=self.prompt_tokens,
            longest_response=self.response_tokens,
            longest_sequence=self.seq_len,
            mean_prompt=self.mean_prompt_tokens or self.prompt_tokens,
            mean_response=self.mean_response_tokens or self.response_tokens,
            routed_copies_ratio=self.routed_copies_ratio if routed_copies_ratio is None else routed_copies_ratio,
        )

    def at_lengths(self, lengths: StepLengths, kv_cache_bytes: int) -> PlanInputs:
        """These inputs with a step's recorded lengths in place of the planned ones, the KV cache fixed at
        ``kv_cache_bytes`` (the engine's, sized at launch). The padded width is the longest row's prompt + response
        (rl/batching.py pads to it), so the prompt part is that width less the longest response; the means give
        the packed micro-batches' real tokens and the log-prob pass's rows."""
        response = max(1, lengths.longest_response)
        prompt = max(1, lengths.longest_sequence - response)
        return dataclasses.replace(
            self,
            prompt_tokens=prompt,
            response_tokens=response,
            max_new_tokens=self.max_new_tokens or self.response_tokens,
            routed_copies_ratio=lengths.routed_copies_ratio,
            mean_prompt_tokens=max(1, min(prompt, round(lengths.mean_prompt))),
            mean_response_tokens=max(1, min(response, round(lengths.mean_response))),
            kv_cache_bytes=kv_cache_bytes,
        )

    def micro_batches(self, train: bool) -> MicroBatches:
        """The micro-batches of a train (or forward-only) pass, as megatron_backend.packing forms them."""
        n = self.sequences_per_rank
        budget = self.max_tokens_per_micro_batch if train else self.forward_max_tokens
        per_seq = self.mean_seq_tokens if self.remove_padding else self.seq_len
        if budget is None:
            count = max(1, n // self.micro_batch_size)
        elif self.remove_padding:  # balanced bins of real tokens
            count = min(n, max(1, math.ceil(n * per_seq / budget)))
        else:  # rows of the padded length
            count = math.ceil(n / max(1, budget // self.seq_len))
        sequences = min(n, math.ceil(n / count))
        response = self.mean_response_tokens or self.response_tokens
        return MicroBatches(
            count=count,
            sequences=sequences,
            model_tokens=math.ceil(sequences * per_seq),
            response_tokens=math.ceil(sequences * response),
            attention_span=per_seq,
        )

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV-cache block: ``block_size``, else the engine's default on this device."""
        if self.block_size is not None:
            return self.block_size
        return self.engine_profile.default_block_size(self.device.kind)

    @property
    def engine_profile(self) -> EngineProfile:
        """The engine's memory behaviour (``colocation.engines``): what the plan asks instead of its name."""
        return engine_profile(self.engine)

    @property
    def vllm_batched_tokens(self) -> int:
        """vLLM's ``max_num_batched_tokens``: the configured one, else vLLM's own default for this device."""
        if self.vllm_max_batched_tokens is not None:
            return self.vllm_max_batched_tokens
        return vllm_default_max_num_batched_tokens(
            self.device, self.rollout_tp, self.max_num_seqs, self.engine_max_model_len
        )

    @property
    def engine_max_model_len(self) -> int:
        return self.max_model_len or self.shape.max_position_embeddings

    @property
    def on_cuda(self) -> bool:
        return self.device.kind == "cuda"

    @property
    def constants(self) -> Calibration:
        """The calibration this plan uses: ``calibration``, else the device kind's file."""
        return self.calibration if self.calibration is not None else load(self.device.kind)

    @property
    def margin_bytes(self) -> int:
        fraction = self.constants.value("margin_fraction") if self.margin_fraction is None else self.margin_fraction
        return int(fraction * self.device.total_bytes)

    @property
    def runtime_bytes(self) -> int:
        if self.runtime_overhead_bytes is not None:
            return self.runtime_overhead_bytes
        if self.measures_runtime_at_launch:
            return self.launch_runtime_bytes + int(self.constants.value("runtime_after_launch_bytes"))
        return int(self.constants.value("runtime_overhead_bytes"))

    @property
    def measures_runtime_at_launch(self) -> bool:
        """The runtime level is the run's launch measurement (plus what the steps add), not the fitted level."""
        return self.launch_runtime_bytes is not None and "runtime_after_launch_bytes" in self.constants.constants

    @property
    def activation_factor(self) -> float:
        """What the train phase holds per token over a layer's counted saved tensors: on CPU over megatron's local
        spec's count (planner.sizes.local_layer_activation_elements_per_token; calibrated: backward's buffers and
        the allocator, in RSS); Transformer Engine's on CUDA (``fused_activation_factor``: 1, never measured, with
        its uncertainty)."""
        if self.attention == "unfused":
            return self.constants.value("local_spec_activation_factor")
        return self.constants.value("fused_activation_factor") if self.on_cuda else 1.0

    @property
    def engine_persistent_bytes(self) -> int:
        """What the engine keeps while it sleeps besides weights and KV cache: its profile's runtime reserve
        on this device (vLLM: CUDA graphs on CUDA, ``cuda_graph_bytes`` when given; its runtime on CPU), or 0."""
        return self.persistent_bytes_of(self.engine_profile)

    def persistent_bytes_of(self, profile: EngineProfile) -> int:
        """:attr:`engine_persistent_bytes` of the engine ``profile`` describes, on this device."""
        constant = profile.runtime_reserve_constant(self.device.kind)
        if constant is None:
            return 0
        if self.on_cuda and self.cuda_graph_bytes is not None:
            return self.cuda_graph_bytes
        return int(self.constants.value(constant))

    @property
    def communicators(self) -> tuple:
        """The communicators this rank's step uses, with their counted buffers (planner/comms.py)."""
        from planner.comms import communicators

        if not self.on_cuda:
            return ()
        channels = self.constants["nccl_channels"]
        return communicators(self, channels.value, channels.uncertainty)

    @property
    def num_communicators(self) -> int:
        """NCCL communicators this rank's step uses (planner/comms.py; vLLM's all-reduce buffers are not ones)."""
        from planner.comms import NCCL_BUFFER_FREE

        return sum(c.name not in NCCL_BUFFER_FREE for c in self.communicators)

    @property
    def comm_bytes(self) -> int:
        """Every communicator's counted buffers, plus ``nccl_bytes_per_communicator`` (what a communicator holds
        beyond them: an estimate until `make calibrate` fits it on a GPU) per NCCL communicator; CPU: 0 (gloo)."""
        if not self.on_cuda:
            return 0
        per = self.comm_bytes_per_communicator
        if per is None:
            per = int(self.constants.value("nccl_bytes_per_communicator"))
        return sum(c.bytes for c in self.communicators) + per * self.num_communicators

    @property
    def utilization_capacity_bytes(self) -> int:
        """What the engine's ``gpu_memory_utilization`` is a fraction of."""
        if not self.on_cuda and self.engine_capacity_bytes is not None:  # both engines on CPU: cpu_capacity_gb
            return self.engine_capacity_bytes
        return self.device.total_bytes
