"""`make sbatch` without a Slurm: the rendered script, run by bash against stub srun/scontrol, and bad input.

The stubs stand in for Slurm's commands only; the torchrun command line they record is parsed by torch's
own torchrun argument parser, and the USR1 trap runs for real in bash. tests/test_slurm.py submits to a
real (local) Slurm.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from telemetry.tracking import RunWriter
from tools.sbatch import main, slurm_time_seconds

REPO = Path(__file__).resolve().parent.parent

SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$STUB_LOG"
[[ "$1 $2" == "show hostnames" ]] && printf 'node-a\\nnode-b\\n'
exit 0
"""
# srun: records its argv, then either exits (STUB_MODE=exit) or runs until USR1 like a step whose ranks
# checkpoint on the signal
SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_DIR/srun.argv"
[[ $STUB_MODE == exit ]] && exit 0
trap 'echo "srun got USR1" >> "$STUB_LOG"; exit 0' USR1
echo "srun started" >> "$STUB_LOG"
for _ in $(seq 600); do sleep 0.1; done
exit 3
"""


def make_sbatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "sbatch", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def two_node_script(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    proc = make_sbatch("EXP=qwen32b_8xh100", "NODES=2", f"ARGS=output_dir={out} cluster.slurm_time=04:00:00")
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"^rendered (\S+): 2 node\(s\) x 8 ranks \(8 GPUs per node\)$", proc.stdout, re.M)
    assert match, proc.stdout
    assert f"submit with: sbatch {match.group(1)}" in proc.stdout
    return Path(match.group(1))


def run_with_stubs(script: Path, tmp_path: Path, mode: str) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        STUB_DIR=str(tmp_path),
        STUB_LOG=str(tmp_path / "stub.log"),
        STUB_MODE=mode,
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="node-[a-b]",
    )
    return subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_node_script_passes_bash_n_and_asks_slurm_for_the_right_things(two_node_script):
    subprocess.run(["bash", "-n", str(two_node_script)], check=True)
    text = two_node_script.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for expected in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--time=04:00:00",
        "--requeue",
        "--signal=B:USR1@300",
        f"--output={two_node_script.parent}/slurm-%j.out",
    ):
        assert f"#SBATCH {expected}" in directives
    # every directive comes before the first command, or sbatch ignores it
    first_command = next(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    assert all(text.splitlines().index(d) < first_command for d in directives)
    assert "trap on_usr1 USR1" in text
    assert (two_node_script.parent / "config.yaml").is_file()  # prepared before any rank starts


def test_rendered_script_launches_torchrun_on_every_node_with_c10d_rendezvous(two_node_script, tmp_path):
    proc = run_with_stubs(two_node_script, tmp_path, mode="exit")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    argv = (tmp_path / "srun.argv").read_text().splitlines()
    # srun -> bash (agents ignore USR1) -> the repo's python -m torch.distributed.run (= torchrun)
    assert argv[1:4] == ["bash", "-c", 'trap "" USR1; exec "$@"']
    launcher = argv.index("torch.distributed.run")
    assert argv[launcher - 2 : launcher] == [sys.executable, "-m"]
    args = get_args_parser().parse_args(argv[launcher + 1 :])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "8", "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id) == ("node-a:20042", "42")  # first node; port from the job id
    assert args.module and args.training_script == "run.main"
    run_dir = str(two_node_script.parent)
    assert args.training_script_args[:4] == ["--exp", "qwen32b_8xh100", "--run-dir", run_dir]
    assert "cluster.num_nodes=2" in args.training_script_args
    assert f"run dir {run_dir}" in out and "step finished with exit code 0" in out
    assert "scontrol requeue" not in (tmp_path / "stub.log").read_text()


@pytest.mark.parametrize("finished", [False, True])
def test_usr1_is_forwarded_to_the_step_then_the_job_requeues(two_node_script, tmp_path, finished):
    proc = run_with_stubs(two_node_script, tmp_path, mode="wait")
    log = tmp_path / "stub.log"
    deadline = time.monotonic() + 60
    while "srun started" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    summary = two_node_script.parent / "summary.json"
    if finished:
        summary.write_text("{}")
    try:
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does to the batch shell
        out, _ = proc.communicate(timeout=60)
    finally:
        summary.unlink(missing_ok=True)
    calls = log.read_text()
    assert "srun got USR1" in calls and "USR1: time limit in about 300 s" in out
    if finished:
        assert "not requeueing" in out and "scontrol requeue" not in calls
    else:
        assert "scontrol requeue 42" in calls and "requeueing (same job id, same run dir)" in out
    assert proc.returncode == 0  # the step exited 0 after its checkpoint


@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_cpu_experiment_asks_for_one_core_per_rank_and_no_gpus(tmp_path, capsys, engine):
    """cluster.device decides the devices, not the engine: vLLM's CPU build runs a CPU job."""
    assert main(["--exp", "tiny_cpu", f"output_dir={tmp_path}", "trainer.steps=3", f"rollout.engine={engine}"]) == 0
    script = Path(re.search(r"^rendered (\S+):", capsys.readouterr().out, re.M).group(1))
    text = script.read_text()
    assert "#SBATCH --cpus-per-task=2" in text and "--gpus-per-node" not in text
    assert "--nnodes=1 --nproc-per-node=2" in text
    assert '-m run.main --exp tiny_cpu --run-dir "$RUN_DIR" output_dir=' in text
    assert f"export WANDB_RUN_ID=tiny_cpu-{script.parent.name} WANDB_RESUME=allow" in text


def test_time_partition_account_come_from_the_environment_when_the_config_has_none(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SBATCH_TIMELIMIT", "1-00:00:00")
    monkeypatch.setenv("SBATCH_PARTITION", "gpu-long")
    monkeypatch.setenv("SBATCH_ACCOUNT", "envacct")
    args = ["--exp", "tiny_cpu", f"output_dir={tmp_path}", "cluster.slurm_account=cfgacct"]
    assert main(args) == 0
    text = Path(re.search(r"^rendered (\S+):", capsys.readouterr().out, re.M).group(1)).read_text()
    assert "#SBATCH --time=1-00:00:00" in text and "#SBATCH --partition=gpu-long" in text
    assert "#SBATCH --account=cfgacct" in text and "envacct" not in text  # the config wins


@pytest.mark.parametrize(
    "argv,path,expected",
    [
        (["--exp", "nope"], None, "config error: EXP='nope' is not an experiment"),
        (
            ["--exp", "tiny_cpu", "--nodes", "2", "cluster.num_nodes=3"],
            None,
            "NODES=2 disagrees with cluster.num_nodes=3",
        ),
        (["--exp", "tiny_cpu", "--nodes", "0"], None, "NODES='0' must be a positive integer"),
        (["--exp", "tiny_cpu", "--nodes", "2", "actor.dp=1"], None, "!= world size 4; set actor.dp=2"),
        (["--exp", "tiny_cpu", "cluster.slurm_time=4h"], None, "cluster.slurm_time='4h' is not a Slurm time limit"),
        (["--exp", "tiny_cpu", "cluster.slurm_time=3"], None, "(180 s) leaves no time before cluster.slurm_signal"),
        (["--exp", "tiny_cpu", "cluster.slurm_gpus_per_node=4"], None, "one rank per GPU"),
        (["--exp", "tiny_cpu", "cluster.slurm_partition='a b'"], None, "cannot carry"),
        (["--exp", "tiny_cpu", "--submit"], "/nonexistent", "error: SUBMIT=1 needs `sbatch` on PATH"),
    ],
)
def test_bad_input_fails_in_one_line_before_anything_is_written(argv, path, expected, tmp_path, capsys, monkeypatch):
    if path:
        monkeypatch.setenv("PATH", path)
    assert main([*argv, f"output_dir={tmp_path}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err, captured.err
    assert list(tmp_path.iterdir()) == []


def test_make_sbatch_reports_bad_input_in_one_line():
    proc = make_sbatch("EXP=qwen32b_8xh100", "NODES=two")
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[0] == "config error: NODES='two' must be a positive integer"


@pytest.mark.parametrize(
    "text,seconds", [("90", 5400), ("05:30", 330), ("04:00:00", 14400), ("2-12", 216000), ("1-00:30:15", 88215)]
)
def test_slurm_time_formats(text, seconds):
    assert slurm_time_seconds(text, "cluster.slurm_time") == seconds


def test_wandb_run_takes_the_fixed_id_a_requeued_job_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "tiny_cpu-20250101-000000")
    monkeypatch.setenv("WANDB_RESUME", "allow")
    for attempt in range(2):  # the first run and its requeued restart
        writer = RunWriter(tmp_path, {"exp": "unit"}, "offline", "rlmem-test", None, "unit")
        assert writer.wandb_run.id == "tiny_cpu-20250101-000000"
        summary = writer.finish({"steps": attempt})
        # W&B names the offline directory offline-run-<time>-<id>, adding "-1" when a restart lands in
        # the same second as the first attempt: the id is what must match.
        assert re.search(r"-tiny_cpu-20250101-000000(-\d+)?$", Path(summary["wandb_dir"]).name)
