"""The colocated RL loop: one GRPO step per iteration, its phases named and ordered as in DESIGN.md.

Every rank runs :func:`run_rank`. The actor (megatron-core, TP x PP x DP) and the rollout engine
(rollout TP x replicas) share each rank's device; :func:`rl_step` is the paper-level view of a step,
the helpers below it do the bookkeeping.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl.advantages import grpo_advantages
from rl.config import RunConfig
from rl.data import DigitSumTask, Gsm8kTask, Problem
from rl.losses import PolicyLoss, sft_loss
from rl.memory import PHASES, TAGS, MemoryProbe, MemoryTimeline, phase_peaks, window_peak
from rl.tracking import RunWriter
from rl.weight_sync.sync import WeightSync


def rl_step(ctx: Context, step: int) -> dict[str, float]:
    """One RL step, per rank, in DESIGN.md's phase order."""
    cfg, actor, engine, phase = ctx.cfg, ctx.actor, ctx.engine, ctx.phase
    problems = ctx.task.sample(cfg.trainer.prompts_per_step)  # the same prompts on every rank
    with phase("rollout", step):
        samples = ctx.generate(problems)
    with phase("engine_sleep", step):
        engine.sleep(["weights", "kv_cache"])
    for what in ("params", "grads", "optimizer"):
        with phase(f"onload_{what}", step):
            if ctx.offloaded(what):
                actor.onload(what)
    batch, rewards = ctx.make_batch(samples)
    with phase("old_logprob", step):
        batch["old_logprobs"] = actor.compute_logprobs(batch, phase="old_logprob")
    mismatch = ctx.engine_actor_logprob_diff(batch)
    with phase("ref_logprob", step):
        if ctx.ref_actor is not None:
            batch["ref_logprobs"] = ctx.ref_actor.compute_logprobs(batch, phase="ref_logprob")
    with phase("train", step):
        for _ in range(cfg.trainer.ppo_epochs):
            train_metrics = actor.train_step(batch, ctx.loss)
    for what in ("optimizer", "grads"):
        with phase(f"offload_{what}", step):
            if ctx.offloaded(what):
                actor.offload(what)
    with phase("wake_weights", step):
        engine.wake_up(["weights"] if cfg.rollout.wake_strategy == "staged" else ["weights", "kv_cache"])
    with phase("weight_sync", step):
        ctx.sync_weights()
    with phase("offload_params", step):
        if ctx.offloaded("params"):
            actor.offload("params")
    with phase("wake_kv_cache", step):
        if cfg.rollout.wake_strategy == "staged":
            engine.wake_up(["kv_cache"])
    return {**ctx.step_metrics(samples, rewards, train_metrics), "rollout/engine_actor_logprob_diff_max": mismatch}


@dataclass
class Sample:
    problem_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    reward: float


@dataclass
class Context:
    """Everything one rank holds for the run; built by :func:`setup`."""

    cfg: RunConfig
    run_dir: Path
    rank: int
    world_size: int
    dims: Any  # megatron_backend.parallel.ParallelDims
    actor: Any
    ref_actor: Any
    engine: Any
    engine_group: Any
    engine_replica: int
    tokenizer: Any
    task: Any
    loss: PolicyLoss
    weight_sync: WeightSync
    timeline: MemoryTimeline
    writer: RunWriter | None
    sampling: Any
    t0: float = field(default_factory=time.monotonic)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    sync_history: list = field(default_factory=list)
    warmup_losses: list = field(default_factory=list)
    rollout_tokens: int = 0
    train_tokens: int = 0

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        assert name in PHASES, name
        start = time.monotonic()
        with self.timeline.phase(name, step):
            yield
        self.phase_seconds[name] = time.monotonic() - start

    def offloaded(self, what: str) -> bool:
        return bool(getattr(self.cfg.actor.offload, what))

    # ------------------------------------------------------------------ rollout
    def generate(self, problems: list[Problem]) -> list[Sample]:
        """Replica i generates prompts i, i + R, ...; every rank then holds every sample."""
        num_replicas = self.world_size // self.cfg.rollout.tp
        mine = list(range(self.engine_replica, len(problems), num_replicas))
        prompt_ids = [self.tokenizer(problems[i].prompt).input_ids for i in mine]
        completions = self.engine.generate(prompt_ids, self.sampling) if mine else []
        local = []
        for index, per_prompt in zip(mine, completions):
            for c in per_prompt:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                reward = self.task.reward(text, problems[index].answer)
                local.append(
                    Sample(
                        index,
                        prompt_ids[mine.index(index)],
                        list(c.token_ids),
                        list(c.logprobs),
                        c.finish_reason,
                        reward,
                    )
                )
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (self.engine_replica, local))
        by_replica = dict(gathered)  # TP ranks of one replica hold identical samples
        samples = [s for replica in sorted(by_replica) for s in by_replica[replica]]
        samples.sort(key=lambda s: s.problem_index)  # samples of one prompt adjacent (GRPO groups)
        self.rollout_tokens = sum(len(s.response_ids) for s in samples)
        return samples

    # ------------------------------------------------------------------ batch
    def make_batch(self, samples: list[Sample]) -> tuple[dict, torch.Tensor]:
        """This DP rank's share of the step: right-padded tokens, loss mask, GRPO advantages."""
        rewards = torch.tensor([s.reward for s in samples])
        advantages = grpo_advantages(rewards, group_size=self.cfg.rollout.n_samples_per_prompt)
        dp, dp_rank = self.dims.dp, self.dims.dp_rank
        per_rank = len(samples) // dp
        share = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        batch = pack_sequences(samples[share], pad_id=self.tokenizer.pad_token_id or 0)
        batch["advantages"] = advantages[share]
        self.train_tokens = int(batch["loss_mask"].sum()) * dp
        return {k: v.to(self.dims.device) for k, v in batch.items()}, rewards

    def engine_actor_logprob_diff(self, batch: dict) -> float:
        """max |engine log-prob - actor log-prob| over this DP rank's response tokens: the two must agree
        (same weights, fp32 here), so a jump shows a broken weight sync or a layout bug at once."""
        mask = batch["loss_mask"] > 0
        return float((batch["old_logprobs"] - batch["engine_logprobs"])[mask].abs().max()) if mask.any() else 0.0

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> None:
        dst = self.engine.begin_weight_update()
        result = self.weight_sync(self.actor.local_params(), dst)
        self.engine.finish_weight_update()
        self.sync_history.append(result)

    # ------------------------------------------------------------------ metrics
    def step_metrics(self, samples: list[Sample], rewards: torch.Tensor, train: dict[str, float]) -> dict[str, float]:
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        seconds = dict(self.phase_seconds)
        sync = self.sync_history[-1].stats
        out = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/accuracy": float((rewards >= 1.0).float().mean()),
            "response/length_mean": float(lengths.mean()),
            "perf/rollout_tokens_per_s": self.rollout_tokens / max(seconds.get("rollout", 0.0), 1e-9),
            "perf/train_tokens_per_s": self.train_tokens / max(seconds.get("train", 0.0), 1e-9),
            "weight_sync/bytes_sent": sync.bytes_sent,
            "weight_sync/seconds": sync.seconds,
        }
        out.update({f"train/{k}": float(v) for k, v in train.items()})
        out.update({f"time/{k}": v for k, v in seconds.items()})
        return out


def pack_sequences(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids [B, S] = prompt + response, right-padded; loss_mask [B, S-1] on response targets."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len = max(lengths)
    input_ids = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), seq_len - 1), dtype=torch.float32)
    engine_logprobs = torch.zeros((len(samples), seq_len - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        input_ids[i, : len(tokens)] = torch.tensor(tokens)
        # target position t predicts input_ids[t + 1]; response tokens start at len(prompt)
        loss_mask[i, len(s.prompt_ids) - 1 : len(tokens) - 1] = 1.0
        if s.response_logprobs:
            engine_logprobs[i, len(s.prompt_ids) - 1 : len(tokens) - 1] = torch.tensor(s.response_logprobs)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "engine_logprobs": engine_logprobs}


def setup(cfg: RunConfig, run_dir: Path) -> Context:
    """Process groups, actor (+ reference), engine, weight-sync plan, memory timeline, run writer."""
    from transformers import AutoTokenizer

    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.weight_sync.layouts import actor_coords
    from rollout import SamplingParams, make_engine

    dims = initialize_model_parallel(cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, seed=cfg.actor.seed)
    rank, world_size = dims.rank, dims.world_size
    if actor_coords(rank, dims.tp, dims.pp, world_size) != (dims.tp_rank, dims.pp_rank, dims.dp_rank):
        raise RuntimeError("megatron's rank order is not tp-dp-pp; the weight-sync plan would be wrong")
    # Engine TP groups: ranks [i * rollout.tp, (i + 1) * rollout.tp) form replica i (every rank makes every group).
    rtp = cfg.rollout.tp
    engine_groups = [dist.new_group(list(range(i * rtp, (i + 1) * rtp))) for i in range(world_size // rtp)]
    replica = rank // rtp

    probe = MemoryProbe(dims.device)
    timeline = MemoryTimeline(probe, rank, interval_s=cfg.trainer.memory_sample_interval_s)
    actor = Actor(cfg.model.path, cfg.actor, dims, dtype=cfg.model.dtype)
    ref_actor = (
        Actor(cfg.model.path, cfg.actor, dims, dtype=cfg.model.dtype, train=False)
        if cfg.algorithm.kl_coef > 0
        else None
    )
    engine = make_engine(
        cfg.rollout,
        cfg.model.path,
        group=engine_groups[replica] if rtp > 1 else None,
        device=dims.device,
        dtype=cfg.model.dtype,
        load=False,
    )
    probe.add_ledger(lambda: _tagged(actor.memory(), dims.device))
    probe.add_ledger(lambda: _tagged(engine.memory(), dims.device))
    if ref_actor is not None:
        probe.add_ledger(
            lambda: {k: v for k, v in _tagged(ref_actor.memory(), dims.device).items() if k == "host_pinned"}
        )
    element_bytes = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    weight_sync = WeightSync(
        actor.hf_config,
        rank,
        world_size,
        dims.tp,
        dims.pp,
        dims.vpp,
        rtp,
        cfg.weight_sync.bucket_mb,
        element_bytes,
        cfg.weight_sync.verify,
        te_norms=actor.layout.te_norms,
    )
    writer = None
    if rank == 0:
        writer = RunWriter(
            run_dir, cfg, cfg.wandb.mode, cfg.wandb.project, cfg.wandb.entity, f"{cfg.exp}-{run_dir.name}"
        )
    task = (
        Gsm8kTask(cfg.data.path, seed=cfg.trainer.seed)
        if cfg.data.task == "gsm8k"
        else DigitSumTask(cfg.trainer.seed, cfg.data.max_operand)
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    sampling = SamplingParams.from_config(cfg.rollout, seed=cfg.trainer.seed + replica)
    return Context(
        cfg=cfg,
        run_dir=run_dir,
        rank=rank,
        world_size=world_size,
        dims=dims,
        actor=actor,
        ref_actor=ref_actor,
        engine=engine,
        engine_group=engine_groups[replica],
        engine_replica=replica,
        tokenizer=tokenizer,
        task=task,
        loss=PolicyLoss(cfg.algorithm),
        weight_sync=weight_sync,
        timeline=timeline,
        writer=writer,
        sampling=sampling,
    )


def _tagged(memory: dict[str, int], device: torch.device) -> dict[str, int]:
    """A side's ``memory()`` -> the timeline's tags, plus pinned host copies (CUDA only)."""
    out = {k: v for k, v in memory.items() if k in TAGS}
    if device.type == "cuda":
        out["host_pinned"] = sum(v for k, v in memory.items() if k.startswith("host/"))
    return out


def warmup(ctx: Context) -> list[float]:
    """Optional supervised warm-up on the task's format examples (trainer.sft_warmup_steps); returns its losses."""
    losses = []
    for _ in range(ctx.cfg.trainer.sft_warmup_steps):
        examples = ctx.task.format_examples(ctx.cfg.trainer.prompts_per_step * ctx.cfg.rollout.n_samples_per_prompt)
        samples = [
            Sample(
                i,
                ctx.tokenizer(e.prompt).input_ids,
                ctx.tokenizer(e.answer).input_ids + [ctx.tokenizer.eos_token_id],
                [],
                "stop",
                0.0,
            )
            for i, e in enumerate(examples)
        ]
        batch = pack_sequences(samples[ctx.dims.dp_rank :: ctx.dims.dp], pad_id=ctx.tokenizer.pad_token_id or 0)
        metrics = ctx.actor.train_step({k: v.to(ctx.dims.device) for k, v in batch.items()}, sft_loss)
        losses.append(float(metrics["sft_loss"]))
    return losses


def run_rank(cfg: RunConfig, run_dir: str) -> None:
    """Everything one rank does for a run."""
    import warnings

    from tqdm import tqdm

    # megatron-core warns at import about missing Apex / Transformer Engine / CUDA env vars; on CPU that is expected
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    ctx = setup(cfg, Path(run_dir))
    ctx.warmup_losses = warmup(ctx)
    if ctx.rank == 0 and ctx.warmup_losses:
        print(f"supervised warm-up: loss {ctx.warmup_losses[0]:.3f} -> {ctx.warmup_losses[-1]:.3f}", flush=True)
    ctx.sync_weights()  # the engine starts from the actor's weights
    for what in ("optimizer", "grads", "params"):
        if ctx.offloaded(what):
            ctx.actor.offload(what)
    rewards: list[float] = []
    all_rows: list[dict] = []
    progress = tqdm(range(cfg.trainer.steps), desc=f"{cfg.exp}", disable=ctx.rank != 0, dynamic_ncols=True)
    for step in progress:
        metrics = rl_step(ctx, step)
        rows = ctx.timeline.take_rows()
        gathered: list | None = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if ctx.writer is not None:
            step_rows = [r for per_rank in gathered for r in per_rank]
            all_rows += step_rows
            ctx.writer.log_timeline(step_rows)
            peaks = ctx.writer.log_step(step, metrics, step_rows)
            rewards.append(metrics["reward/mean"])
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", peak_mib=f"{max(peaks.values()) / 2**20:.0f}")
    if ctx.writer is not None:
        ctx.writer.finish(summarize(ctx, rewards, all_rows))
    dist.barrier()


def summarize(ctx: Context, rewards: list[float], rows: list[dict]) -> dict:
    syncs = ctx.sync_history[1:]  # the initial sync is setup, not a step
    per_rank_window = {
        r: window_peak([row for row in rows if row["rank"] == r], "wake_weights", "wake_kv_cache")
        for r in range(ctx.world_size)
    }
    return {
        "exp": ctx.cfg.exp,
        "steps": len(rewards),
        "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
        "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "phase_peak_bytes": phase_peaks(rows),
        "wake_window_peak_bytes": max(per_rank_window.values(), default=0),
        "actor_param_bytes": ctx.actor.memory().get("host/actor_params", 0)
        or ctx.actor.memory().get("actor_params", 0),
        "wake_strategy": ctx.cfg.rollout.wake_strategy,
        "weight_sync": {
            "bytes": ctx.weight_sync.plan.bytes_moved,  # all ranks, per sync
            "seconds": sum(s.stats.seconds for s in syncs) / max(1, len(syncs)),
            "verified": bool(syncs) and all(s.verified for s in syncs),
            "plan_bytes_moved": ctx.weight_sync.plan.bytes_moved,
            "bucket_bytes": ctx.weight_sync.plan.bucket_bytes,
        },
        "warmup_sft_loss": ctx.warmup_losses[-1] if ctx.warmup_losses else None,
        "wall_seconds": time.monotonic() - ctx.t0,
    }
