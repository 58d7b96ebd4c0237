"""Two real Slurm nodes on one machine (`.ci/slurm-up --nodes 2`: node1 / node2, a network + UTS namespace
each, 10.77.0.11 / .12 on a bridge): `make sbatch EXP=tiny_cpu NODES=2 SUBMIT=1` runs 2 ranks per node
(actor TP=2 inside a node, DP across the two, rollout TP=2), the rendezvous and gloo go over the bridge.

- A job preempted (USR1, what `--signal=B:USR1@<s>` sends) and requeued resumes the same W&B run, does
  every step once and logs the same rewards per step as the same 4 ranks on one node (`make run`).
- A dead node (every process in node2's namespace SIGKILLed mid-step) ends the ranks on node1 within
  cluster.timeout_s, naming the lost ranks, and leaves the last checkpoint as it was.

The module brings the two-node cluster up and, at the end, tears it down (and brings back the single-node
one if it answered before); without network namespaces (not root, no `ip netns`) it skips, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from checkpointing.checkpoint import complete_checkpoints, is_complete
from tests.test_resume import deterministic
from tests.test_slurm import FINAL_STATES, slurm_answers, submit, wait_for
from tests.wandb_records import find_run_file, history_rows

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SLURM_UP = str(REPO / ".ci" / "slurm-up")
STEPS = 3
# few steps and a short warm-up: the point is where the ranks run, not what they learn
RUN_ARGS = f"trainer.steps={STEPS} trainer.sft_warmup_steps=2"


def namespaces_unavailable() -> str | None:
    """Why this machine cannot host the two nodes (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    probe = subprocess.run(["ip", "netns", "add", "rlmem-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", "rlmem-probe"], check=True)
    return None


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    why = namespaces_unavailable()
    if why is not None:
        pytest.skip(f"two-node Slurm on one machine: {why}")
    single_node_before = slurm_answers()
    up = subprocess.run([SLURM_UP, "--nodes", "2"], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, f".ci/slurm-up --nodes 2 failed:\n{up.stdout}{up.stderr}"
    yield
    subprocess.run([SLURM_UP, "--down"], capture_output=True, timeout=120)
    if single_node_before:  # the rest of `make test-slurm` runs on the single node
        subprocess.run([SLURM_UP], capture_output=True, timeout=600)


def namespace_processes(node: str) -> list[str]:
    """'<pid> <command line>' of every process in the node's network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            found.append(f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except FileNotFoundError:  # ended meanwhile
            pass
    return found


def parent_command(pid: str) -> str:
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, IndexError):  # ended meanwhile
        return ""


def rank_processes(node: str) -> list[str]:
    """The ranks: torchrun's children. A save's writer processes (megatron's filesystem_async forks them) carry
    their rank's command line too, so the parent tells them apart."""
    found = [p for p in namespace_processes(node) if " -m run.main " in p and "torch.distributed.run" not in p]
    return [p for p in found if "torch.distributed.run" in parent_command(p.split()[0])]


def test_two_node_job_preempted_and_requeued_equals_four_ranks_on_one_node(tmp_path):
    job_id, run_dir, log = submit(tmp_path / "nodes", f"{RUN_ARGS} cluster.slurm_signal_seconds=600", "NODES=2")
    reference = None
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(job_id, lambda f: metrics.exists() and metrics.read_text().strip(), 900, log)  # step 0 logged
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        wait_for(job_id, lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING", 300, log)
        # the same 4 ranks on one node, while the requeued job waits (below): CI runs this suite beside others on
        # 2 cores, where 4 more ranks beside the job's 4 running ones would slow every rank of both
        reference = subprocess.Popen(
            ["make", "-s", "run", f"ARGS={RUN_ARGS} cluster.procs_per_node=4 output_dir={tmp_path / 'one'}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        # Slurm holds a requeued job back until the killed run's job credential expires (BeginTime = requeue
        # + cred_expire, 120 s by default); forcing StartTime=now races that: slurmd refuses the relaunch
        # ("Job credential revoked") and the job ends FAILED. So wait, as a user's requeued job does.
        fields = wait_for(job_id, lambda f: f.get("JobState") in FINAL_STATES, 900, log)
        out, _ = reference.communicate(timeout=900)
    finally:
        subprocess.run(["scancel", job_id])
        if reference is not None:
            reference.kill()
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:]
    assert fields["NodeList"] == "node[1-2]"
    assert reference.returncode == 0, out[-4000:]
    # srun started one torchrun per node; the rendezvous and gloo used the bridge's addresses
    assert re.search(rf"job {job_id}: start \(restart 0\): 2 node\(s\) x 2 ranks on node\[1-2\], "
                     rf"rendezvous node1:\d+ \(10\.77\.0\.11\)", text), text[:3000]  # fmt: skip
    for node, address in (("node1", "10.77.0.11"), ("node2", "10.77.0.12")):
        assert (
            f"{node}: gloo: GLOO_SOCKET_IFNAME=eth0 ({address}), the interface that reaches MASTER_ADDR=node1" in text
        )
    assert f"job {job_id}: requeueing (same job id, same run dir)" in text and "start (restart 1)" in text

    # every step once, each equal to the one-node run's (rewards, losses, sampled tokens' crc32)
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    (one_dir,) = (tmp_path / "one" / "tiny_cpu").iterdir()
    want = [json.loads(line) for line in (one_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/step"] for m in got] == list(range(STEPS))
    assert [m["reward/mean"] for m in got] == [m["reward/mean"] for m in want]
    assert [deterministic(m) for m in got] == [deterministic(m) for m in want]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["reward_last5"] == json.loads((one_dir / "summary.json").read_text())["reward_last5"]
    # the same W&B run id across the requeue (one offline directory per attempt), no step logged twice
    wandb_id = re.search(r"^export WANDB_RUN_ID=(\S+) ", (run_dir / "job.sbatch").read_text(), re.M).group(1)
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{wandb_id}") for r in runs), runs
    steps = [h["trainer/step"] for r in runs for h in history_rows(find_run_file(r)) if "trainer/step" in h]
    assert sorted(steps) == list(range(STEPS)), steps
    print(f"job {job_id}: rewards per step {[m['reward/mean'] for m in got]} (one node: same)")


def test_a_dead_node_ends_the_job_on_the_other_node_naming_the_lost_ranks(tmp_path):
    timeout_s = 60
    args = f"trainer.steps=30 trainer.sft_warmup_steps=2 trainer.save_every=1 cluster.timeout_s={timeout_s}"
    job_id, run_dir, log = submit(tmp_path, args, "NODES=2")
    checkpoints = run_dir / "checkpoints"
    try:
        wait_for(job_id, lambda f: complete_checkpoints(checkpoints), 900, log)
        checkpoint = complete_checkpoints(checkpoints)[-1]
        before = {str(p.relative_to(checkpoint)): p.stat().st_mtime_ns for p in checkpoint.rglob("*")}
        time.sleep(1.0)  # into the next step
        assert len(rank_processes("node1")) == len(rank_processes("node2")) == 2
        victims = namespace_processes("node2")  # its slurmd, the job's slurmstepd, torchrun, the 2 ranks
        for victim in victims:
            subprocess.run(["kill", "-9", victim.split()[0]])
        killed_at = time.monotonic()
        while rank_processes("node1") and time.monotonic() - killed_at < timeout_s + 30:
            time.sleep(0.5)
        ranks_gone_s = time.monotonic() - killed_at
        # srun returns once Slurm declares node2 DOWN (SlurmdTimeout); the job is then requeued (--requeue),
        # which may kill the batch shell before it logs the step's end
        fields = wait_for(
            job_id, lambda f: f.get("JobState") != "RUNNING" or "step finished" in log.read_text(), 300, log
        )
        step_done_s = time.monotonic() - killed_at
    finally:
        subprocess.run(["scancel", job_id])
        subprocess.run([SLURM_UP, "--nodes", "2"], capture_output=True, timeout=300)  # node2's slurmd again
    text = log.read_text()
    assert ranks_gone_s < timeout_s, f"node1's ranks still ran {ranks_gone_s:.0f} s after node2 died\n{text[-4000:]}"
    lost = re.search(r"rank \d on node1: lost rank\(s\) \[2, 3\] on node2 \(10\.77\.0\.12\): .*", text)
    assert lost, text[-4000:]
    exit_code = re.search(r"srun: error: node1: task 0: Exited with exit code (\d+)", text).group(1)
    assert exit_code != "0", text[-4000:]
    assert not (run_dir / "summary.json").exists()
    newest = complete_checkpoints(checkpoints)[-1]  # a newer one may have completed before the kill landed
    assert is_complete(newest)
    if newest == checkpoint:
        assert {str(p.relative_to(checkpoint)): p.stat().st_mtime_ns for p in checkpoint.rglob("*")} == before
    print(
        f"job {job_id}: node2 killed ({len(victims)} processes); node1's ranks gone after {ranks_gone_s:.1f} s, "
        f"the step after {step_done_s:.1f} s (exit code {exit_code}, then {fields.get('JobState')}); "
        f"{lost.group(0)[:120]}; newest checkpoint {newest.name}"
    )
