"""Build everything one rank holds for a run, in order: the parts every rank holding the actor and the engine
builds, in a run and in the tools alike (:func:`build_rank`: process groups and the mesh, the memory probe, the
actor, the weight-sync plan), then the run's own: the checkpoint to resume from (if any, loaded into the actor),
the memory timeline, the reference actor, the shared device, the writer, the task, the checkpointer; the engine
comes at the start of the rollout (:func:`start_rollout`)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from checkpointing.checkpoint import (
    ACTOR_DIR,
    Checkpointer,
    RLState,
    StopRequest,
    load_rank_state,
    model_sizes,
    resolve_resume,
)
from colocation.host_memory import configure_host_allocator, freeze_long_lived_objects
from colocation.phases import HOLDERS
from configs import ActorConfig, RolloutConfig
from megatron_backend.actor import Actor
from megatron_backend.parallel import ParallelDims, default_device, initialize_model_parallel
from modelspec import ColocatedMesh, ModelShape, TokenBatch, torch_dtype
from rl.batching import Sample, make_batch, pack_sequences
from rl.data import DigitSumTask, Gsm8kTask, Problem, longest_prompt_tokens
from rl.evaluation import eval_problems
from rl.generation import sampling_seed
from rl.losses import PolicyLoss, sft_loss
from rollout import RolloutEngine, make_engine
from rollout.native.decode_tp1 import first_use
from run.config import ModelConfig, RunConfig, colocated_mesh
from run.launch import ClusterConfig
from run.memory_plan import KvCacheChoice, LaunchPlan, bounded_by_free_memory, plan_launch, with_launch_runtime
from run.shared_device import SharedDevice
from telemetry.memory_timeline import TAGS, MemoryProbe, MemoryTimeline
from telemetry.tracking import RunWriter
from weight_sync import WeightSync, WeightSyncConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from planner import Plan


@dataclass(frozen=True, kw_only=True)
class RankParts:
    """What every rank holding the actor and the engine side by side is built from, the same way in a run
    (:func:`setup`) and in the tools that check or measure the pair (verify-sync, bench-sync, eval, logprob_gap):
    :func:`build_rank` builds it, :meth:`start_engine` adds the engine."""

    model: ModelConfig
    rollout: RolloutConfig  # the engine's (a run's engine takes the launch plan's KV cache instead)
    dims: ParallelDims  # this rank's actor groups (megatron's)
    mesh: ColocatedMesh
    rollout_group: dist.ProcessGroup | None  # this rank's engine replica (native engine: its TP x EP ranks)
    probe: MemoryProbe  # its CPU baseline: the process after the imports and process groups, before the actor
    actor: Actor
    weight_sync: WeightSync  # the planned reshard of the actor's shards into the engine's weights

    def start_engine(self, rollout: RolloutConfig | None = None, **engine_args) -> RolloutEngine:
        """The engine with empty weights (the weight sync writes them) on this rank's mesh and replica group;
        ``rollout``: its config when not the rank's; ``engine_args``: :func:`rollout.make_engine`'s."""
        return make_engine(
            self.rollout if rollout is None else rollout,
            self.model.path,
            mesh=self.mesh,
            rank=self.dims.rank,
            group=self.rollout_group,
            device=self.dims.device,
            dtype=self.model.dtype,
            load=False,
            shape=self.model.shape(),
            **engine_args,
        )


def build_rank(
    model: ModelConfig,
    actor: ActorConfig,
    rollout: RolloutConfig,
    weight_sync: WeightSyncConfig,
    *,
    train: bool = True,
    timeout_s: float = ClusterConfig.timeout_s,
) -> RankParts:
    """This rank's process groups for ``actor``'s layout (the host allocator tuned first on CPU), the mesh they
    must match, one group per engine replica, the memory probe, the actor loaded from ``model.path`` (``train``:
    with its optimizer) and the weight sync planned into ``rollout``'s layout. A run (:func:`setup`) and every tool
    that pairs the actor with an engine build a rank here; each passes what differs."""
    # megatron-core warns at import about missing Apex / Transformer Engine / CUDA env vars; on CPU that is expected
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    if default_device().type == "cpu":
        # the process's memory is the device's here: keep it from creeping with allocator fragmentation
        configure_host_allocator()
    dims = initialize_model_parallel(
        actor.tp, actor.pp, actor.vpp, seed=actor.seed, timeout_s=timeout_s, ep=actor.ep, etp=actor.expert_tp
    )
    mesh = colocated_mesh(dims.world_size, actor, rollout)
    coords = mesh.actor_coords(dims.rank)
    planned = (coords.tp_rank, coords.pp_rank, coords.dp_rank, coords.ep_rank, coords.etp_rank)
    if planned != (dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.ep_rank, dims.etp_rank):
        raise RuntimeError(
            "megatron's rank order is not tp-dp-pp (experts tp-ep-dp-pp); the weight-sync plan would be wrong"
        )
    # one group per replica, every rank creating every group in the same order
    groups = [dist.new_group(mesh.replica_ranks(i)) for i in range(mesh.num_replicas)]
    probe = MemoryProbe(dims.device)  # after imports and process-group setup: the CPU baseline
    built = Actor(model.path, actor, dims, dtype=model.dtype, train=train, shape=model.shape())
    return RankParts(
        model=model,
        rollout=rollout,
        dims=dims,
        mesh=mesh,
        rollout_group=groups[mesh.replica(dims.rank)] if mesh.replica_size > 1 else None,
        probe=probe,
        actor=built,
        weight_sync=weight_sync.build(built.shape, mesh, dims.rank, dtype=model.dtype, te_norms=built.layout.te_norms),
    )


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What one rank builds once for the run: :func:`setup` builds it, :func:`run.warmup.resume_or_warm_up` returns
    it with the warm-up's losses and :func:`start_rollout` with the engine. Never reassigned: what a step changes
    comes back from ``rl_step`` (:class:`run.loop.StepResult`). The objects it holds (the actor, the engine, the
    timeline, the writer) keep their own state."""

    cfg: RunConfig
    parts: RankParts  # the process groups, the mesh, the actor and the weight sync, as every tool builds them
    shared: SharedDevice  # the actor, the reference actor, the engine, the weight sync, moved by the step's table
    tokenizer: PreTrainedTokenizerBase
    task: DigitSumTask | Gsm8kTask
    loss: PolicyLoss
    timeline: MemoryTimeline
    writer: RunWriter | None  # rank 0 only
    checkpointer: Checkpointer
    stop: StopRequest
    eval_problems: list[Problem]  # the eval phase's problems (rl/evaluation.py; empty when the run does not evaluate)
    # resuming: the checkpoint, its RLState and this rank's saved RNG/task state (applied before the first step)
    resumed_from: Path | None = None
    resumed_state: RLState | None = None
    resumed_rank_state: dict | None = None
    warmup_losses: list[float] = field(default_factory=list)  # the SFT warm-up's (the checkpoint's when resuming)
    t0: float = field(default_factory=time.monotonic)
    # the launch's memory plan (run/main.py, handed to every rank); after start_rollout(): the engine's (the same
    # object unless a CUDA rank's measured free memory bounded an ``auto`` KV cache)
    launch: LaunchPlan | None = None

    @property
    def kv_choice(self) -> KvCacheChoice | None:
        """The KV cache the engine gets (None: not planned)."""
        return self.launch.kv_choice if self.launch is not None else None

    @property
    def dims(self) -> ParallelDims:
        return self.parts.dims

    @property
    def mesh(self) -> ColocatedMesh:
        return self.parts.mesh

    @property
    def actor(self) -> Actor:
        return self.shared.actor

    @property
    def engine(self) -> RolloutEngine | None:
        return self.shared.engine

    @property
    def plan(self) -> Plan | None:
        """The memory plan made with the engine's KV cache (None: not plannable)."""
        return self.shared.plan

    @property
    def start_step(self) -> int:
        return self.resumed_state.completed_steps if self.resumed_state else 0

    @property
    def sampling_base_seed(self) -> int:
        """The sampling-seed schedule's base: the checkpoint's when resuming (part of the saved state)."""
        return self.resumed_state.sampling_seed if self.resumed_state else self.cfg.trainer.seed

    @property
    def rank(self) -> int:
        return self.dims.rank

    @property
    def replica(self) -> int:
        return self.mesh.replica(self.rank)

    def rl_state(self, completed_steps: int, rank_state: dict) -> RLState | None:
        """Rank 0's RLState for the checkpoint after ``completed_steps`` steps (None on the other ranks)."""
        if self.writer is None:
            return None
        dims, mesh, base_seed = self.dims, self.mesh, self.sampling_base_seed
        return RLState(
            completed_steps=completed_steps,
            sampling_seed=base_seed,
            next_sampling_seeds=[sampling_seed(base_seed, completed_steps, r) for r in range(mesh.num_replicas)],
            data_num_prompts_drawn=rank_state["task"]["num_drawn"],
            wandb_run_id=self.writer.wandb_run_id,
            wandb_step=self.writer.wandb_step_after_deferred,
            world_size=mesh.world_size,
            layout=dict(
                actor_tp=dims.tp, actor_pp=dims.pp, actor_vpp=dims.vpp, actor_dp=dims.dp, rollout_tp=mesh.rollout_tp
            ),
            model=model_sizes(self.actor.shape),
            exp=self.cfg.exp,
            warmup_losses=list(self.warmup_losses),
        )

    def make_batch(self, samples: list[Sample]) -> tuple[TokenBatch, torch.Tensor]:
        """This DP rank's share of the step's samples (on its device), and every sample's reward [N]."""
        cfg, dims = self.cfg, self.dims
        return make_batch(
            samples,
            cfg.rollout.n_samples_per_prompt,
            dims.dp,
            dims.dp_rank,
            self.tokenizer.pad_token_id or 0,
            dims.device,
            balance_tokens=cfg.actor.balance_dp_tokens,
        )


def _checkpoint_to_resume(cfg: RunConfig, run_dir: Path, rank: int) -> Path | None:
    """Rank 0 decides (a run started under torchrun has no parent that did), every rank follows."""
    box = [resolve_resume(cfg.resume, run_dir) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def setup(
    cfg: RunConfig, run_dir: Path, stop: StopRequest | None = None, launch: LaunchPlan | None = None
) -> RankContext:
    parts = build_rank(cfg.model, cfg.actor, cfg.rollout, cfg.weight_sync, timeout_s=cfg.cluster.timeout_s)
    dims, actor = parts.dims, parts.actor
    checkpoint = _checkpoint_to_resume(cfg, run_dir, dims.rank)
    resumed_state = RLState.read(checkpoint) if checkpoint else None
    timeline = MemoryTimeline(
        parts.probe, dims.rank, interval_s=cfg.trainer.memory_sample_interval_s, count_tensors=cfg.trainer.count_tensors
    )
    cluster = cfg.cluster
    checkpointer = Checkpointer(
        run_dir, dims.rank, cfg.trainer.keep_last, timeout_s=cluster.timeout_s, file_timeout_s=cluster.file_timeout_s
    )
    if checkpoint is not None:
        with checkpointer.window():  # every rank reads its shards, then waits for the slowest
            actor.load_checkpoint(checkpoint / ACTOR_DIR)  # any saved layout: dist checkpointing reshards
    ref_actor = None
    if cfg.algorithm.kl_coef > 0:
        ref_actor = Actor(cfg.model.path, cfg.actor, dims, dtype=cfg.model.dtype, train=False, shape=cfg.model.shape())
    parts.probe.add_ledger(lambda: _tagged(actor.memory(), dims.device))
    if ref_actor is not None:
        # the reference actor's state under its own tags (its ledger, an actor's, calls them the actor's)
        actor_tag = {name: state for state, (holder, name) in HOLDERS.items() if holder == "actor"}
        rename = {actor_tag[name]: state for state, (holder, name) in HOLDERS.items() if holder == "ref_actor"}
        parts.probe.add_ledger(lambda: _tagged(ref_actor.memory(), dims.device, rename=rename))
    if resumed_state is not None:
        # the syncs continue the resumed run's count (one at start-up, one per step), so step k's reference check
        # samples the layer the uninterrupted run's did
        parts.weight_sync.num_syncs = resumed_state.completed_steps
    shared = SharedDevice(
        actor=actor,
        ref_actor=ref_actor,
        weight_sync=parts.weight_sync,
        flags=cfg.step_flags(),
        timeline=timeline,
        device=dims.device,
        procs_per_node=cluster.procs_per_node,
    )
    shared.offload_between_uses("ref_actor")  # on host until its first ref_logprob (as the flags say)
    writer = None
    if dims.rank == 0:
        writer = cfg.wandb.build(
            run_dir,
            cfg,
            name=f"{cfg.exp}-{run_dir.name}",
            completed_steps=resumed_state.completed_steps if resumed_state else 0,
            wandb_run_id=resumed_state.wandb_run_id if resumed_state else None,
            wandb_step=resumed_state.wandb_step if resumed_state else 0,
            defer_wandb=cfg.trainer.save_every > 0,  # W&B gets a step once a checkpoint covers it
        )
    if checkpoint is not None:  # the timeline continues where the checkpoint's ended
        box = [writer.last_t_s if writer is not None else 0.0]
        dist.broadcast_object_list(box, src=0)
        timeline.t0 = time.monotonic() - box[0]
    ctx = RankContext(
        cfg=cfg,
        parts=parts,
        shared=shared,
        tokenizer=AutoTokenizer.from_pretrained(cfg.model.path),
        task=cfg.data.build(seed=cfg.trainer.seed),
        loss=PolicyLoss(cfg.algorithm),
        timeline=timeline,
        writer=writer,
        checkpointer=checkpointer,
        stop=stop or StopRequest(dims.rank),
        eval_problems=eval_problems(cfg) if cfg.eval.enabled else [],
        resumed_from=checkpoint,
        resumed_state=resumed_state,
        resumed_rank_state=load_rank_state(checkpoint, dims.rank) if checkpoint else None,
        launch=launch,
    )
    freeze_long_lived_objects()
    return ctx


def plan_and_build_engine(ctx: RankContext) -> RankContext:
    """``ctx`` with its engine, built with empty weights (the first weight sync writes them). Called once the actor has
    offloaded what its flags say, so that what the engine sees at start-up (vLLM checks free memory against
    its utilization and sizes the KV cache from it) is what the step leaves it at the KV-cache wake.

    The KV cache and the plan are the launch's (``ctx.launch``, run.memory_plan.plan_launch: made once before the
    ranks started; on CUDA an ``auto`` KV cache is bounded by the free memory measured now, the least over ranks).
    The plan is kept for the wake checks and the predicted-vs-measured calibration (``ctx.shared.plan``)."""
    cfg, dims = ctx.cfg, ctx.dims
    if ctx.launch is None:  # set up outside run.main (tests, tools): the launch's plan, made here
        ctx = dataclasses.replace(ctx, launch=plan_launch(cfg))
    # the plan covers sequences as long as the longest prompt (the task's, the eval's) + max_new_tokens
    eval_tokens = [len(ctx.tokenizer(p.prompt).input_ids) for p in ctx.eval_problems]
    prompt_tokens = max([longest_prompt_tokens(ctx.task, ctx.tokenizer), *eval_tokens])
    plan = ctx.launch.plan
    if plan is not None and prompt_tokens > plan.inputs.prompt_tokens:
        raise RuntimeError(
            f"rank {dims.rank}: the longest prompt has {prompt_tokens} tokens but the launch planned "
            f"{plan.inputs.prompt_tokens}: the launcher and the rank read different data or tokenizers"
        )
    launch_runtime = launch_runtime_bytes(
        ctx.timeline.probe,
        dims.device,
        ctx.actor.shape,
        cfg.model.dtype,
        # the engine decodes a step's sequences at once, up to its max_num_seqs
        min(cfg.trainer.prompts_per_step * cfg.rollout.n_samples_per_prompt, cfg.rollout.max_num_seqs or 2**31),
        cfg.rollout.tp,
        native_decode_tp1=cfg.rollout.engine == "native" and cfg.rollout.tp == 1 and cfg.model.dtype == "float32",
    )
    launch = ctx.launch if launch_runtime is None else with_launch_runtime(ctx.launch, launch_runtime)
    engine, launch = build_engine(cfg, ctx.parts, launch)
    ctx.timeline.probe.add_ledger(lambda: _tagged(engine.memory(), dims.device))
    if ctx.writer is not None and launch.plan is not None:
        ctx.writer.predicted_bytes = {name: launch.plan.measurable_bytes(name) for name in launch.plan.names}
    ctx.shared.attach_engine(engine, launch.plan)
    return dataclasses.replace(ctx, launch=launch)


def launch_runtime_bytes(
    probe: MemoryProbe,
    device: torch.device,
    shape: ModelShape,
    dtype: str,
    decode_sequences: int,
    rollout_tp: int,
    native_decode_tp1: bool = False,
) -> int | None:
    """CPU: the runtime level every rank holds beside its tensors now, after setup and the warm-up and before the
    engine and the first step (the most over ranks: the plan is the worst rank's), with torch's first-use costs
    paid first (:func:`first_use_of_kernels`; with ``native_decode_tp1`` the native engine's TorchScript decode
    too; megatron's first forward and backward were paid before the offloads, :func:`first_forward_backward`);
    None on CUDA (the fitted level: no GPU run has validated a launch
    measurement there)."""
    if device.type != "cpu":
        return None
    first_use_of_kernels(shape, torch_dtype(dtype), decode_sequences, rollout_tp)
    if native_decode_tp1:
        first_use(
            shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size,
            decode_sequences,
        )  # fmt: skip
    level = torch.tensor([probe.runtime_level_bytes()], dtype=torch.int64, device=device)
    dist.all_reduce(level, op=dist.ReduceOp.MAX)
    return int(level)


def first_use_of_kernels(
    shape: ModelShape, dtype: torch.dtype, decode_sequences: int, rollout_tp: int, tokens: int = 64
) -> None:
    """Run once, at the run's sizes, the kinds of kernel a step runs (a projection forward with and without grad,
    its backward, the engine's decode attention over ``decode_sequences`` sequences, a softmax and a multinomial
    draw over the vocabulary), building nothing that stays: what torch keeps once per process after their first
    use (GEMM buffers and thread pools, autograd's worker, the CPU attention kernel's buffers, which grow with
    the decode batch) is then part of the launch measurement, instead of appearing in the first step. Measured
    in a fresh process at memory_cpu's sizes: ~11 MiB for the projections and sampler, +15 MiB for attention
    over 512 decoding sequences."""
    rng = torch.Generator().manual_seed(0)  # its own: the run's RNG streams are not advanced
    x = torch.randn(tokens, shape.hidden_size, dtype=dtype, generator=rng, requires_grad=True)  # [tokens, hidden]
    w = torch.randn(shape.intermediate_size, shape.hidden_size, dtype=dtype, generator=rng, requires_grad=True)
    with torch.no_grad():
        torch.nn.functional.linear(x, w)  # [tokens, ffn]
    torch.nn.functional.linear(x, w).float().sum().backward()
    heads, kv_heads = max(1, shape.num_heads // rollout_tp), max(1, shape.num_kv_heads // rollout_tp)
    q = torch.randn(decode_sequences, heads, 1, shape.head_dim, dtype=dtype, generator=rng)  # [seqs, Hq/t, 1, d]
    kv = torch.randn(decode_sequences, kv_heads, tokens, shape.head_dim, dtype=dtype, generator=rng)
    mask = torch.ones(decode_sequences, 1, 1, tokens, dtype=torch.bool)  # as the native engine masks its pages
    torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=heads != kv_heads)
    del q, kv, mask
    logits = torch.randn(8, shape.vocab_size, generator=rng)  # [rows, V] fp32, as the samplers draw
    torch.softmax(logits, dim=-1).multinomial(1, generator=rng)
    del x, w, logits


def build_engine(cfg: RunConfig, parts: RankParts, launch: LaunchPlan) -> tuple[RolloutEngine, LaunchPlan]:
    """The engine with empty weights, its KV cache as ``launch`` says (:func:`plan_and_build_engine`), and the plan
    it was started with (``launch`` itself unless the measured free memory bounded it)."""
    dims = parts.dims
    if launch.plan is None:
        print(f"rank {dims.rank}: no memory plan ({launch.problem}); no wake checks or calibration", flush=True)
    else:
        if cfg.rollout.utilization is None and dims.device.type == "cuda":
            least = torch.tensor([torch.cuda.mem_get_info(dims.device)[0]], dtype=torch.int64, device=dims.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            launch = bounded_by_free_memory(cfg, launch, int(least))
        if dims.rank == 0:
            print(launch.kv_choice.line(), flush=True)
    routed = cfg.rollout.engine == "vllm" and cfg.returns_routed_experts
    engine = parts.start_engine(
        launch.engine_rollout(cfg), **({"enable_return_routed_experts": True} if routed else {})
    )
    return engine, launch


def start_rollout(ctx: RankContext) -> RankContext:
    """Before the first step: the actor offloads what its flags say, the engine starts sized for that
    (:func:`plan_and_build_engine`, which leaves it fully awake), then the first weight sync walks the step's
    table (:meth:`run.shared_device.SharedDevice.first_sync`). Ends where a step ends: engine awake, actor
    offloaded. Returns ``ctx`` with the engine."""
    ctx.shared.offload_between_uses("actor")
    ctx = plan_and_build_engine(ctx)
    ctx.shared.first_sync()
    freeze_long_lived_objects()  # the engine's objects too
    return ctx


def first_forward_backward(ctx: RankContext) -> None:
    """One forward and backward of the actor over one train micro-batch of synthetic rows, no optimizer step
    (the grad buffers are zeroed again): what megatron and autograd keep once per process after their first
    pass is then paid before the launch measurement in every run, with or without a warm-up or a resume, so
    the fitted remainder above that measurement is one population (docs/plan-validation.md). The rows are
    synthetic: the task's RNG and data cursor do not move."""
    cfg, dims = ctx.cfg, ctx.dims
    per_rank = max(1, cfg.trainer.prompts_per_step * cfg.rollout.n_samples_per_prompt // dims.dp)
    num_rows, half = min(cfg.actor.micro_batch_size, per_rank), 16  # rows of 16 prompt + 16 response tokens
    ids = list(range(1, half + 1))
    samples = [Sample(i, ids, ids, [], "length", 0.0) for i in range(num_rows)]
    batch = pack_sequences(samples, pad_id=ctx.tokenizer.pad_token_id or 0)
    ctx.actor.compute_grads(batch.to(dims.device), sft_loss)
    for model in ctx.actor.models:
        model.zero_grad_buffer()
    ctx.actor.release_freed_host_memory()


def _tagged(memory: dict[str, int], device: torch.device, rename: dict[str, str] | None = None) -> dict[str, int]:
    """A side's ``memory()`` -> the timeline's tags (``rename``d first), plus pinned host copies (CUDA only)."""
    rename = rename or {}
    out = {rename.get(k, k): v for k, v in memory.items() if rename.get(k, k) in TAGS}
    if device.type == "cuda":
        out["host_pinned"] = sum(v for k, v in memory.items() if k.startswith("host/"))
    return out
