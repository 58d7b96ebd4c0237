"""Checkpoint mechanics without the loop: only complete checkpoints are picked, the rename makes one
complete, keep_last, a resumed run's outputs cut back to the checkpoint, W&B records held until a
checkpoint covers them, the stop signal, and the launcher naming a dead rank."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from checkpointing.checkpoint import (
    ACTOR_DIR,
    STATE_FILE,
    Checkpointer,
    RLState,
    StopRequest,
    checkpoint_from_path,
    complete_checkpoints,
    latest_checkpoint,
    resolve_resume,
    step_dir_name,
)
from run.launch import free_port, spawn_local
from telemetry.memory_timeline import METRICS
from telemetry.tracking import RunWriter
from tests.wandb_records import find_run_file, history_rows


def _fake_complete(root: Path, completed_steps: int) -> Path:
    path = root / step_dir_name(completed_steps)
    (path / ACTOR_DIR).mkdir(parents=True)
    (path / ACTOR_DIR / "metadata.json").write_text("{}")
    (path / STATE_FILE).write_text("{}")
    return path


def _state(completed_steps: int) -> RLState:
    return RLState(
        completed_steps=completed_steps,
        sampling_seed=0,
        next_sampling_seeds=[completed_steps],
        data_num_prompts_drawn=4 * completed_steps,
        wandb_run_id=None,
        wandb_step=0,
        world_size=1,
        layout={},
        model={},
        exp="unit",
    )


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_only_complete_checkpoints_are_picked(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    complete = _fake_complete(root, 2)
    (root / step_dir_name(4) / ACTOR_DIR).mkdir(parents=True)  # no rl_state.json: not finished
    (root / f".tmp-{step_dir_name(5)}").mkdir()  # being written when the run died
    assert complete_checkpoints(root) == [complete]
    assert latest_checkpoint(root) == complete
    assert resolve_resume("auto", tmp_path / "run") == complete
    assert resolve_resume("never", tmp_path / "run") is None
    assert checkpoint_from_path(tmp_path / "run") == complete  # a run directory names its newest checkpoint
    assert checkpoint_from_path(complete) == complete
    with pytest.raises(ValueError, match="is not a checkpoint"):
        checkpoint_from_path(root / step_dir_name(4))
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint_from_path(tmp_path / "nowhere")


def test_a_checkpoint_appears_only_when_complete_and_the_last_two_are_kept(tmp_path, single_rank_group):
    run_dir = tmp_path / "run"
    leftover = run_dir / "checkpoints" / f".tmp-{step_dir_name(9)}"
    leftover.mkdir(parents=True)
    checkpointer = Checkpointer(run_dir, rank=0, keep_last=2)
    assert not leftover.exists()  # a killed run's half-written checkpoint is removed at the next start
    for completed in (1, 2, 3):
        tmp = checkpointer.begin(completed)
        (tmp / ACTOR_DIR).mkdir()
        (tmp / ACTOR_DIR / "metadata.json").write_text("{}")
        assert latest_checkpoint(run_dir / "checkpoints") != run_dir / "checkpoints" / step_dir_name(completed)
        final = checkpointer.finish(tmp, {"torch": torch.get_rng_state()}, _state(completed))
        assert final.name == step_dir_name(completed) and not tmp.exists()
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [step_dir_name(2), step_dir_name(3)]
    assert RLState.read(final).data_num_prompts_drawn == 12
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [step_dir_name(2), step_dir_name(3)]


def test_stop_request_is_agreed_after_a_signal(single_rank_group):
    previous = {sig: signal.getsignal(sig) for sig in StopRequest.SIGNALS}
    try:
        stop = StopRequest(rank=1).install()
        assert not stop.agreed(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1" and stop.agreed(torch.device("cpu"))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _log_steps(writer: RunWriter, steps) -> None:
    for step in steps:
        row = dict(t_s=float(step), step=step, phase="rollout", rank=0)
        row.update(dict.fromkeys(METRICS, step))
        writer.log_timeline([row])
        writer.log_step(step, {"reward/mean": step / 10}, [row])


def test_resumed_outputs_are_cut_back_and_wandb_gets_each_step_once(tmp_path):
    first = RunWriter(tmp_path, {"exp": "unit"}, "offline", "rlmem-test", None, "unit", defer_wandb=True)
    _log_steps(first, range(3))
    first.flush_wandb()  # a checkpoint after 3 steps
    _log_steps(first, range(3, 5))  # steps 3 and 4 are logged, then the run dies before their checkpoint
    first.close()
    run_id, wandb_step = first.wandb_run_id, first.wandb_step
    resumed = RunWriter(
        tmp_path,
        {"exp": "unit"},
        "offline",
        "rlmem-test",
        None,
        "unit",
        completed_steps=3,
        wandb_run_id=run_id,
        wandb_step=wandb_step,
        defer_wandb=True,
    )
    assert [m["trainer/step"] for m in resumed.previous_metrics] == [0, 1, 2]
    assert resumed.last_t_s == 2.0 and resumed.wandb_run_id == run_id
    _log_steps(resumed, range(3, 5))
    resumed.finish({"steps": 5})
    import wandb

    wandb.teardown()  # finish() can return before W&B's service process has written the last records
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/step"] for m in metrics] == [0, 1, 2, 3, 4]
    rows = (tmp_path / "memory_timeline.csv").read_text().splitlines()
    assert [int(float(r.split(",")[1])) for r in rows[1:]] == [0, 1, 2, 3, 4]
    # offline-run-<time>-<id>, with "-1" added when the resumed attempt starts in the same second
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2
    per_run = [[h["trainer/step"] for h in history_rows(find_run_file(r)) if "trainer/step" in h] for r in runs]
    assert per_run == [[0, 1, 2], [3, 4]]  # the first attempt's steps 3, 4 never reached W&B


def _one_rank_dies(kill_rank: int, marker_dir: str) -> None:
    if int(os.environ["RANK"]) == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # blocked for good (as in a collective with the dead rank): the launcher must stop it
    Path(marker_dir, f"rank{os.environ['RANK']}-outlived").touch()


def test_launcher_names_the_dead_rank_and_stops_the_others(capfd, tmp_path):
    assert spawn_local(_one_rank_dies, 3, (1, str(tmp_path))) == 128 + signal.SIGKILL
    err = capfd.readouterr().err
    assert "rank 1 was killed by SIGKILL; stopping ranks [0, 2]" in err, err
    assert not list(tmp_path.iterdir())  # the others were killed, not waited for


def _sleep_forever() -> None:
    time.sleep(600)


def _fork_a_writer_then_die(out_dir: str) -> None:
    """As a rank SIGKILLed inside a save: megatron's checkpoint writer has forked a worker (fork context)."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=_sleep_forever)
    worker.start()
    Path(out_dir, "worker.pid").write_text(str(worker.pid))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_forked_worker_dies_with_its_rank(tmp_path):
    """A worker the rank forked (PR_SET_PDEATHSIG is not inherited across fork) must not outlive it: an
    orphaned checkpoint writer keeps writing into a run that is being restarted."""
    assert spawn_local(_fork_a_writer_then_die, 1, (str(tmp_path),)) == 128 + signal.SIGKILL
    worker = psutil.Process(int((tmp_path / "worker.pid").read_text()))
    try:
        worker.wait(timeout=30)  # reaped by init once killed; a live orphan sleeps its 600 s out
    except psutil.TimeoutExpired:
        worker.kill()
        pytest.fail("the rank's forked worker outlived the rank")


def _report_threads(out_dir: str) -> int:
    import torch

    Path(out_dir, os.environ["RANK"]).write_text(f"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}")
    return 0


def test_launcher_sizes_each_ranks_thread_pool_before_torch_starts(tmp_path, monkeypatch):
    """Two ranks of two OpenMP threads on two cores wait on each other: each rank gets cores // ranks, and
    torch (imported while the rank unpickles its function) sees it. A user's OMP_NUM_THREADS wins."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # torch's own default is every core: 2 or more
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert spawn_local(_report_threads, 2, (str(tmp_path),)) == 0
    assert [(tmp_path / r).read_text() for r in ("0", "1")] == ["1 1", "1 1"]
    assert "OMP_NUM_THREADS" not in os.environ  # the launcher's own environment is as it was
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # 2 each, unless the user says otherwise
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert spawn_local(_report_threads, 2, (str(tmp_path),)) == 0
    assert [(tmp_path / r).read_text() for r in ("0", "1")] == ["1 1", "1 1"]


def _wait_for_sigterm(ready_dir: str) -> int:
    stop = StopRequest(int(os.environ["RANK"])).install()
    Path(ready_dir, os.environ["RANK"]).touch()
    deadline = time.monotonic() + 120
    while stop.received is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0 if stop.received == "SIGTERM" else 3


def test_launcher_forwards_sigterm_to_its_ranks(tmp_path):
    import threading

    def signal_when_ready() -> None:  # SIGTERM to this process, the launcher, once both ranks listen
        while len(list(tmp_path.iterdir())) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_when_ready, daemon=True).start()
    assert spawn_local(_wait_for_sigterm, 2, (str(tmp_path),)) == 0  # both ranks saw SIGTERM and exited 0


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mount (the CI runs as root): a disk that fills up for real."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=2m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    os.system(f"umount -l {mount}")


def test_a_full_or_read_only_run_dir_is_named_in_one_line_with_the_kept_checkpoint(small_disk):
    import errno
    import subprocess

    from run.save_and_stop import storage_fault_line

    run_dir = small_disk / "run"
    kept = _fake_complete(run_dir / "checkpoints", 2)
    assert storage_fault_line(RuntimeError("a bug"), run_dir) is None  # room left: not a storage fault
    partial = run_dir / "checkpoints" / ".tmp-step_00000004"
    partial.mkdir()
    with pytest.raises(OSError) as full:  # write until the disk is full, as a checkpoint writer would
        with open(partial / "shard.distcp", "wb") as f:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
    assert full.value.errno == errno.ENOSPC
    # torch's checkpoint writer reports it as "[enforce fail at inline_container.cc] unexpected pos": no errno
    line = storage_fault_line(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"), run_dir)
    assert line.startswith(f"storage error: {partial}: no space left on device") and "\n" not in line
    assert f"the last complete checkpoint {kept} is kept" in line
    # what megatron's save raises on the rank whose own write failed without an errno: the other ranks' failures
    from torch.distributed.checkpoint.api import CheckpointException

    (partial / "shard.distcp").unlink()  # the writer cleaned up: free space again, the failure text says why
    other = RuntimeError("Worker failure: [Errno 28] No space left on device")
    line = storage_fault_line(CheckpointException("write", {1: (other, None)}), run_dir)
    assert line is not None and f"{partial}: no space left on device" in line, line
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    line = storage_fault_line(OSError(errno.EROFS, "Read-only file system", str(run_dir / "metrics.jsonl")), run_dir)
    assert line.startswith(f"storage error: {run_dir / 'metrics.jsonl'}: read-only file system"), line
