"""Each rollout engine's memory behaviour, as data: the one engine list.

The planner (which may not import ``rollout``), the config, preflight and the engines themselves ask an
:class:`EngineProfile` instead of branching on the engine's name. Adding an engine: one entry in
:data:`ENGINE_PROFILES`, its class in ``rollout/`` and a branch in ``rollout.make_engine``.

The KV-cache sizing rule lives here once (:meth:`EngineProfile.kv_cache_bytes` and its inverse
:meth:`EngineProfile.utilization`): a ``gpu_memory_utilization`` of a capacity, less the engine's weights
and reserve. Which capacity and which reserve is the profile's: an engine that profiles its activation
peak at start-up (vLLM on CUDA) reserves that peak out of the device's total; the others (the native
engine anywhere, vLLM's CPU build, which this project hands the native engine's budget) keep
``rollout.activation_reserve_mb`` free out of ``rollout.cpu_capacity_gb`` on CPU, the device's total on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """What the planner, preflight and the config need to know about one engine's memory."""

    name: str
    # the package it needs beyond this repository (preflight checks that it imports); None: nothing more
    package: str | None = None
    # KV-cache tokens per block when rollout.block_size is null, per device kind
    default_block_sizes: dict[str, int] = field(default_factory=lambda: {"cpu": 16, "cuda": 16})
    # device kinds on which the engine profiles its activation peak at start-up and keeps it (with its
    # runtime reserve) out of the KV cache; elsewhere it runs eager ops on the batch it is given
    profiles_activations_on: tuple[str, ...] = ()
    # device kind -> the calibration constant (planner/calibration/<kind>.json) of what the engine keeps
    # while it sleeps besides its weights and KV cache (CUDA graphs, a runtime); absent: nothing
    runtime_reserve_constants: dict[str, str] = field(default_factory=dict)
    # whether engine_sleep releases its weights and KV cache (tagged sleep/wake)
    sleeps: bool = True
    # device kinds on which a weight sync materializes the layers' unprocessed weights beside the repacked
    # ones until the engine repacks them again (vLLM's CPU layerwise reload: one more copy of the weights)
    repacks_weights_on: tuple[str, ...] = ()
    # whether the engine allocates no more KV cache than max_num_seqs full-length sequences can use
    caps_kv_cache_at_max_num_seqs: bool = False
    # device kind -> [seqs, V] fp32 tensors its sampler holds at once (temperature sampling, log-probs of the
    # sampled tokens), as the device's allocator sees them
    sampler_vocab_tensors: dict[str, int] = field(default_factory=lambda: {"cpu": 4, "cuda": 4})
    # MoE: whether its experts split over every engine rank of every replica (vLLM flattens TP across DP in its
    # MoE layers, rollout/layout.py) rather than within each replica
    experts_span_replicas: bool = False
    # device kinds on which it runs an MoE model with more than one engine replica, and why not elsewhere
    moe_replicas_on: tuple[str, ...] = ("cpu", "cuda")
    moe_replicas_refused_because: str = ""

    def __post_init__(self) -> None:
        kinds = (
            *self.default_block_sizes,
            *self.profiles_activations_on,
            *self.runtime_reserve_constants,
            *self.sampler_vocab_tensors,
        )
        for kind in kinds:
            if kind not in DEVICE_KINDS:
                raise ValueError(f"engine {self.name}: device kind {kind!r} is not one of {DEVICE_KINDS}")

    def check_moe_replicas(self, device_kind: str, num_replicas: int, is_moe: bool) -> None:
        """ValueError (one line) when this engine cannot run an MoE model as ``num_replicas`` replicas here."""
        if is_moe and num_replicas > 1 and device_kind not in self.moe_replicas_on:
            raise ValueError(
                f"rollout.engine={self.name} on {device_kind} cannot run an MoE model as {num_replicas} engine "
                f"replicas: {self.moe_replicas_refused_because}; set rollout.tp to the world size (one replica) "
                "or use rollout.engine=native"
            )

    def default_block_size(self, device_kind: str) -> int:
        return self.default_block_sizes[device_kind]

    def profiles_activations(self, device_kind: str) -> bool:
        return device_kind in self.profiles_activations_on

    def repacks_weights(self, device_kind: str) -> bool:
        return device_kind in self.repacks_weights_on

    def sampler_tensors(self, device_kind: str) -> int:
        return self.sampler_vocab_tensors[device_kind]

    def runtime_reserve_constant(self, device_kind: str) -> str | None:
        return self.runtime_reserve_constants.get(device_kind)

    def _capacity_and_reserve(self, sizing: KvSizing) -> tuple[int, int]:
        if not self.profiles_activations(sizing.device_kind):
            return sizing.capacity_bytes, sizing.activation_reserve_bytes
        if sizing.profiled_reserve_bytes is None:
            raise ValueError(f"{self.name} on {sizing.device_kind} sizes its KV cache after profiling its activations")
        return sizing.device_total_bytes, sizing.profiled_reserve_bytes

    def kv_cache_bytes(self, utilization: float, sizing: KvSizing) -> int:
        """The KV cache ``utilization`` gives this engine: ``utilization x capacity - weights - reserve``
        (capacity: ``sizing.capacity_bytes``, i.e. ``rollout.cpu_capacity_gb`` on CPU and the device's total on
        CUDA, or the device's total when the engine profiles; reserve: the activation reserve, or the profiled
        one)."""
        capacity, reserve = self._capacity_and_reserve(sizing)
        return int(utilization * capacity) - sizing.weight_bytes - reserve

    def utilization(self, kv_cache_bytes: int, sizing: KvSizing) -> float:
        """The ``gpu_memory_utilization`` under which :meth:`kv_cache_bytes` gives ``kv_cache_bytes``."""
        capacity, reserve = self._capacity_and_reserve(sizing)
        return (sizing.weight_bytes + kv_cache_bytes + reserve) / capacity


@dataclass(frozen=True, kw_only=True)
class KvSizing:
    """What the KV sizing rule takes: the device, the capacity a utilization is a fraction of, the engine's
    weights and the two reserves (the profiled one only where the engine profiles its activations)."""

    device_kind: str
    device_total_bytes: int
    capacity_bytes: int  # rollout.cpu_capacity_gb on CPU, the device's total memory on CUDA
    weight_bytes: int
    activation_reserve_bytes: int  # rollout.activation_reserve_mb
    profiled_reserve_bytes: int | None = None  # runtime + profiled activation peak


ENGINE_PROFILES: dict[str, EngineProfile] = {
    profile.name: profile
    for profile in (
        # plain torch (rollout/native/): eager everywhere, sizes its KV cache itself and never past what
        # max_num_seqs sequences of max_model_len can use
        # its sampler (rollout/native/sampling.py) at the draw: the logits, the probabilities and
        # torch.multinomial's exponential draws (one sample: argmax(p / q), q ~ Exp(1), aten Distributions.cpp);
        # the temperature-scaled copy is freed before the draw, but on CPU glibc does not hand its block to the
        # draws (posix_memalign asks for more than the exact-size block freed; measured: 4 units in RSS, 3 with
        # MALLOC_MMAP_THRESHOLD_ fixed), CUDA's caching allocator does
        EngineProfile(name="native", caps_kv_cache_at_max_num_seqs=True, sampler_vocab_tensors={"cpu": 4, "cuda": 3}),
        # vLLM 0.32 (rollout/vllm_engine.py): CacheConfig.DEFAULT_BLOCK_SIZE 16, 128 on its CPU platform (CPU
        # attention wants multiples of 32); profiles its peak on CUDA; CUDA graphs on CUDA, its runtime on CPU
        EngineProfile(
            name="vllm",
            package="vllm",
            default_block_sizes={"cpu": 128, "cuda": 16},
            profiles_activations_on=("cuda",),
            runtime_reserve_constants={"cuda": "vllm_cuda_graph_bytes", "cpu": "vllm_runtime_bytes"},
            repacks_weights_on=("cpu",),
            # vllm/v1/sample/sampler.py with logprobs requested: the logits, their raw log_softmax (kept to
            # gather the sampled token's), the probabilities and the exponential draws (topk_topp_sampler.py)
            sampler_vocab_tensors={"cpu": 4, "cuda": 4},
            experts_span_replicas=True,
            # several replicas run FusedMoE data parallel: its naive dispatch all-gathers the replicas' tokens
            # (all2all.py AgRsAll2AllManager.dispatch -> all_gatherv), which vLLM's CPU communicator lacks
            moe_replicas_on=("cuda",),
            moe_replicas_refused_because=(
                "vLLM's CPU build has no all_gatherv / reduce_scatterv in its CPU communicator, which its "
                "data-parallel MoE layers need (NotImplementedError at the first forward)"
            ),
        ),
    )
}
ENGINES = tuple(ENGINE_PROFILES)


def engine_profile(engine: str) -> EngineProfile:
    """The profile of ``engine`` (``rollout.engine``); ValueError naming the key and the choices."""
    if engine not in ENGINE_PROFILES:
        raise ValueError(f"rollout.engine={engine!r} is not one of {ENGINES}")
    return ENGINE_PROFILES[engine]
