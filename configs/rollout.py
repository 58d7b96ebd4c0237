"""Config of the rollout engine (``rollout.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from colocation.engines import EngineProfile, KvSizing, engine_profile
from colocation.phases import WAKE_STRATEGIES, engine_wakes

AUTO = "auto"  # rollout.gpu_memory_utilization=auto: the planner picks the KV cache

# Which memory tags the engine takes back at which wake phase of the step, per ``rollout.wake_strategy``: the
# wake phases' adds in the step's table (colocation/phases.py). staged wakes the weights, lets the sync write them
# and the actor offload its params, and only then takes the KV cache, so the actor's params and the KV cache are
# never resident together.
WAKE_TAGS: dict[str, dict[str, tuple[str, ...]]] = {s: engine_wakes(s) for s in WAKE_STRATEGIES}
MEMORY_SAVERS = ("auto", "portable", "torch_memory_saver")
MIN_KV_CACHE_BYTES = 2**20  # the least rollout.kv_cache_bytes a run may set


# Why an engine cannot return each completion's routed experts (SamplingParams.return_routed_experts), per
# (engine, device kind); any other pair can. vLLM 0.32's enable_return_routed_experts needs Model Runner V2 and
# prefix caching (vllm/config/vllm.py, _verify_aux_output_compatibility); its CPU build runs V2 only with
# Triton's CPU backend, which it does not have (docs/DESIGN.md, "Routing replay").
ROUTED_EXPERTS_UNSUPPORTED = {
    ("vllm", "cpu"): (
        "cannot return routed experts on vLLM's CPU build (enable_return_routed_experts needs Model Runner V2, "
        "which needs Triton's CPU backend); use rollout.engine=native on CPU"
    ),
}


def routed_experts_unsupported(engine: str, device_kind: str) -> str | None:
    """Why ``rollout.engine=engine`` on ``device_kind`` ("cpu" / "cuda") cannot return routed experts (one
    line), or None when it can."""
    return ROUTED_EXPERTS_UNSUPPORTED.get((engine, device_kind))


@dataclass
class RolloutConfig:
    """Engine choice, its TP layout, memory budget and sampling (``rollout.*``)."""

    engine: str = "native"
    tp: int = 1
    # MoE: engine expert parallelism, native engine: a replica is tp x ep ranks, each EP rank holding E / ep
    # whole experts (m / tp rows of each) and running attention as its TP peers do; the MoE output is one
    # all-reduce over the replica. vLLM: refused (see __post_init__).
    ep: int = 1
    # float in (0, 1]: fraction of device memory the engine may hold (weights + KV cache + reserve);
    # "auto" (AUTO): the planner picks the KV cache (run.memory_plan.choose_kv_cache, the one place that resolves it).
    gpu_memory_utilization: float | int | str = 0.5  # composed as written (1, 0.5, auto); a float or AUTO after checks
    wake_strategy: str = "staged"
    # On CPU there is no device capacity to read; the native engine sizes its KV cache from this.
    cpu_capacity_gb: float = 2.0
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # True: every sample runs to max_new_tokens (the checkpoint's EOS does not stop it): the plan's worst case,
    # for benchmarks and the planner's validation runs
    ignore_eos: bool = False
    # Tokens per KV-cache block (None: the engine's default, its profile's in colocation.engines: 16, but 128 for
    # vLLM's CPU build, whose attention wants multiples of 32); most sequences one batch may run; longest prompt +
    # response (None: the checkpoint's max_position_embeddings); bytes kept free for activations when sizing
    # the native engine's KV cache. vLLM gets block_size, max_num_seqs, max_num_batched_tokens, max_model_len.
    block_size: int | None = None
    max_num_seqs: int = 256
    # Most tokens one engine step runs (the rollout-phase activation bound). vLLM: EngineArgs'
    # ``max_num_batched_tokens`` (chunked prefill splits longer prompts; null = vLLM's default). Native:
    # the prompt tokens one prefill batch may hold (admission stops there; a longer prompt is prefilled
    # alone: no chunked prefill), null = no cap.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    activation_reserve_mb: int = 64
    # Memory-saver backend for tagged sleep/wake: "auto" (torch-memory-saver on CUDA when installed, else
    # portable), "portable" (release storages, re-allocate on resume), "torch_memory_saver".
    memory_saver: str = "auto"
    # vLLM sleep level: 1 keeps a host copy of the weights, 2 drops them (RL re-syncs weights after wake).
    # (On CPU a host copy IS the weights: level 1 keeps them resident, level 2 releases them.)
    sleep_level: int = 2
    # KV-cache bytes per rank (vLLM's kv_cache_memory_bytes): wins over gpu_memory_utilization when set, so an
    # engine upgrade cannot change the cache at the same fraction. None: sized from gpu_memory_utilization
    # (of the device's total on CUDA, of cpu_capacity_gb on CPU); with "auto" the planner picks it (run/memory_plan.py).
    kv_cache_bytes: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        engine_profile(self.engine)  # ValueError naming the engines there are
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"rollout.tp={self.tp!r} must be a positive integer")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"rollout.ep={self.ep!r} must be a positive integer")
        # vLLM's EP spans every engine rank (ColocatedMesh checks rollout.ep = world); only the native engine's
        # EP replica lacks a TP subgroup
        if self.ep > 1 and self.tp > 1 and not self.profile.experts_span_replicas:
            raise ValueError(
                f"rollout.ep={self.ep} with rollout.tp={self.tp}: the native engine's expert parallel runs with "
                "rollout.tp=1 only (no TP subgroup inside an expert-parallel replica yet); set rollout.tp=1"
            )
        util = self.gpu_memory_utilization
        if util != AUTO:
            try:
                util = float(util)
            except (TypeError, ValueError):
                raise ValueError(
                    f"rollout.gpu_memory_utilization={util!r} must be a float in (0, 1] or 'auto'"
                ) from None
            if not 0.0 < util <= 1.0:
                raise ValueError(
                    f"rollout.gpu_memory_utilization={util} is outside (0, 1]; use e.g. 0.5, or 'auto' "
                    "to let the planner pick"
                )
            self.gpu_memory_utilization = util
        if self.wake_strategy not in WAKE_STRATEGIES:
            raise ValueError(f"rollout.wake_strategy={self.wake_strategy!r} is not one of {WAKE_STRATEGIES}")
        if self.cpu_capacity_gb <= 0:
            raise ValueError(f"rollout.cpu_capacity_gb={self.cpu_capacity_gb} must be > 0")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"rollout.n_samples_per_prompt={self.n_samples_per_prompt} must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k={self.top_k} must be -1 (off) or >= 1")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"rollout.block_size={self.block_size} must be a power of two, e.g. 16")
        if self.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} must be >= rollout.max_num_seqs="
                f"{self.max_num_seqs} (every running sequence decodes one token per step); raise it or set it to null"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"rollout.max_model_len={self.max_model_len} must be >= 2 or null (from the checkpoint)")
        if self.activation_reserve_mb < 0:
            raise ValueError(f"rollout.activation_reserve_mb={self.activation_reserve_mb} must be >= 0")
        if self.memory_saver not in MEMORY_SAVERS:
            raise ValueError(f"rollout.memory_saver={self.memory_saver!r} is not one of {MEMORY_SAVERS}")
        if self.kv_cache_bytes is not None and (
            not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < MIN_KV_CACHE_BYTES
        ):
            raise ValueError(
                f"rollout.kv_cache_bytes={self.kv_cache_bytes!r} must be an integer >= 1048576 (1 MiB), or null to "
                "size it from rollout.gpu_memory_utilization"
            )
        if self.sleep_level not in (1, 2):
            raise ValueError(
                f"rollout.sleep_level={self.sleep_level} must be 1 (keep a host copy of weights) or 2 (drop them)"
            )

    @property
    def utilization(self) -> float | None:
        """``gpu_memory_utilization`` as a fraction, or None for ``auto`` (the planner's convention)."""
        return None if self.gpu_memory_utilization == AUTO else float(self.gpu_memory_utilization)

    @property
    def planner_sizes_kv_cache(self) -> bool:
        """``auto`` without ``kv_cache_bytes``: the plan picks the KV cache (``run.memory_plan.choose_kv_cache``)."""
        return self.utilization is None and self.kv_cache_bytes is None

    @property
    def profile(self) -> EngineProfile:
        """This engine's memory behaviour (``colocation.engines``)."""
        return engine_profile(self.engine)

    def kv_cache_budget_bytes(self, device_kind: str, capacity_bytes: int, weight_bytes: int) -> int:
        """Bytes the KV cache may take: ``kv_cache_bytes`` when set, else the engine's sizing rule
        (``EngineProfile.kv_cache_bytes``: utilization x capacity - weights - activation reserve; capacity: the
        device's total memory, or ``cpu_capacity_gb`` on CPU)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        util = self.utilization
        if util is None:
            raise ValueError(
                "rollout.gpu_memory_utilization='auto' must be resolved by the planner before the engine starts"
            )
        sizing = KvSizing(
            device_kind=device_kind,
            device_total_bytes=capacity_bytes,
            capacity_bytes=capacity_bytes,
            weight_bytes=weight_bytes,
            activation_reserve_bytes=self.activation_reserve_mb * 2**20,
        )
        return self.profile.kv_cache_bytes(util, sizing)

    def block_size_on(self, device_kind: str) -> int:
        """Tokens per KV-cache block: ``block_size``, else the engine's default on ``device_kind``."""
        return self.block_size or self.profile.default_block_size(device_kind)
