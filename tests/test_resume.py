"""Kill and resume the real loop (2 CPU ranks): a run stopped by SIGKILL at several points (one of them inside
a checkpoint save) and by SIGTERM, and started again each time with resume=auto, ends with exactly the
steps of the run that was never interrupted: same rewards, losses, grad norms and sampled tokens, each
step once in metrics.jsonl and once across the W&B run's records."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from checkpointing.checkpoint import complete_checkpoints
from tests.wandb_records import find_run_file, history_rows

REPO = Path(__file__).resolve().parent.parent
STEPS = 12  # room for a SIGTERM after a checkpoint of the third attempt: a step is ~1 s
SETTINGS = (
    f"trainer.steps={STEPS}",
    "trainer.sft_warmup_steps=1",
    "trainer.prompts_per_step=4",
    "actor.micro_batch_size=16",
    "trainer.ppo_epochs=1",
    "trainer.save_every=1",
    "trainer.keep_last=2",
)
# what differs between two runs of the same steps: wall-clock times, throughput, memory samples
NONDETERMINISTIC = ("time/", "perf/", "memory/", "weight_sync/seconds")


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """``python -m run.main`` in its own session (so the test can kill the launcher and its ranks at once)."""
    cmd = [sys.executable, "-m", "run.main", "--run-dir", str(run_dir), *SETTINGS, *overrides]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def wait_for(proc: subprocess.Popen, condition, timeout_s: float = 600.0, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) first:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"timed out:\n{proc.stdout.read()[-4000:]}")
        time.sleep(interval_s)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["trainer/step"] for line in path.read_text().splitlines() if line.endswith("}")]


def saving(run_dir: Path, since: float = 0.0) -> bool:
    """A checkpoint is being written: its temporary directory exists and already holds actor shards written
    after ``since`` (an earlier attempt killed inside a save leaves such a directory behind until the next
    attempt has set up and cleans it: that one is not this attempt's save)."""
    root = run_dir / "checkpoints"
    try:
        return root.is_dir() and any(
            p.name.startswith(".tmp-") and any(f.stat().st_mtime > since for f in p.glob("actor/*.distcp"))
            for p in root.iterdir()
        )
    except FileNotFoundError:  # the run removed it while we looked
        return False


def kill_launcher_only(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher alone: its ranks must not outlive it (PR_SET_PDEATHSIG)."""
    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert ranks, "the launcher has no rank processes"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"orphan ranks survived the launcher: {alive}"


def rank_processes(launcher_pid: int) -> list[psutil.Process]:
    """The launcher's rank processes in rank order (spawned in that order; multiprocessing's resource
    tracker, also a child, is left out). /proc environ cannot tell: RANK is set after the process starts."""
    ranks = []
    for child in psutil.Process(launcher_pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                ranks.append(child)
        except psutil.Error:
            continue
    return sorted(ranks, key=lambda p: (p.create_time(), p.pid))


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC)}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """The run that was never interrupted, once for the module's tests."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    reference = start(run_dir)
    assert reference.wait(timeout=900) == 0, reference.stdout.read()[-4000:]
    return run_dir


def assert_same_steps_as(reference_dir: Path, resumed_dir: Path) -> None:
    """Each step once, with the reference's rewards, losses, grad norms and sampled tokens."""
    want = [json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/step"] for m in got] == list(range(STEPS))
    assert [deterministic(m) for m in got] == [deterministic(m) for m in want]
    assert len({m["rollout/response_tokens_crc32"] for m in want}) == STEPS  # the seed varies per step
    reference_summary = json.loads((reference_dir / "summary.json").read_text())
    summary = json.loads((resumed_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["reward_last5"] == reference_summary["reward_last5"]


def test_killed_and_resumed_run_equals_the_uninterrupted_run(tmp_path, reference_dir):
    resumed_dir = tmp_path / "resumed"

    # 1: SIGKILL to the launcher only, while step 1 runs (step 0 is logged, its checkpoint may be complete)
    proc = start(resumed_dir)
    wait_for(proc, lambda: logged_steps(resumed_dir))
    time.sleep(2.0)
    kill_launcher_only(proc)
    # 2: SIGKILL to every process inside a checkpoint save: the half-written one must never be picked
    started = time.time()
    proc = start(resumed_dir)
    wait_for(proc, lambda: saving(resumed_dir, since=started))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = [p.name for p in complete_checkpoints(resumed_dir / "checkpoints")]
    # 3: SIGTERM (preemption) once this attempt completed a checkpoint: save at the next phase boundary, exit 0
    proc = start(resumed_dir)
    wait_for(proc, lambda: [p.name for p in complete_checkpoints(resumed_dir / "checkpoints")][-1:] > before[-1:])
    proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to its ranks
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "stopped by SIGTERM" in out and not (resumed_dir / "summary.json").exists(), out[-4000:]
    # 4: to the end
    proc = start(resumed_dir)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "resuming from" in out

    assert before, "no checkpoint was complete before the kill inside a save"
    assert not list((resumed_dir / "checkpoints").glob(".tmp-*"))
    assert [p.name for p in complete_checkpoints(resumed_dir / "checkpoints")] == [
        f"step_{n:08d}" for n in (STEPS - 1, STEPS)
    ]  # keep_last=2
    assert_same_steps_as(reference_dir, resumed_dir)

    # W&B: each attempt wrote its own offline run; a step reaches W&B only once a checkpoint covers it, so no
    # step is there twice (a SIGKILL may lose records the W&B service had not written yet: never duplicates)
    runs = sorted((resumed_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 4, runs
    per_run = [[h["trainer/step"] for h in history_rows(find_run_file(r)) if "trainer/step" in h] for r in runs]
    steps = [s for run_steps in per_run for s in run_steps]
    assert len(steps) == len(set(steps)) and set(steps) <= set(range(STEPS)), per_run
    assert per_run[-1] and per_run[-1][-1] == STEPS - 1, per_run  # the last attempt ended normally


def assert_ends_with_the_runs_own_lines(out: str, fault: str) -> None:
    """The last lines a user reads are the project's: the rank's fault line, then the launcher's stopping the other
    ranks; no resource_tracker warning about a semaphore or shared memory a rank ended by os._exit or SIGKILL held."""
    lines = [line for line in out.splitlines() if line.strip()]
    assert "resource_tracker" not in out, lines[-6:]
    stopping = re.fullmatch(r"rank \d+ exited with code 1; stopping ranks \[.*\]", lines[-1])
    assert lines[-2] == fault and stopping, lines[-6:]


def test_a_full_disk_stops_the_run_in_one_line_and_the_resume_equals_the_uninterrupted_run(tmp_path, reference_dir):
    """The run directory on a 12 MiB tmpfs (a checkpoint of these settings is ~8 MiB, keep_last=2): the disk
    fills while a checkpoint is written. The run stops with one line naming the path and the kept checkpoint;
    once the disk is grown (remount), the same command resumes and ends with the uninterrupted run's steps."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=12m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        run_dir = mount / "run"
        out, _ = (proc := start(run_dir)).communicate(timeout=900)
        assert proc.returncode == 1, out[-4000:]
        faults = [line for line in out.splitlines() if line.startswith("storage error: ")]
        kept = complete_checkpoints(run_dir / "checkpoints")
        assert len(faults) == 1 and "no space left on device" in faults[0], out[-4000:]
        assert kept and f"the last complete checkpoint {kept[-1]} is kept" in faults[0], faults
        assert_ends_with_the_runs_own_lines(out, faults[0])
        assert logged_steps(run_dir) and logged_steps(run_dir)[-1] < STEPS - 1  # it stopped early
        subprocess.run(["mount", "-o", "remount,size=300m", str(mount)], check=True)  # space returns
        out, _ = (proc := start(run_dir)).communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
        assert f"resuming from {kept[-1]}" in out, out[-4000:]
        assert_same_steps_as(reference_dir, run_dir)
    finally:
        os.system(f"umount -l {mount}")


def test_a_learning_rate_typo_stops_at_the_first_nan_in_one_line_keeping_the_last_good_checkpoint(tmp_path):
    """actor.lr=1e8 (meant 1e-8): step 0's update blows the weights up, step 1's grad norm is NaN. The run stops
    in that step's train phase before the optimizer applies it, with one line (no traceback) naming the step,
    the phase, the quantity and the checkpoint a resume starts from; step 0's checkpoint is the last one."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "run.main", "--run-dir", str(run_dir), "trainer.steps=6", "trainer.save_every=1"]
    cmd += ["trainer.sft_warmup_steps=0", "trainer.prompts_per_step=4", "actor.micro_batch_size=16"]
    cmd += ["wandb.mode=disabled", "actor.lr=1e8"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    kept = complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in kept] == ["step_00000001"], kept
    lines = [line for line in out.splitlines() if line.startswith("numeric error: ")]
    assert lines and set(lines) == {lines[0]}, out[-4000:]  # rank 0's line (another rank may repeat it)
    assert lines[0].startswith("numeric error: step 1, phase train: grad_norm=nan is not finite; stopped before the optimizer"), lines
    assert f"the last complete checkpoint {kept[-1]} is kept" in lines[0], lines
    assert "Traceback" not in out, out[-4000:]
    assert_ends_with_the_runs_own_lines(proc.stderr, lines[0])
    assert logged_steps(run_dir) == [0]


def test_sigterm_during_the_warm_up_exits_within_seconds(tmp_path):
    """Slurm's --signal grace is 60-120 s: SIGTERM in the middle of a long warm-up must not wait for its end.
    (Before the warm-up honoured stops, this run kept warming up for its 5000 steps.)"""
    import threading

    from run.launch import PREEMPTED_EXIT_CODE

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "run.main", "--run-dir", str(run_dir), "trainer.steps=2", "wandb.mode=disabled"]
    cmd += ["trainer.sft_warmup_steps=5000", "trainer.prompts_per_step=4", "actor.micro_batch_size=16"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    wait_for(proc, lambda: any("supervised warm-up: 5000 steps" in line for line in lines), interval_s=0.2)
    time.sleep(5)  # well inside the warm-up
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to its ranks
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("still warming up 120 s after SIGTERM:\n" + "".join(lines)[-4000:]) from None
    seconds = time.monotonic() - signalled
    out = "".join(lines)
    print(f"\nSIGTERM during the warm-up: exit {code} after {seconds:.1f} s")
    assert code == PREEMPTED_EXIT_CODE and seconds < 60, (code, seconds, out[-4000:])
    assert "stopped by SIGTERM during the supervised warm-up" in out, out[-4000:]
    assert not complete_checkpoints(run_dir / "checkpoints") and not (run_dir / "summary.json").exists()
