"""`make sbatch SUBMIT=1` on a real Slurm: the local single-node one from .ci/slurm-up (`make test-slurm`).

The cluster has no accounting (no sacct): jobs are followed with `scontrol show job`, which keeps
finished jobs for MinJobAge (1 h in the local slurm.conf).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and proc.stdout.strip() != ""


@pytest.fixture(scope="module", autouse=True)
def local_slurm() -> None:
    """A Slurm that answers: the one already running, else the local one .ci/slurm-up starts (needs root)."""
    if not slurm_answers():
        proc = subprocess.run([str(REPO / ".ci" / "slurm-up")], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"no Slurm answers and .ci/slurm-up failed:\n{proc.stdout}{proc.stderr}"
    assert slurm_answers()


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(job_id: str, done, timeout_s: float, log: Path) -> dict[str, str]:
    """Poll `scontrol show job` until ``done(fields)``; on timeout cancel the job and fail with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = job_fields(job_id)
        if done(fields):
            return fields
        time.sleep(2)
    subprocess.run(["scancel", job_id])
    tail = log.read_text()[-3000:] if log.exists() else "(no log)"
    pytest.fail(f"job {job_id} not done after {timeout_s:.0f} s: {job_fields(job_id).get('JobState')}\n{tail}")


def submit(tmp_path: Path, args: str, *make_args: str) -> tuple[str, Path, Path]:
    """`make sbatch EXP=tiny_cpu SUBMIT=1 [make_args] ARGS=...` -> (job id, run dir, its Slurm log)."""
    proc = subprocess.run(
        ["make", "-s", "sbatch", "EXP=tiny_cpu", "SUBMIT=1", *make_args, f"ARGS={args} output_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"^job id: (\d+)$", proc.stdout, re.M).group(1)
    run_dir = Path(re.search(r"^run dir: (\S+)$", proc.stdout, re.M).group(1))
    assert run_dir.parent.parent == tmp_path and (run_dir / "job.sbatch").is_file()
    return job_id, run_dir, run_dir / f"slurm-{job_id}.out"


def test_make_sbatch_submit_runs_tiny_cpu_to_its_summary(tmp_path):
    job_id, run_dir, log = submit(tmp_path, "trainer.steps=3")
    fields = wait_for(job_id, lambda f: f.get("JobState") in FINAL_STATES, 900, log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log.read_text()[-3000:]
    summary = (run_dir / "summary.json").read_text()
    assert '"steps": 3,' in summary
    text = log.read_text()
    assert f"job {job_id}: start (restart 0): 1 node(s) x 2 ranks" in text
    assert "step finished with exit code 0" in text
    # the W&B run carries the id the script fixed, so a requeue would resume it
    wandb_id = re.search(r"^export WANDB_RUN_ID=(\S+) ", (run_dir / "job.sbatch").read_text(), re.M).group(1)
    assert list((run_dir / "wandb").glob(f"offline-run-*-{wandb_id}"))


def test_usr1_before_the_time_limit_requeues_the_same_job(tmp_path):
    """What `--signal=B:USR1@<s>` does near the time limit, sent by hand: the trap forwards USR1 to the step
    (torchrun survives it), the ranks save a checkpoint and exit 0, the trap requeues."""
    job_id, run_dir, log = submit(tmp_path, "trainer.steps=1000 cluster.slurm_signal_seconds=30")
    try:
        wait_for(job_id, lambda f: log.exists() and "start (restart 0)" in log.read_text(), 300, log)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        fields = wait_for(job_id, lambda f: f.get("Restarts") == "1", 120, log)
    finally:
        subprocess.run(["scancel", job_id])
    assert fields["JobState"] in ("PENDING", "REQUEUED", "RUNNING", "COMPLETING"), fields["JobState"]
    text = log.read_text()
    assert f"job {job_id}: USR1: time limit in about 30 s" in text
    assert f"job {job_id}: requeueing (same job id, same run dir)" in text
    # unhandled, USR1 would have killed the torchrun agent ("task 0: User defined signal 1")
    assert "User defined signal" not in text
    assert not (run_dir / "summary.json").exists()
