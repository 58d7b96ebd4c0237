"""No hangs: one of 4 ranks is SIGKILLed in the middle of a step; the launcher names it, stops the other
ranks at once and exits non-zero, and the last complete checkpoint is left exactly as it was."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from checkpointing.checkpoint import complete_checkpoints, is_complete
from tests.test_resume import rank_processes, wait_for

REPO = Path(__file__).resolve().parent.parent
VICTIM = 2


def _files(checkpoint: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(checkpoint)): (p.stat().st_size, p.stat().st_mtime_ns) for p in checkpoint.rglob("*")}


def test_a_dead_rank_stops_the_job_with_its_name_and_keeps_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "run.main", "--exp", "tiny_cpu_pp", "--run-dir", str(run_dir),
        "trainer.steps=20", "trainer.save_every=1", "trainer.keep_last=1", "wandb.mode=disabled",
        "cluster.timeout_s=60",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for(proc, lambda: complete_checkpoints(run_dir / "checkpoints"))
        checkpoint = complete_checkpoints(run_dir / "checkpoints")[-1]
        before = _files(checkpoint)
        time.sleep(1.0)  # into the next step
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 4, ranks
        ranks[VICTIM].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=120)  # the bound: a hang fails here
        exit_seconds = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"rank {VICTIM} was killed by SIGKILL" in err, err[-3000:]
    assert "stopping ranks [" in err, err[-3000:]
    newest = complete_checkpoints(run_dir / "checkpoints")[-1]
    # the checkpoint that was complete when the rank died is still complete and untouched (or a newer one,
    # completed before the kill landed, replaced it under keep_last=1)
    assert is_complete(newest)
    if newest == checkpoint:
        assert _files(checkpoint) == before
    line = next(line for line in err.splitlines() if f"rank {VICTIM} was killed" in line)
    print(f"exit {proc.returncode} {exit_seconds:.1f} s after the kill: {line}")
