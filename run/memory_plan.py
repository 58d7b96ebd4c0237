"""A composed :class:`~run.config.RunConfig` as the memory planner's inputs: the one place that knows both.

``make plan`` (tools/plan.py) prints the plan; ``make run`` prints it too when this machine lacks the
experiment's devices (run/main.py); ``make sweep`` / ``make sweep-local`` check every grid point with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

from modelspec.family import HF_LAYER, hf_tensor_shapes
from modelspec.tiny import TINY_PREFIX, build_tokenizer
from planner import Plan, PlanInputs, device_preset, make_plan
from planner.devices import MIB
from planner.inputs import ReferenceSample, SyncTraffic
from planner.report import verdict
from planner.sizes import capacity_routed_copies_ratio
from rl.data import DataConfig, longest_prompt_tokens
from rl.evaluation import eval_problems
from run.compose import resolve_path
from weight_sync.layouts import actor_sources, engine_destinations
from weight_sync.transfers import SyncPlan, is_direct, plan_sync

# Prompts are data, not config: without rollout.max_model_len (which bounds prompt + response) plan for this
# many prompt tokens (at most the checkpoint's max_position_embeddings - max_new_tokens).
DEFAULT_PROMPT_TOKENS = 512


def plan_inputs(
    cfg, prompt_tokens: int | None = None, calibration=None, launch_runtime_bytes: int | None = None
) -> PlanInputs:
    """A composed RunConfig -> the planner's inputs for one rank (adapt here when run/config.py changes).

    ``calibration``: a :class:`planner.calibration.Calibration` (None: the device kind's file).
    ``launch_runtime_bytes``: the runtime level the run measured at launch (run/setup.py::plan_and_build_engine; None:
    not launched, the fitted level)."""
    rollout, actor = cfg.rollout, cfg.actor
    host_gib = cfg.cluster.host_memory_gib
    device = device_preset(
        cfg.cluster.device, cfg.cluster.procs_per_node, None if host_gib is None else int(host_gib * 2**30)
    )
    on_cuda = device.kind == "cuda"
    shape = cfg.model.shape()  # model.path's config.json, else model.architecture
    if prompt_tokens is None:
        # the engine's max_model_len bounds prompt + response
        longest = rollout.max_model_len or shape.max_position_embeddings
        prompt_tokens = longest - rollout.max_new_tokens
        if not rollout.max_model_len:
            prompt_tokens = min(DEFAULT_PROMPT_TOKENS, prompt_tokens)
    # the engine ends a row at its max_model_len (native: rollout/native/scheduler.py; vLLM: finish reason "length")
    max_len = rollout.max_model_len or shape.max_position_embeddings
    response_tokens = max(1, min(rollout.max_new_tokens, max_len - max(1, prompt_tokens)))
    inputs = PlanInputs(
        shape=shape,
        device=device,
        dtype=cfg.model.dtype,
        actor=actor,
        rollout=rollout,
        actor_dp=cfg.dp,
        # megatron_backend.actor_train: megatron-core's optimizer on every device, its DistributedOptimizer when DP > 1
        # or when it offloads (megatron wires its HybridDeviceOptimizer into the distributed optimizer only)
        distributed_optimizer=cfg.dp > 1 or actor.optimizer_offload_fraction > 0,
        reference_model=cfg.algorithm.kl_coef > 0,
        entropy_grad=cfg.algorithm.entropy_coef > 0,
        ppo_epochs=cfg.trainer.ppo_epochs,
        attention="flash" if on_cuda else "unfused",  # Transformer Engine on CUDA, megatron's local spec on CPU
        sequences_per_step=cfg.trainer.prompts_per_step * rollout.n_samples_per_prompt,
        eval_sequences=eval_sequences(cfg),
        hf_exports=cfg.trainer.export_every > 0 or cfg.trainer.export_at_end,
        prompt_tokens=max(1, prompt_tokens),
        response_tokens=response_tokens,
        ranks_per_node=cfg.cluster.procs_per_node,
        checkpoint_saves=cfg.trainer.save_every > 0,
        data_host_bytes=_data_file_bytes(cfg.data.path),
        routed_experts=cfg.returns_routed_experts,
        routing_replay=cfg.algorithm.routing_replay,
        # the launch plan's MoE routing: balanced, or what megatron's capacity factor lets one rank's experts receive
        routed_copies_ratio=(
            1.0
            if actor.moe_expert_capacity_factor is None
            else capacity_routed_copies_ratio(shape, actor.ep, actor.moe_expert_capacity_factor)
        ),
        sync_bucket_bytes=cfg.weight_sync.bucket_mb * MIB,
        verify_sync=cfg.weight_sync.verify,
        calibration=calibration,
        launch_runtime_bytes=launch_runtime_bytes,
    )
    # after PlanInputs has checked the splits: the sync plan the run will execute, planned the same way
    sync = (shape, cfg.mesh(), inputs.sync_bucket_bytes, inputs.element_bytes)
    reference = reference_samples(shape, cfg.mesh()) if cfg.weight_sync.check_every else ()
    return dataclasses.replace(
        inputs,
        sync_staged_bytes=sync_staged_bytes(*sync),
        sync_traffic=sync_traffic(*sync),
        sync_peers=sync_peers(*sync),
        reference_check=reference,
    )


def _data_file_bytes(path: str | None) -> int:
    """The task's data file's bytes (each rank reads all its records; 0 for a generated task or no file here)."""

    if not path or not os.path.isfile(resolve_path(path)):
        return 0
    return os.path.getsize(resolve_path(path))


@dataclass(frozen=True)
class PromptLength:
    """The prompt length a plan made before launch uses: the task's longest prompt in tokens (what the run's own
    plan uses, run/setup.py), or ``None`` where the data or the tokenizer is not on this machine; ``source`` says
    which, for the plan's printout."""

    tokens: int | None
    source: str


def data_prompt_length(cfg) -> PromptLength:
    """The task's longest prompt, tokenized as the run does (rl.data.longest_prompt_tokens) from its data file or
    generator with the model's tokenizer: ``make plan``, the sweep's and the launcher's checks plan with it. Where
    the data or the tokenizer is absent: ``tokens=None`` (plan_inputs then plans the max_model_len bound)."""
    data = cfg.data
    return _data_prompt_length(cfg.model.path, data.task, data.path, data.max_operand, cfg.trainer.seed)


@functools.lru_cache(maxsize=8)
def _data_prompt_length(model_path: str, task: str, data_path: str | None, max_operand: int, seed: int) -> PromptLength:

    path = resolve_path(model_path)
    try:
        built = DataConfig(task=task, path=resolve_path(data_path) if data_path else None, max_operand=max_operand)
        source_task = built.build(seed)
    except (OSError, ValueError) as exc:
        return PromptLength(None, f"no data here ({exc})")
    try:
        tokenizer = _tokenizer(path)
    except (OSError, ValueError) as exc:
        return PromptLength(None, f"no tokenizer at model.path={model_path!r} ({type(exc).__name__})")
    tokens = longest_prompt_tokens(source_task, tokenizer)
    return PromptLength(tokens, f"data.task={task}'s longest prompt, {tokens} tokens")


def _tokenizer(path: str):
    """The tokenizer the run loads (run/setup.py: AutoTokenizer at model.path); a ``tiny:`` checkpoint's without
    building the checkpoint (modelspec.tiny saves ``build_tokenizer()`` beside every tiny model)."""

    if path.startswith(TINY_PREFIX):
        return build_tokenizer()
    # first use: at the top transformers would load with `import run.main, run.preflight ...`, which do not need it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def eval_sequences(cfg) -> int:
    """The eval batch (every eval problem x eval.n_samples; 0 when the run does not evaluate). An eval file not
    on this machine (a cluster experiment planned on a laptop) counts as eval.max_problems problems, else as
    one step's prompts."""

    if not cfg.eval.enabled:
        return 0
    try:
        num_problems = len(eval_problems(cfg))
    except (OSError, ValueError):
        num_problems = cfg.eval.max_problems or cfg.trainer.prompts_per_step
    return num_problems * cfg.eval.n_samples


@functools.lru_cache(maxsize=8)
def _sync_plan(shape, mesh, bucket_bytes: int, element_bytes: int) -> SyncPlan:
    """The plan run/setup.py builds (``WeightSyncConfig.build``: both sides' layouts, no communication). The actor's
    norm naming (``te_norms``) changes no size."""
    return plan_sync(actor_sources(shape, mesh), engine_destinations(shape, mesh), bucket_bytes, element_bytes)


def _stages(mesh) -> list[list[int]]:
    """The ranks of each actor pipeline stage."""
    stage_of = [mesh.actor_coords(rank).pp_rank for rank in range(mesh.world_size)]
    return [[r for r in range(mesh.world_size) if stage_of[r] == stage] for stage in range(mesh.actor_pp)]


def sync_staged_bytes(shape, mesh, bucket_bytes: int, element_bytes: int) -> tuple[int, ...]:
    """Per actor pipeline stage, the most bytes one of its ranks stages in one bucket of the weight sync: the
    sync plan's packed part (``SyncPlan.max_staged_bytes``)."""
    plan = _sync_plan(shape, mesh, bucket_bytes, element_bytes)
    return tuple(plan.max_staged_bytes(ranks) for ranks in _stages(mesh))


def sync_traffic(shape, mesh, bucket_bytes: int, element_bytes: int) -> tuple[SyncTraffic, ...]:
    """Per actor pipeline stage, the sync plan's work on its busiest ranks (each count's most over the stage's
    ranks): bytes copied from the rank's own shard (local transfers), sent, received (of those, the staged: packed
    into buffers, weight_sync/execute.py), and the slices ``weight_sync.verify`` checksums (weight_sync/verify.py:
    each transfer's sender and receiver)."""
    plan = _sync_plan(shape, mesh, bucket_bytes, element_bytes)
    local, sent, received, checksums, staged_sent, staged_received = ([0] * mesh.world_size for _ in range(6))
    for t in plan.transfers:
        checksums[t.src_rank] += 1
        checksums[t.dst_rank] += 1
        if t.is_local:
            local[t.src_rank] += t.numel
        else:
            sent[t.src_rank] += t.numel
            received[t.dst_rank] += t.numel
            if not is_direct(t, element_bytes):
                staged_sent[t.src_rank] += t.numel
                staged_received[t.dst_rank] += t.numel
    e = element_bytes
    return tuple(
        SyncTraffic(
            local_bytes=max(local[r] for r in ranks) * e,
            sent_bytes=max(sent[r] for r in ranks) * e,
            received_bytes=max(received[r] for r in ranks) * e,
            checksums=max(checksums[r] for r in ranks),
            staged_sent_bytes=max(staged_sent[r] for r in ranks) * e,
            staged_received_bytes=max(staged_received[r] for r in ranks) * e,
        )
        for ranks in _stages(mesh)
    )


def sync_peers(shape, mesh, bucket_bytes: int, element_bytes: int) -> int:
    """The most other ranks one rank sends to or receives from in the weight sync (the same plan as
    :func:`sync_staged_bytes`): the point-to-point peers whose NCCL buffers planner/comms.py counts."""
    plan = _sync_plan(shape, mesh, bucket_bytes, element_bytes)
    peers: dict[int, set[int]] = {}
    for t in plan.transfers:
        if not t.is_local:
            peers.setdefault(t.src_rank, set()).add(t.dst_rank)
            peers.setdefault(t.dst_rank, set()).add(t.src_rank)
    return max((len(p) for p in peers.values()), default=0)


@functools.lru_cache(maxsize=32)
def reference_samples(shape, mesh) -> tuple:
    """Per layer k, what the weight sync's reference check k gathers (planner.inputs.ReferenceSample, elements):
    the pieces megatron_backend/checkpoint.py::gather_hf_tensors sends from each rank (its primary pieces of the
    sampled HF tensors, DP rank 0's, for the experts expert-DP rank 0's) for weight_sync/reference.py::sample_names
    (layer k, and with k = 0 the vocab tensors and the final norm). The norm naming changes no size."""

    full_shapes = hf_tensor_shapes(shape)

    def layer_of(name: str) -> int:  # the vocab tensors and the final norm go with layer 0
        match = HF_LAYER.search(name)
        return int(match.group(1)) if match else 0

    num_layers = shape.num_layers
    full = [0] * num_layers
    for name, dims in full_shapes.items():
        full[layer_of(name)] += math.prod(dims)
    sent = {}  # rank -> per layer, the elements it sends
    for rank, pieces in actor_sources(shape, mesh).items():
        c = mesh.actor_coords(rank)
        counts = [0] * num_layers
        for piece in pieces:
            if piece.primary and (c.expert_dp_rank if piece.is_expert else c.dp_rank) == 0:
                dims = full_shapes[piece.hf_name]
                counts[layer_of(piece.hf_name)] += math.prod(dims) // dims[piece.dim] * piece.length
        sent[rank] = counts
    stage_of = {rank: mesh.actor_coords(rank).pp_rank for rank in sent}
    return tuple(
        ReferenceSample(
            own=tuple(
                max(counts[k] for rank, counts in sent.items() if stage_of[rank] == stage)
                for stage in range(mesh.actor_pp)
            ),
            largest=max(counts[k] for counts in sent.values()),
            gathered=sum(counts[k] for counts in sent.values()),
            full=full[k],
            ranks=mesh.world_size,
        )
        for k in range(num_layers)
    )


# ---------------------------------------------------------------- the plan inside a run
@dataclass(frozen=True)
class KvCacheChoice:
    """The KV cache this run's engine gets, and where the number came from (logged at start)."""

    kv_cache_bytes: int | None  # None: the engine sizes it from gpu_memory_utilization itself
    gpu_memory_utilization: float
    source: str
    tokens: int

    def line(self) -> str:
        if self.kv_cache_bytes is None:
            return f"KV cache: from rollout.gpu_memory_utilization={self.gpu_memory_utilization:g} ({self.source})"
        return (
            f"KV cache: {self.kv_cache_bytes / 2**30:.3f} GiB per rank ({self.kv_cache_bytes} bytes, {self.tokens} "
            f"tokens), {self.source}; the engine gets it as bytes (gpu_memory_utilization={self.gpu_memory_utilization:.4f})"
        )


def choose_kv_cache(cfg, plan: Plan, measured_free_bytes: int | None = None) -> KvCacheChoice:
    """What the engine is handed: the one place ``rollout.gpu_memory_utilization=auto`` is resolved (the
    launcher's check and the rank's engine start both come here). ``rollout.kv_cache_bytes`` wins; ``auto``
    takes the planner's recommendation, bounded (when ``measured_free_bytes`` is given: CUDA, after the actor
    is built and offloaded) by what the device has free for weights + KV cache + engine reserve less the
    plan's margin, in whole blocks. A float utilization is left to the engine."""
    rollout = cfg.rollout
    if rollout.kv_cache_bytes is not None:
        util = rollout.utilization
        util = plan.equivalent_utilization(rollout.kv_cache_bytes)[rollout.engine] if util is None else util
        return KvCacheChoice(rollout.kv_cache_bytes, util, "rollout.kv_cache_bytes", plan.kv_cache_tokens())
    if rollout.utilization is not None:
        return KvCacheChoice(None, rollout.utilization, "the engine's own sizing", plan.kv_cache_tokens())
    kv, source = plan.recommended_kv_cache_bytes, "chosen by the planner (gpu_memory_utilization=auto)"
    if measured_free_bytes is not None:
        block = plan.kv_bytes_per_token * plan.inputs.kv_block_size
        room = measured_free_bytes - plan.engine_weight_bytes - plan.rollout_engine_reserve_bytes - plan.margin_bytes
        if room < kv:
            kv = max(0, room) // block * block
            source += f", bounded by the {measured_free_bytes / 2**30:.2f} GiB measured free"
    if kv < plan.min_kv_cache_bytes:
        raise ValueError(
            f"rollout.gpu_memory_utilization=auto: no KV cache fits ({kv / 2**30:.3f} GiB < one max_model_len "
            f"sequence, {plan.min_kv_cache_bytes / 2**30:.3f} GiB): offload more of the actor (actor.offload.*), "
            "use rollout.wake_strategy=staged or lower rollout.max_model_len"
        )
    util = plan.equivalent_utilization(kv)[rollout.engine]
    return KvCacheChoice(kv, util, source, plan.kv_cache_tokens(kv))


def engine_config(cfg, choice: KvCacheChoice):
    """``cfg.rollout`` as the engine gets it: an ``auto`` utilization resolved to bytes (and its fraction). The
    launch applies it once, to the plan's inputs (:func:`plan_launch`), and the engine reads that same object
    (:meth:`LaunchPlan.engine_rollout`)."""
    if choice.kv_cache_bytes is None or cfg.rollout.utilization is not None:
        return cfg.rollout
    return dataclasses.replace(
        cfg.rollout,
        kv_cache_bytes=choice.kv_cache_bytes,
        gpu_memory_utilization=min(1.0, choice.gpu_memory_utilization),
    )


@dataclass(frozen=True)
class LaunchPlan:
    """The launch's one memory plan: made by the launcher (run/main.py) before any rank starts and handed to every
    rank with the config (spawn's arguments; under torchrun / srun each process makes it before its process group).
    Preflight's KV check, the engine's KV cache and the wake checks all read it; no rank plans again (except a CUDA
    rank whose measured free memory bounds an ``auto`` KV cache below the plan's, :func:`bounded_by_free_memory`)."""

    plan: Plan | None  # made with the KV cache the engine gets; None: not plannable (``problem`` says why)
    kv_choice: KvCacheChoice | None  # what the engine gets (None with ``plan``)
    problem: str | None = None

    def engine_rollout(self, cfg):
        """``cfg.rollout`` as the engine gets it: the plan's own (:func:`engine_config` of its KV choice)."""
        return cfg.rollout if self.plan is None else self.plan.inputs.rollout


def launch_prompt_tokens(cfg) -> int | None:
    """The longest prompt the run's engine sees, in tokens: the task's and, when the run evaluates, the eval
    problems', tokenized as the rank tokenizes them. None where the data or the tokenizer is not on this machine."""
    tokens = data_prompt_length(cfg).tokens
    if tokens is None or not cfg.eval.enabled:
        return tokens

    tokenizer = _tokenizer(_resolved(cfg.model.path))
    return max([tokens, *(len(tokenizer(p.prompt).input_ids) for p in eval_problems(cfg))])


def _resolved(path: str) -> str:

    return resolve_path(path)


def plan_launch(cfg) -> LaunchPlan:
    """The launch's :class:`LaunchPlan` (``rollout.gpu_memory_utilization=auto`` resolved: ``choose_kv_cache``
    without a measurement). ValueError in one line when ``auto`` has no plan, or none that fits."""

    auto = cfg.rollout.utilization is None
    try:
        plan = make_plan(plan_inputs(cfg, launch_prompt_tokens(cfg)))
    except ValueError as exc:
        if auto:
            raise ValueError(f"rollout.gpu_memory_utilization=auto needs a memory plan: {exc}") from None
        return LaunchPlan(None, None, str(exc))  # e.g. a device without a preset: the run goes unplanned
    if auto and not plan.fits:
        raise ValueError(
            f"rollout.gpu_memory_utilization=auto: {verdict(plan)} (`make plan EXP={cfg.exp}` shows every phase)"
        )
    choice = choose_kv_cache(cfg, plan)
    rollout = engine_config(cfg, choice)
    if rollout is not cfg.rollout:  # plan with the KV cache the engine gets
        plan = make_plan(dataclasses.replace(plan.inputs, rollout=rollout))
    return LaunchPlan(plan, choice)


def bounded_by_free_memory(cfg, launch: LaunchPlan, measured_free_bytes: int) -> LaunchPlan:
    """On a CUDA rank with ``auto``: ``launch`` with its KV cache bounded by the free memory measured after the actor
    is built and offloaded (the least over ranks); the same object when the bound leaves the plan's KV cache."""

    choice = choose_kv_cache(cfg, launch.plan, measured_free_bytes)
    if choice.kv_cache_bytes == launch.kv_choice.kv_cache_bytes:
        return launch
    inputs = dataclasses.replace(launch.plan.inputs, rollout=engine_config(cfg, choice))
    return LaunchPlan(make_plan(inputs), choice)


def with_launch_runtime(launch: LaunchPlan, runtime_bytes: int) -> LaunchPlan:
    """On a CPU rank: ``launch`` planned again with the runtime level the rank measured before its engine
    (run/setup.py::launch_runtime_bytes, the most over ranks), so the wake checks and the calibration compare with
    this machine's level; the engine keeps the launch's KV cache (``kv_choice``), so every rank starts the same engine
    the launcher checked."""

    if launch.plan is None:
        return launch
    inputs = dataclasses.replace(launch.plan.inputs, launch_runtime_bytes=runtime_bytes)
    return dataclasses.replace(launch, plan=make_plan(inputs))
