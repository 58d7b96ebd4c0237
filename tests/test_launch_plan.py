"""One memory plan per launch (run.memory_plan.plan_launch): ``python -m run.main`` plans before any rank starts and
hands the plan down; the engine gets the launch plan's KV cache, and a rank plans again only to put in the runtime
level it measured before its engine (CPU: run.memory_plan.with_launch_runtime, one plan) (2 CPU ranks, the real
launcher and loop, stopped once the engine is up)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import planner
import planner.plan


def _counting_make_plan(calls: list[int]):
    real = planner.plan.make_plan

    def counting(inputs):
        calls.append(1)
        return real(inputs)

    return counting


def _rank_counting_plans(cfg, run_dir: str, *launch) -> int:
    """The real run_rank on one spawned rank, with every planner call counted; once the engine is up (fully
    awake after start_rollout) it writes what it saw and stops the run (rank 1 signals, as a preemption would)."""
    import run.loop
    import run.memory_plan

    calls: list[int] = []
    # this rank's process only; run.memory_plan binds make_plan at its import, so it is patched where it is called
    planner.make_plan = planner.plan.make_plan = run.memory_plan.make_plan = _counting_make_plan(calls)
    start_rollout = run.loop.start_rollout

    def start_rollout_recorded(ctx):
        ctx = start_rollout(ctx)
        rank = int(os.environ["RANK"])
        record = {"plan_calls": len(calls), "engine_kv_cache_bytes": ctx.engine.memory()["kv_cache"]}
        (Path(run_dir) / f"rank{rank}_plan.json").write_text(json.dumps(record))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # every rank stops at the same boundary, after the engine start
        return ctx

    run.loop.start_rollout = start_rollout_recorded
    return run.loop.run_rank(cfg, run_dir, *launch)


def test_the_launcher_plans_once_and_the_ranks_use_its_plan(tmp_path, monkeypatch):
    import run.main
    import run.memory_plan

    calls: list[int] = []
    counting = _counting_make_plan(calls)
    for module in (planner, planner.plan, run.memory_plan, run.main):  # where make_plan is looked up
        monkeypatch.setattr(module, "make_plan", counting)
    launches = []

    def recorded_plan_launch(cfg):
        from run.memory_plan import plan_launch

        launches.append(plan_launch(cfg))
        return launches[-1]

    monkeypatch.setattr(run.main, "plan_launch", recorded_plan_launch, raising=False)
    monkeypatch.setattr(run.main, "local_rank", _rank_counting_plans)  # what the launcher hands each rank
    run_dir = tmp_path / "run"
    overrides = ["trainer.steps=2", "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=4", "wandb.mode=disabled"]
    overrides += ["actor.micro_batch_size=16", "rollout.gpu_memory_utilization=auto", f"output_dir={tmp_path}"]
    assert run.main.main(["--exp", "tiny_cpu", "--run-dir", str(run_dir), *overrides]) == 0
    ranks = [json.loads((run_dir / f"rank{r}_plan.json").read_text()) for r in range(2)]
    # on CPU each rank plans once more, with its measured runtime level and the launch's KV cache (no new choice)
    assert [r["plan_calls"] for r in ranks] == [1, 1]
    [launch] = launches  # the launcher's one plan (auto: planned, then planned with the KV cache it chose)
    assert launch.kv_choice.kv_cache_bytes == launch.plan.kv_cache_bytes
    assert 1 <= len(calls) <= 2
    assert [r["engine_kv_cache_bytes"] for r in ranks] == [launch.plan.kv_cache_bytes] * 2


def test_the_plan_ends_rows_where_the_engine_does():
    """Responses stop at the engine's max_model_len (rollout/native/scheduler.py caps prompt + max_tokens there; vLLM
    ends the row with finish reason "length"): the launch plan's rows are no longer than that."""
    from run.compose import compose
    from run.memory_plan import plan_inputs

    capped = plan_inputs(compose("tiny_cpu", ["rollout.max_new_tokens=384"]), prompt_tokens=6)
    assert (capped.prompt_tokens, capped.response_tokens, capped.seq_len) == (6, 250, 256)  # tiny:qwen2: 256 positions
    longer = plan_inputs(compose("tiny_cpu", ["rollout.max_new_tokens=384", "rollout.max_model_len=512"]), 6)
    assert (longer.response_tokens, longer.seq_len) == (384, 390)
