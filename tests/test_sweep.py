"""``make sweep`` / ``make sweep-local`` (tools/sweep/): the grid from the YAML, the agent's command line,
validation before launch, the summary table and plot, the rendered Slurm array, and one real local sweep (slow).

The agent's command line is checked against wandb's own ``Agent._command_run`` (only the process it would
start is recorded, by a stand-in with AgentProcess's real signature).
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner import PHASES
from tools.sweep import agent as sweep_agent
from tools.sweep import grid as sweep_grid
from tools.sweep import points as sweep_points
from tools.sweep import summary as sweep_summary
from tools.sweep import trial as sweep_trial

REPO = Path(__file__).resolve().parent.parent
SMOKE_ARGS = ["trainer.steps=2", "trainer.sft_warmup_steps=2"]


def test_every_sweep_file_loads_and_its_points_compose():
    names = sorted(p.stem for p in sweep_grid.SWEEPS_DIR.glob("*.yaml"))
    assert {"util_offload", "cpu_smoke"} <= set(names)
    for name in names:
        grid = sweep_grid.grid_points(sweep_grid.load_sweep(name))
        assert len(grid) == len({json.dumps(p, sort_keys=True) for p in grid})  # no point twice


def test_grid_is_w_and_bs_order_sorted_parameters_last_fastest():
    grid = sweep_grid.grid_points(sweep_grid.load_sweep("util_offload"))
    assert len(grid) == 4 * 2 * 2 * 2 * 2
    assert list(grid[0]) == sorted(grid[0])  # parameters by name
    assert grid[0] == {
        "actor.offload.grads": True,
        "actor.offload.optimizer": True,
        "actor.offload.params": True,
        "rollout.gpu_memory_utilization": 0.3,
        "rollout.wake_strategy": "staged",
    }
    assert grid[1]["rollout.wake_strategy"] == "all_at_once" and grid[2]["rollout.gpu_memory_utilization"] == 0.5
    assert grid[-1]["actor.offload.grads"] is False and grid[-1]["rollout.gpu_memory_utilization"] == 0.9
    constant = {"method": "grid", "parameters": {"b": {"values": [1, 2]}, "a": {"value": "x"}}}
    assert sweep_grid.grid_points(constant) == [{"a": "x", "b": 1}, {"a": "x", "b": 2}]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("method: random\nparameters: {a: {values: [1]}}\ncommand: ['${args_no_hyphens}']", "method must be grid"),
        ("method: grid\nparameters: {a: {values: [1]}}\ncommand: [python]", "holding ${args_no_hyphens} once"),
        ("method: grid\nparameters: {a: {min: 0, max: 1}}\ncommand: ['${args_no_hyphens}']", "parameters.a: a grid"),
    ],
)
def test_bad_sweep_files_fail_in_one_line(text, expected, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(sweep_grid.SweepError, match=None) as info:
        sweep_grid.load_sweep(str(path))
    assert expected in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(sweep_grid.SweepError, match="SWEEP='nope' is not a sweep; choose one of"):
        sweep_grid.load_sweep("nope")


def test_local_command_is_what_w_and_bs_agent_runs(tmp_path, monkeypatch):
    import wandb.wandb_agent as wandb_agent

    sweep = sweep_grid.load_sweep("cpu_smoke")
    point = sweep_grid.grid_points(sweep)[3]
    fixed = ["trainer.steps=2"]
    command = sweep_grid.with_fixed_overrides(sweep["command"], fixed)
    env = {sweep_agent.EXP_ENV: "tiny_cpu", sweep_agent.RUN_DIR_ENV: str(tmp_path / "run")}
    ours = sweep_agent.agent_command(dict(sweep, command=command), point, env, "python")

    started = []

    class RecordingProcess:  # stands in for the process the agent would start; same signature
        def __init__(self, env=None, command=None, function=None, run_id=None, in_jupyter=None, forward_signals=False):
            started.append(command)

    assert inspect.signature(RecordingProcess) == inspect.signature(wandb_agent.AgentProcess)
    monkeypatch.setattr(wandb_agent, "AgentProcess", RecordingProcess)
    for key, value in {**env, "WANDB_DIR": str(tmp_path), "WANDB_SWEEP_ID": "abc123"}.items():
        monkeypatch.setenv(key, value)
    agent = wandb_agent.Agent(api=None, queue=None, sweep_id="abc123")
    agent._sweep_command = command
    agent._command_run({"run_id": "r1", "program": None, "args": {k: {"value": v} for k, v in point.items()}})
    assert started == [ours]
    assert ours == [
        "/usr/bin/env", "python", "-m", "run.main", "--exp", "tiny_cpu", "--run-dir", str(tmp_path / "run"),
        "trainer.steps=2", "actor.offload.params=True", "rollout.gpu_memory_utilization=0.5",
        "rollout.wake_strategy=all_at_once",
    ]  # fmt: skip


def test_infeasible_points_are_found_before_launch_with_their_reason():
    grid = [
        {"rollout.gpu_memory_utilization": 0.02},  # no room for a KV cache: the planner says so
        {"rollout.gpu_memory_utilization": 0.5},
        {"rollout.gpu_memory_utilization": 1.5},  # not a valid config
    ]
    points = sweep_points.validate("tiny_cpu", SMOKE_ARGS, grid)
    assert [p.status for p in points] == ["infeasible", "pending", "infeasible"]
    assert points[0].reason.startswith("plan on cpu: DOES NOT FIT: the KV cache")
    assert points[1].plan.fits and points[1].cfg.trainer.steps == 2
    assert points[2].reason.startswith("config: rollout.gpu_memory_utilization=1.5 is outside (0, 1]")
    big = sweep_points.validate(
        "qwen32b_8xh100", [], [{"actor.offload.params": False, "rollout.gpu_memory_utilization": 0.9}]
    )
    assert "plan on H100-80GB: DOES NOT FIT: rollout needs" in big[0].reason


def test_args_may_not_set_a_swept_key():
    grid = sweep_grid.grid_points(sweep_grid.load_sweep("cpu_smoke"))
    with pytest.raises(sweep_grid.SweepError, match="ARGS sets rollout.wake_strategy=staged, which the sweep varies"):
        sweep_grid.check_fixed(["trainer.steps=2", "rollout.wake_strategy=staged"], grid)


def fake_run(
    run_dir: Path,
    peaks: dict[int, dict[str, int]],
    step_seconds: list[float],
    reward: float,
    summary: dict | None = None,
) -> None:
    """A run directory as run.main leaves it: timeline rows per rank, step and phase (step 0 twice the peaks of
    step 1: the warm-up step a steady figure leaves out), metrics per step, summary.json."""
    run_dir.mkdir(parents=True)
    with open(run_dir / "memory_timeline.csv", "w", newline="") as f:
        fields = ["t_s", "step", "phase", "rank", "device_peak", "device_allocated", "tag/kv_cache"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for step, scale in ((0, 2), (1, 1)):
            for rank, per_phase in peaks.items():
                for phase, value in per_phase.items():
                    row = dict(step=step, phase=phase, rank=rank, device_allocated=1, **{"tag/kv_cache": 7 * 2**20})
                    writer.writerow(dict(row, t_s=0.1, device_peak=scale * value // 2))
                    writer.writerow(dict(row, t_s=0.2, device_peak=scale * value))
    steps = [{"trainer/step": i, "time/rollout": s * 0.75, "time/train": s * 0.25} for i, s in enumerate(step_seconds)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    summary = {
        "steps": len(steps),
        "reward_last5": reward,
        "memory_peak_method": "rss_high_water_mark",
        **(summary or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_table_and_chart_compare_each_figure_planned_and_measured(tmp_path):
    from telemetry.memory_timeline import FIGURES, FIGURES_KEY, PEAK_METHODS, wake_window_phases

    grid = [{"rollout.gpu_memory_utilization": u} for u in (0.02, 0.5, 0.6, 0.7)]
    points = sweep_points.validate("tiny_cpu", SMOKE_ARGS, grid)
    mib = 2**20
    ranks = {0: {ph: 100 * mib for ph in PHASES}, 1: {ph: 100 * mib for ph in PHASES}}
    ranks[1]["train"] = 300 * mib  # rank 1's train: the train peak
    ranks[0][wake_window_phases()[-1]] = 200 * mib  # rank 0's last wake phase: the wake-window peak
    # point 1: a run whose summary.json has no figures (stopped before them): measured from its timeline's
    # steady step, planned by the launch-time check like a point not run
    fake_run(tmp_path / "p1", ranks, step_seconds=[4.0, 2.0, 3.0], reward=0.25)
    # point 2: a run with its own plan and measurements in summary.json: those are its figures
    own = {
        f"{kind}_{f}_bytes": (9 if kind == "planned" else 8) * mib for f in FIGURES for kind in ("planned", "measured")
    }
    fake_run(tmp_path / "p2", ranks, step_seconds=[1.0], reward=0.5, summary={FIGURES_KEY: own})
    for point, run in ((points[1], "p1"), (points[2], "p2")):
        point.result, point.status = sweep_trial.collect_result(tmp_path / run), "ok"
    points[3].status, points[3].reason = "not run", "interrupted"
    rows = sweep_summary.table_rows(points)

    # a point that ran: every figure measured over the steady step (not step 0's doubled peaks), max over ranks,
    # beside the plan plus its runtime overhead (what a measurement includes), as the run itself compares them
    plan = points[1].plan
    assert rows[1]["measured_train_peak_bytes"] == 300 * mib and rows[1]["measured_rollout_peak_bytes"] == 100 * mib
    assert rows[1]["measured_wake_window_peak_bytes"] == 200 * mib and rows[1]["measured_kv_cache_bytes"] == 7 * mib
    assert rows[1]["planned_train_peak_bytes"] == plan.phase("train").predicted_bytes + plan.runtime_overhead_bytes
    assert (
        rows[1]["planned_wake_window_peak_bytes"] == plan.wake_window_peak.predicted_bytes + plan.runtime_overhead_bytes
    )
    assert rows[1]["planned_kv_cache_bytes"] == plan.kv_cache_bytes > 0 and rows[1]["planned_by"] == "launch check"
    assert rows[1]["step_seconds"] == 3.0 and rows[1]["reward"] == 0.25  # median over steps
    assert all(rows[2][k] == v for k, v in own.items()) and rows[2]["planned_by"] == "run"
    # not run: planned like the others, nothing measured; an infeasible one keeps its plan and its reason
    assert rows[3]["planned_rollout_peak_bytes"] > 0 and rows[3]["measured_rollout_peak_bytes"] is None
    assert rows[0]["status"] == "infeasible" and "KV cache" in rows[0]["reason"]
    assert rows[0]["planned_train_peak_bytes"] == points[0].plan.measurable_bytes("train")
    assert all(rows[0][f"measured_{f}_bytes"] is None for f in FIGURES)
    assert {r["peak_method"] for r in rows} == {"rss_high_water_mark"}

    params = list(grid[0])
    sweep_summary.write_csv(rows, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv", newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["status"] for r in read] == ["infeasible", "ok", "ok", "not run"]
    assert int(read[1]["measured_train_peak_bytes"]) == 300 * mib and read[0]["measured_train_peak_bytes"] == ""
    sweep_summary.write_markdown(rows, params, tmp_path / "summary.md", title="t")
    md = (tmp_path / "summary.md").read_text()
    header = "| # | util | status | wake-window peak MiB plan / meas. | rollout peak MiB plan / meas. |"
    assert header in md and "| KV cache MiB plan / meas. | step s | reward |" in md
    planned_train = f"{rows[1]['planned_train_peak_bytes'] / mib:.1f}"
    assert f"| 1 | 0.500 | ok | {rows[1]['planned_wake_window_peak_bytes'] / mib:.1f} / 200.0 |" in md
    assert f"| {planned_train} / 300.0 |" in md and "| 2 | 0.600 | ok | 9.0 / 8.0 | 9.0 / 8.0 |" in md
    assert "- 00_util=0.02: infeasible: plan on cpu: DOES NOT FIT" in md and "- 03_util=0.7: not run: interrupted" in md
    assert PEAK_METHODS["rss_high_water_mark"] in md
    assert sweep_summary.format_table(rows, params) in md
    sweep_summary.plot_figures(rows, params, tmp_path / "peak.png", title="t")
    assert (tmp_path / "peak.png").stat().st_size > 10_000


def test_the_legend_names_what_is_measured_on_each_device():
    assert "RSS" in sweep_summary.measured_legend([{"peak_method": "rss_high_water_mark"}])
    cuda = sweep_summary.measured_legend([{"peak_method": "cuda_allocator_peak"}])
    assert "torch.cuda.mem_get_info" in cuda and "NVML" not in cuda
    point = sweep_points.validate("qwen2.5_0.5b_1xh200", [], [{"rollout.gpu_memory_utilization": 0.5}])[0]
    assert sweep_summary.table_rows([point])[0]["peak_method"] == "cuda_allocator_peak"


def create(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.sweep", "create", *args, f"output_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_CONFIG_DIR": str(tmp_path / "wandb")},
    )


def test_rendered_array_runs_one_agent_per_task_and_passes_bash_n(tmp_path):
    proc = create(
        tmp_path, "--sweep", "cpu_smoke", "--exp", "tiny_cpu", "--sweep-id", "ent/proj/abc123", "--allow-infeasible"
    )
    assert proc.returncode == 0, proc.stderr
    assert "8 points, 4 fit tiny_cpu on cpu (planner), 4 do not" in proc.stdout
    script = next(tmp_path.glob("tiny_cpu/sweep-cpu_smoke-*/sweep.sbatch"))
    assert f"all points on Slurm: sbatch {script}" in proc.stdout
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "#SBATCH --array=1-8\n" in text and "#SBATCH --cpus-per-task=2\n" in text and "{{" not in text
    uploaded = yaml.safe_load((script.parent / "sweep.yaml").read_text())
    assert (
        uploaded["name"] == "cpu_smoke-tiny_cpu"
        and uploaded["parameters"] == sweep_grid.load_sweep("cpu_smoke")["parameters"]
    )
    assert uploaded["command"][-3:] == ["wandb.mode=online", f"output_dir={tmp_path}", "${args_no_hyphens}"]

    # run the task as Slurm would, with a stand-in interpreter that records how it was asked to start the agent
    fake_python = tmp_path / "bin" / "python"
    fake_python.parent.mkdir()
    fake_python.write_text(
        '#!/bin/bash\nprintf "%s\\n" "$@" "$RLMEM_EXP" "$RLMEM_RUN_DIR" "$(command -v python)" > "$OUT"\n'
    )
    fake_python.chmod(0o755)
    out = tmp_path / "agent.txt"
    env = {**os.environ, "RLMEM_PYTHON": str(fake_python), "OUT": str(out), "SLURM_ARRAY_TASK_ID": "3",
           "SLURM_ARRAY_JOB_ID": "77"}  # fmt: skip
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert out.read_text().splitlines() == [
        "-m", "wandb", "agent", "--count", "1", "ent/proj/abc123", "tiny_cpu", f"{script.parent}/task-3", str(fake_python),
    ]  # fmt: skip


def test_gpu_experiment_array_asks_for_its_gpus(tmp_path):
    proc = create(
        tmp_path,
        "--sweep",
        "util_offload",
        "--exp",
        "qwen2.5_0.5b_1xh200",
        "--sweep-id",
        "e/p/x1",
        "--allow-infeasible",
    )
    assert proc.returncode == 0, proc.stderr
    text = next(tmp_path.glob("qwen2.5_0.5b_1xh200/sweep-util_offload-*/sweep.sbatch")).read_text()
    assert "#SBATCH --array=1-64\n" in text and "#SBATCH --gpus-per-node=1\n" in text


def test_create_refuses_infeasible_points_and_multi_node_experiments_in_one_line(tmp_path):
    proc = create(tmp_path, "--sweep", "cpu_smoke", "--exp", "tiny_cpu", "--sweep-id", "ent/proj/abc123")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: 4 of 8 points do not fit (listed above)") and proc.stderr.count("\n") == 1
    assert "skip 00_offload.params=True_util=0.02_wake=staged: plan on cpu: DOES NOT FIT" in proc.stdout
    proc = create(tmp_path, "--sweep", "util_offload", "--exp", "qwen32b_16xh100", "--sweep-id", "e/p/x1")
    assert proc.returncode == 2 and "one agent per array task on one node" in proc.stderr
    assert not list(tmp_path.glob("*/sweep-*"))  # nothing rendered


def test_without_an_api_key_wandb_sweep_fails_in_one_line_and_leaves_nothing(tmp_path):
    proc = create(tmp_path, "--sweep", "cpu_smoke", "--exp", "tiny_cpu", "--allow-infeasible")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: wandb sweep failed (") and proc.stderr.count("\n") == 1
    assert "needs network and a W&B API key" in proc.stderr
    assert not list(tmp_path.glob("tiny_cpu/sweep-*"))


def test_sweep_local_runs_its_points_and_skips_the_infeasible_ones(tmp_path):
    sweep = sweep_grid.load_sweep("cpu_smoke")
    sweep["parameters"] = {
        "rollout.gpu_memory_utilization": {"values": [0.02, 0.5]},
        "rollout.wake_strategy": {"values": ["staged", "all_at_once"]},
    }
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(sweep))
    args = ["trainer.steps=1", "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=4", "actor.micro_batch_size=16",
            "wandb.mode=disabled", f"output_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tools.sweep", "local", "--sweep", str(path), "--exp", "tiny_cpu", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 points, 2 fit tiny_cpu on cpu (planner), 2 do not" in proc.stdout
    sweep_dir = next(tmp_path.glob("tiny_cpu/sweep-two-*"))
    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["infeasible", "infeasible", "ok", "ok"]
    from telemetry.memory_timeline import FIGURES

    for row in rows[2:]:
        assert all(int(row[f"{kind}_{f}_bytes"]) > 0 for f in FIGURES for kind in ("planned", "measured"))
        assert row["planned_by"] == "run" and row["peak_method"] == "rss_high_water_mark"
        assert float(row["step_seconds"]) > 0 and 0 <= float(row["reward"]) <= 1
        assert (Path(row["run_dir"]) / "summary.json").is_file()
    assert (sweep_dir / "summary.md").is_file() and (sweep_dir / "peak_memory.png").stat().st_size > 10_000
