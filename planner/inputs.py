"""What the planner needs to know about a run: :class:`PlanInputs` (keyword-only, checked on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelspec.dtypes import DTYPE_NAMES, element_bytes
from modelspec.shape import ModelShape
from planner.devices import GIB, MIB, DeviceSpec

ENGINES = ("vllm", "native")
WAKE_STRATEGIES = ("staged", "all_at_once")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
ATTENTION = ("flash", "unfused")

# Calibration constants (defaults; each has a PlanInputs field to override it). Measured runs refine them.
CUDA_RUNTIME_OVERHEAD_BYTES = 1 * GIB  # CUDA context, cuBLAS / NCCL / vLLM kernels and workspaces per process
# CPU: what a rank's process holds beyond the project's tensors once the run is under way, over the memory
# probe's baseline (taken after imports and process-group setup): the tokenizer, megatron's and the engine's
# Python objects, gloo buffers and the allocator's slack. Measured 36-52 MiB on tiny_cpu and memory_cpu.
CPU_RUNTIME_OVERHEAD_BYTES = 48 * MIB
CUDA_MARGIN_FRACTION = 0.05  # caching-allocator fragmentation and slack, of the device total
CPU_MARGIN_FRACTION = 0.10
NCCL_BYTES_PER_COMMUNICATOR = 200 * MIB  # NCCL channel buffers of one communicator (gloo on CPU: none)
VLLM_CUDA_GRAPH_BYTES = 1 * GIB  # vLLM's captured CUDA graphs: kept while the engine sleeps
# vLLM's CPU build: what a rank holds for it beyond weights and KV cache, asleep or awake (its modules,
# imported when the engine starts, after the memory probe's baseline, and its engine core's objects).
# Measured 178 MiB per rank on memory_cpu (tiny:qwen2_memory, 2 ranks).
VLLM_CPU_RUNTIME_BYTES = 176 * MIB
VLLM_MAX_BATCHED_TOKENS = 8192  # vLLM's max_num_batched_tokens, what its profile run sizes activations for


@dataclass(frozen=True)
class MicroBatches:
    """How one pass splits a rank's sequences (the largest micro-batch)."""

    count: int  # micro-batches per pass
    sequences: int  # sequences in the largest
    model_tokens: int  # tokens the model runs on: sequences x padded length, or their real tokens packed
    response_tokens: int  # rows of the log-prob pass
    attention_span: float  # each sequence's attention length: the padded length, or (packed) its mean


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
    distributed_optimizer: bool = False  # megatron's distributed optimizer shards optimizer states over DP
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
    prompt_tokens: int = 512
    response_tokens: int = 1024
    # average lengths (None: prompt_tokens / response_tokens, every sequence as long as it may be: the
    # worst case); with remove_padding or a token budget they decide the micro-batches' real tokens
    mean_prompt_tokens: int | None = None
    mean_response_tokens: int | None = None
    # rollout engine
    engine: str = "vllm"
    rollout_tp: int = 1
    wake_strategy: str = "staged"
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    engine_capacity_bytes: int | None = None  # native engine on CPU: rollout.cpu_capacity_gb; None: device total
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    block_size: int = 16
    native_activation_reserve_bytes: int = 64 * MIB
    vllm_max_batched_tokens: int = VLLM_MAX_BATCHED_TOKENS
    native_max_batched_tokens: int | None = None  # the native engine's prefill cap (rollout.max_num_batched_tokens)
    cuda_graph_bytes: int | None = None  # None: VLLM_CUDA_GRAPH_BYTES for vLLM on CUDA, else 0
    # weight sync and device
    sync_bucket_bytes: int = 512 * MIB
    margin_fraction: float | None = None  # None: CUDA_MARGIN_FRACTION / CPU_MARGIN_FRACTION
    runtime_overhead_bytes: int | None = None  # None: CUDA_ / CPU_RUNTIME_OVERHEAD_BYTES
    comm_bytes_per_communicator: int | None = None  # None: NCCL_BYTES_PER_COMMUNICATOR on CUDA, 0 on CPU

    def __post_init__(self) -> None:
        s = self.shape
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPE_NAMES}")
        for name in ("actor_tp", "actor_pp", "actor_dp", "micro_batch_size", "sequences_per_step", "rollout_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("prompt_tokens", "response_tokens", "max_num_seqs", "block_size", "vllm_max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in (
            "max_tokens_per_micro_batch",
            "max_tokens_per_forward_micro_batch",
            "logprob_chunk_tokens",
            "recompute_num_layers",
            "mean_prompt_tokens",
            "mean_response_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1, or None")
        too_long = (self.mean_prompt_tokens or 0) > self.prompt_tokens
        if too_long or (self.mean_response_tokens or 0) > self.response_tokens:
            raise ValueError("mean_prompt_tokens / mean_response_tokens cannot exceed prompt_tokens / response_tokens")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={self.recompute_method!r} is not one of {RECOMPUTE_METHODS}")
        if not set(self.recompute_modules) <= set(RECOMPUTE_MODULES):
            raise ValueError(f"recompute_modules={self.recompute_modules} must be drawn from {RECOMPUTE_MODULES}")
        if s.num_heads % self.actor_tp or s.num_kv_heads % self.actor_tp:
            raise ValueError(
                f"actor_tp={self.actor_tp} must divide the {s.num_heads} heads and {s.num_kv_heads} KV heads; "
                "pick a common divisor"
            )
        vpp = self.actor_vpp or 1
        if s.num_layers % (self.actor_pp * vpp):
            raise ValueError(f"actor_pp x actor_vpp = {self.actor_pp}x{vpp} must divide the {s.num_layers} layers")
        if self.actor_vpp is not None and self.actor_vpp > 1 and self.actor_pp < 2:
            raise ValueError(f"actor_vpp={self.actor_vpp} needs actor_pp >= 2; set actor_vpp=None")
        if s.num_heads % self.rollout_tp or (s.num_kv_heads % self.rollout_tp and self.rollout_tp % s.num_kv_heads):
            raise ValueError(
                f"rollout_tp={self.rollout_tp} must divide the {s.num_heads} heads and divide or be a multiple "
                f"of the {s.num_kv_heads} KV heads"
            )
        if self.sequences_per_step % self.actor_dp:
            raise ValueError(
                f"sequences_per_step={self.sequences_per_step} must split evenly over actor_dp={self.actor_dp}"
            )
        for name, choices in (
            ("engine", ENGINES),
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
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.sync_bucket_bytes < 1:
            raise ValueError(f"sync_bucket_bytes={self.sync_bucket_bytes} must be >= 1")

    # ---------------------------------------------------------------- derived sizes
    @property
    def element_bytes(self) -> int:
        return element_bytes(self.dtype)

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
    def engine_max_model_len(self) -> int:
        return self.max_model_len or self.shape.max_position_embeddings

    @property
    def on_cuda(self) -> bool:
        return self.device.kind == "cuda"

    @property
    def margin_bytes(self) -> int:
        default = CUDA_MARGIN_FRACTION if self.on_cuda else CPU_MARGIN_FRACTION
        fraction = default if self.margin_fraction is None else self.margin_fraction
        return int(fraction * self.device.total_bytes)

    @property
    def runtime_bytes(self) -> int:
        if self.runtime_overhead_bytes is not None:
            return self.runtime_overhead_bytes
        return CUDA_RUNTIME_OVERHEAD_BYTES if self.on_cuda else CPU_RUNTIME_OVERHEAD_BYTES

    @property
    def engine_persistent_bytes(self) -> int:
        """What the engine keeps while it sleeps besides weights and KV cache: vLLM's CUDA graphs on CUDA
        (``cuda_graph_bytes``), its runtime on CPU; 0 for the native engine."""
        if self.engine != "vllm":
            return 0
        if not self.on_cuda:
            return VLLM_CPU_RUNTIME_BYTES
        return VLLM_CUDA_GRAPH_BYTES if self.cuda_graph_bytes is None else self.cuda_graph_bytes

    @property
    def num_communicators(self) -> int:
        """Process groups of more than one rank that this rank joins: actor TP, PP, DP, engine TP, world."""
        world = self.actor_tp * self.actor_pp * self.actor_dp
        return sum(size > 1 for size in (self.actor_tp, self.actor_pp, self.actor_dp, self.rollout_tp, world))

    @property
    def comm_bytes(self) -> int:
        per = self.comm_bytes_per_communicator
        if per is None:
            per = NCCL_BYTES_PER_COMMUNICATOR if self.on_cuda else 0
        return per * self.num_communicators

    @property
    def utilization_capacity_bytes(self) -> int:
        """What the engine's ``gpu_memory_utilization`` is a fraction of."""
        if not self.on_cuda and self.engine_capacity_bytes is not None:  # both engines on CPU: cpu_capacity_gb
            return self.engine_capacity_bytes
        return self.device.total_bytes
