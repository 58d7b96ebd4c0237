"""A stop signal that arrives while the engine starts is honoured as soon as it is up, before any step runs:
the run saves the state after the warm-up (step 0) and exits for a requeue (2 CPU ranks, the real loop)."""

from __future__ import annotations

import json
import os
import signal

from checkpointing.checkpoint import RLState, complete_checkpoints
from tests.dist import run_ranks


def _run_signalled_during_engine_start(rank: int, world_size: int, run_dir: str) -> dict:
    """One rank of a tiny_cpu run whose rank 1 gets SIGTERM while its engine starts; what the rank saw."""
    import run.loop
    import run.setup
    from run.compose import compose
    from run.main import prepare

    cfg = compose("tiny_cpu", ["trainer.steps=2", "trainer.sft_warmup_steps=0", "wandb.mode=disabled"])
    cfg.trainer.prompts_per_step, cfg.actor.micro_batch_size = 4, 16
    prepare(cfg, run_dir)  # the tiny checkpoint and the run directory, as run.main does before the ranks start
    plan_and_build_engine, generate_samples = run.setup.plan_and_build_engine, run.loop.generate_samples
    steps_sampled = []

    def plan_and_build_engine_signalled(ctx):
        ctx = plan_and_build_engine(ctx)
        if rank == 1:  # the signal reaches one rank: every rank must stop at the same boundary
            os.kill(os.getpid(), signal.SIGTERM)
        return ctx

    def generate_samples_counted(*args, **kwargs):
        steps_sampled.append(1)
        return generate_samples(*args, **kwargs)

    run.setup.plan_and_build_engine, run.loop.generate_samples = plan_and_build_engine_signalled, generate_samples_counted
    code = run.loop.run_rank(cfg, run_dir)
    return {"code": code, "steps_sampled": len(steps_sampled)}


def test_sigterm_while_the_engine_starts_saves_step_0_before_any_rollout(tmp_path):
    from run.launch import PREEMPTED_EXIT_CODE

    run_dir = tmp_path / "run"
    results = run_ranks(_run_signalled_during_engine_start, 2, str(run_dir), timeout_s=600)
    assert [r["code"] for r in results] == [PREEMPTED_EXIT_CODE] * 2
    assert [r["steps_sampled"] for r in results] == [0, 0]  # stopped before the first step's rollout
    [checkpoint] = complete_checkpoints(run_dir / "checkpoints")
    assert checkpoint.name == "step_00000000" and RLState.read(checkpoint).completed_steps == 0
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    assert not (run_dir / "summary.json").exists()
    assert json.loads((checkpoint / "rl_state.json").read_text())["completed_steps"] == 0
