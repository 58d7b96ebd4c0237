"""What the planner needs to know about a run: :class:`PlanInputs` (keyword-only, checked on construction)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from colocation.engines import EngineProfile
from configs import ActorConfig, RolloutConfig
from configs.rollout import MIN_KV_CACHE_BYTES
from modelspec.dtypes import element_bytes
from modelspec.mesh import check_actor_split, check_rollout_experts, check_rollout_split, uses_sequence_parallel
from modelspec.shape import ModelShape
from planner.calibration import Calibration, load
from planner.devices import GIB, MIB, DeviceSpec

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
    padded_tokens: int  # sequences x the longest: the rows megatron_backend.model's packed attention pads them to


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
    # the layer the step's weight-sync reference check sampled (weight_sync/reference.py; weight_sync/reference_layer):
    # -1 none this step; None not recorded (the plan counts the largest check)
    reference_layer: int | None = None


@dataclass(frozen=True)
class ReferenceSample:
    """What one weight-sync reference check gathers (weight_sync/reference.py, check k samples layer k mod L and,
    with k mod L = 0, the vocab tensors and the final norm), in elements, counted by run/memory_plan.py from the
    pieces megatron_backend/checkpoint.py::gather_hf_tensors sends."""

    own: tuple[int, ...]  # per actor pipeline stage, the most one of its ranks sends (its blocks' clones)
    largest: int  # the most any rank sends (all_gather_object pads every rank's bytes to it)
    gathered: int  # what every rank sends, summed: each rank unpickles all of it
    full: int  # the sampled HF tensors, assembled whole on every rank
    ranks: int  # the world the check all-gathers over


@dataclass(frozen=True)
class SyncTraffic:
    """What the weight sync moves on the busiest rank of one actor pipeline stage (run/memory_plan.py, from the
    plan weight_sync/transfers.py makes): bytes it copies from its own actor shard, sends to and receives from other
    ranks, and the slices ``weight_sync.verify`` checksums on it (a local transfer's twice: sent and held)."""

    local_bytes: int
    sent_bytes: int
    received_bytes: int
    checksums: int
    # of the sent and received bytes, those packed into staging buffers (weight_sync/execute.py: neither local nor
    # a direct row slice): a fresh buffer each, copied in from the shard or out into the engine's tensor
    staged_sent_bytes: int = 0
    staged_received_bytes: int = 0

    @property
    def crossing_bytes(self) -> int:
        """What crosses the link one way: the larger of its sends and its receives (links are full duplex)."""
        return max(self.sent_bytes, self.received_bytes)


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """One rank's view of a run: the actor's and the engine's configs as the run reads them (``actor``,
    ``rollout``: configs/), and what is derived for the run (the model's shape, the device, the lengths, the batch,
    the flags of other components, the weight sync's plan, the calibration).

    The engine's KV cache comes from ``rollout.kv_cache_bytes`` when set, else ``rollout.gpu_memory_utilization``
    under the engine's meaning (vLLM: the fraction of the device's total memory for weights + KV cache + reserve;
    native: the same, of ``rollout.cpu_capacity_gb`` on CPU), else (``auto``) the largest KV cache that fits.
    The configs check their own fields; here only what pairs them with the model, the device and the batch.
    """

    shape: ModelShape
    device: DeviceSpec
    dtype: str = "bfloat16"  # model.dtype
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor_dp: int = 1  # the world over actor TP x PP (RunConfig.dp)
    # megatron's distributed optimizer shards optimizer states over DP (megatron_backend.actor_train: DP > 1, or
    # actor.optimizer_offload_fraction > 0, since megatron wires its HybridDeviceOptimizer into it only)
    distributed_optimizer: bool = False
    entropy_grad: bool = False  # an entropy term in the loss (algorithm.entropy_coef > 0)
    ppo_epochs: int = 1  # train passes and optimizer steps per RL step on the same rollouts (trainer.ppo_epochs)
    attention: str = "flash"  # "unfused": megatron's local spec (CPU) materializes [s, s] scores
    reference_model: bool = False  # a frozen reference actor (algorithm.kl_coef > 0)
    # batch: every rank sees sequences_per_step / actor_dp sequences of prompt + response tokens
    sequences_per_step: int = 1
    # the eval batch at the step boundaries that evaluate: every eval problem x eval.n_samples (0: no eval)
    eval_sequences: int = 0
    # the run writes HF exports (trainer.export_every > 0 or trainer.export_at_end): the export_hf phase is planned
    hf_exports: bool = False
    prompt_tokens: int = 512
    response_tokens: int = 1024  # at most rollout.max_new_tokens, which sizes the native engine's per-row tables
    # average lengths (None: prompt_tokens / response_tokens, every sequence as long as it may be: the
    # worst case); with remove_padding or a token budget they decide the micro-batches' real tokens
    mean_prompt_tokens: int | None = None
    mean_response_tokens: int | None = None
    # MoE: the routed copies an EP rank's experts receive, as a multiple of balanced routing's (N k for N tokens); the
    # launch plan assumes balanced routing (1.0) or the capacity factor's bound, the plan at a step's recorded values
    # the step's (at_lengths); planner.report.routing_headroom says how far above it the plan still fits
    routed_copies_ratio: float = 1.0
    cuda_graph_bytes: int | None = None  # None: the calibration's vllm_cuda_graph_bytes for vLLM on CUDA
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
    sync_bucket_bytes: int = 512 * MIB  # weight_sync.bucket_mb
    # per actor pipeline stage, the most bytes one of its ranks stages in one bucket of the weight sync: the sync
    # plan's packed part (weight_sync.transfers.SyncPlan.max_staged_bytes, computed from both sides' layouts by
    # run/memory_plan.py). None: not computed; planned as the bucket's bound (planner/plan.py::sync_staging_bytes)
    sync_staged_bytes: tuple[int, ...] | None = None
    # per actor pipeline stage, the sync's local and crossing bytes (the same plan); None: the bound
    # (planner/step_time.py::weight_sync_work)
    sync_traffic: tuple[SyncTraffic, ...] | None = None
    verify_sync: bool = False  # weight_sync.verify: int64 checksums of every slice after each sync
    # weight_sync.check_every > 0: per layer k, what check k gathers (run/memory_plan.py::reference_samples); None or
    # () (check_every=0): no reference check. The plan counts the largest, or the one of ``reference_layer``
    reference_check: tuple[ReferenceSample, ...] | None = None
    reference_layer: int | None = None  # a step's recorded check (StepLengths.reference_layer); None: the largest
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
        s, actor, rollout = self.shape, self.actor, self.rollout
        for name in ("actor_dp", "ppo_epochs", "sequences_per_step", "prompt_tokens", "response_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if actor.optimizer_offload_fraction and not (self.distributed_optimizer and self.on_cuda):
            raise ValueError("actor.optimizer_offload_fraction > 0 needs megatron's distributed optimizer on CUDA")
        if self.routing_replay and not self.routed_experts:
            raise ValueError("routing_replay=True needs routed_experts=True: it replays the routing the engine returns")
        if self.ranks_per_node < 1 or self.data_host_bytes < 0:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1, data_host_bytes >= 0")
        for name in ("mean_prompt_tokens", "mean_response_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1, or None")
        if not self.routed_copies_ratio > 0:
            raise ValueError(f"routed_copies_ratio={self.routed_copies_ratio} must be > 0 (1: balanced routing)")
        if rollout.max_new_tokens < self.response_tokens:
            raise ValueError(
                f"rollout.max_new_tokens={rollout.max_new_tokens} is below response_tokens={self.response_tokens}: no "
                "response is longer than the engine's max_tokens; raise rollout.max_new_tokens"
            )
        too_long = (self.mean_prompt_tokens or 0) > self.prompt_tokens
        if too_long or (self.mean_response_tokens or 0) > self.response_tokens:
            raise ValueError("mean_prompt_tokens / mean_response_tokens cannot exceed prompt_tokens / response_tokens")
        # the layouts against the model (modelspec.mesh: the one home of these rules, RunConfig calls it too)
        check_actor_split(s, actor.tp, actor.pp, actor.vpp)
        if (actor.ep > 1 or actor.etp is not None) and not s.num_experts:
            raise ValueError(f"actor.ep={actor.ep} / actor.etp={actor.etp} need an MoE model; set 1 / null")
        if s.num_experts and s.num_experts % actor.ep:
            raise ValueError(f"actor.ep={actor.ep} must divide the model's {s.num_experts} experts")
        if s.num_experts and s.moe_intermediate_size % actor.expert_tp:
            raise ValueError(f"actor.etp={actor.expert_tp} must divide moe_intermediate_size={s.moe_intermediate_size}")
        if (actor.tp * self.actor_dp) % (actor.ep * actor.expert_tp):
            raise ValueError(
                f"actor.ep={actor.ep} x expert TP {actor.expert_tp} must divide actor.tp x actor_dp ="
                f" {actor.tp * self.actor_dp} (megatron carves expert parallel out of TP x DP)"
            )
        check_rollout_split(s, rollout.tp)
        check_rollout_experts(s, rollout.ep)
        world = actor.tp * actor.pp * self.actor_dp
        if rollout.profile.experts_span_replicas and rollout.ep not in (1, world):
            raise ValueError(
                f"rollout.ep={rollout.ep}: {rollout.engine}'s expert parallel spans every engine rank; set 1 or {world}"
            )
        if self.eval_sequences < 0:
            raise ValueError(f"eval_sequences={self.eval_sequences} must be >= 0 (0: the run does not evaluate)")
        if self.sequences_per_step % self.actor_dp:
            raise ValueError(
                f"sequences_per_step={self.sequences_per_step} must split evenly over actor_dp={self.actor_dp}"
            )
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not one of {ATTENTION}")
        if self.margin_fraction is not None and not 0.0 <= self.margin_fraction < 1.0:
            raise ValueError(f"margin_fraction={self.margin_fraction} must be in [0, 1)")
        if self.sync_bucket_bytes < 1:
            raise ValueError(f"sync_bucket_bytes={self.sync_bucket_bytes} must be >= 1")
        staged = self.sync_staged_bytes
        if staged is not None and (len(staged) != actor.pp or min(staged) < 0):
            raise ValueError(f"sync_staged_bytes={staged} must give actor.pp={actor.pp} byte counts >= 0")
        traffic = self.sync_traffic
        if traffic is not None and (
            len(traffic) != actor.pp
            or min(min(t.local_bytes, t.sent_bytes, t.received_bytes, t.checksums) for t in traffic) < 0
        ):
            raise ValueError(f"sync_traffic={traffic} must give actor.pp={actor.pp} stages of byte counts >= 0")

    def with_actor(self, **changes) -> PlanInputs:
        """These inputs with ``actor.<name>=value`` for each change (the config checks them again)."""
        return dataclasses.replace(self, actor=dataclasses.replace(self.actor, **changes))

    def with_rollout(self, **changes) -> PlanInputs:
        """These inputs with ``rollout.<name>=value`` for each change (the config checks them again)."""
        return dataclasses.replace(self, rollout=dataclasses.replace(self.rollout, **changes))

    def with_offload(self, **changes) -> PlanInputs:
        """These inputs with ``actor.offload.<name>=value`` for each change."""
        return self.with_actor(offload=dataclasses.replace(self.actor.offload, **changes))

    # ---------------------------------------------------------------- derived sizes
    @property
    def element_bytes(self) -> int:
        return element_bytes(self.dtype)

    @property
    def expert_tp(self) -> int:
        """Expert TP: actor_etp, else actor_tp (megatron's expert_tensor_parallel_size default)."""
        return self.actor.etp or self.actor.tp

    @property
    def sequence_parallel_on(self) -> bool:
        """Whether the actor runs megatron's sequence parallelism (modelspec.mesh.uses_sequence_parallel)."""
        return uses_sequence_parallel(self.actor.sequence_parallel, self.actor.tp, self.shape.is_moe)

    @property
    def sequence_parallel_split(self) -> int:
        """What the sequence-parallel region's per-token tensors are divided by: TP under it, else 1."""
        return self.actor.tp if self.sequence_parallel_on else 1

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel group's size (megatron: TP x DP = expert TP x EP x expert DP per stage)."""
        return self.actor.tp * self.actor_dp // (self.actor.ep * self.expert_tp)

    @property
    def world_size(self) -> int:
        """The ranks of the run (the actor's TP x PP x DP; the engine's ranks are the same processes)."""
        return self.actor.tp * self.actor.pp * self.actor_dp

    @property
    def engine_expert_split(self) -> tuple[int, int]:
        """(rollout EP, expert TP) of one engine rank's routed experts: E / rollout_ep experts, m / expert TP rows
        of each; an engine whose experts span its replicas (vLLM) splits every expert over all its ranks."""
        world = self.world_size
        if self.engine_profile.experts_span_replicas:  # rollout/layout.py engine_expert_split
            return (world, 1) if self.rollout.ep > 1 else (1, world)
        return self.rollout.ep, self.rollout.tp

    @property
    def engine_moe_gathered_replicas(self) -> int:
        """Replicas whose tokens an engine rank's MoE layers run on: vLLM's MoE layers span its data-parallel
        replicas and all-gather their tokens (sizes.engine_moe_bytes_per_token); 1 otherwise."""
        replicas = self.actor.tp * self.actor.pp * self.actor_dp // self.rollout.tp
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
        # a cache under the least a run may set (rollout.kv_cache_bytes >= 1 MiB, a guard against MB written for
        # bytes) is one the sizing rule capped at max_num_seqs x max_model_len tokens, which no recorded length
        # changes: the rule sizes the same cache again
        fixed = self.with_rollout(kv_cache_bytes=kv_cache_bytes) if kv_cache_bytes >= MIN_KV_CACHE_BYTES else self
        return dataclasses.replace(
            fixed,
            prompt_tokens=prompt,
            response_tokens=response,
            routed_copies_ratio=lengths.routed_copies_ratio,
            reference_layer=lengths.reference_layer,
            mean_prompt_tokens=max(1, min(prompt, round(lengths.mean_prompt))),
            mean_response_tokens=max(1, min(response, round(lengths.mean_response))),
        )

    def micro_batches(self, train: bool) -> MicroBatches:
        """The micro-batches of a train (or forward-only) pass, as megatron_backend.packing forms them."""
        n = self.sequences_per_rank
        budget = self.actor.max_tokens_per_micro_batch if train else self.actor.forward_max_tokens
        per_seq = self.mean_seq_tokens if self.actor.remove_padding else self.seq_len
        if budget is None:
            count = max(1, n // self.actor.micro_batch_size)
        elif self.actor.remove_padding:  # balanced bins of real tokens
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
            padded_tokens=sequences * self.seq_len,
        )

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV-cache block: ``rollout.block_size``, else the engine's default on this device."""
        return self.rollout.block_size_on(self.device.kind)

    @property
    def engine_profile(self) -> EngineProfile:
        """The engine's memory behaviour (``colocation.engines``): what the plan asks instead of its name."""
        return self.rollout.profile

    @property
    def recompute_modules(self) -> tuple[str, ...]:
        """What selective recompute recomputes: ``actor.recompute_modules``, else megatron's default."""
        return tuple(self.actor.recompute_modules or ("core_attn",))

    @property
    def native_activation_reserve_bytes(self) -> int:
        return self.rollout.activation_reserve_mb * MIB

    @property
    def vllm_batched_tokens(self) -> int:
        """vLLM's ``max_num_batched_tokens``: the configured one, else vLLM's own default for this device."""
        if self.rollout.max_num_batched_tokens is not None:
            return self.rollout.max_num_batched_tokens
        return vllm_default_max_num_batched_tokens(
            self.device, self.rollout.tp, self.rollout.max_num_seqs, self.engine_max_model_len
        )

    @property
    def engine_max_model_len(self) -> int:
        return self.rollout.max_model_len or self.shape.max_position_embeddings

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
        # import cycle: planner.comms imports this module at its top
        from planner.comms import communicators

        if not self.on_cuda:
            return ()
        channels = self.constants["nccl_channels"]
        return communicators(self, channels.value, channels.uncertainty)

    @property
    def num_communicators(self) -> int:
        """NCCL communicators this rank's step uses (planner/comms.py; vLLM's all-reduce buffers are not ones)."""
        # import cycle: planner.comms imports this module at its top
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
        if not self.on_cuda:  # both engines on CPU: rollout.cpu_capacity_gb
            return int(self.rollout.cpu_capacity_gb * GIB)
        return self.device.total_bytes
