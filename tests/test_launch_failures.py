"""A dead rank is named the same way on every backend: from the launcher's view (exit codes; torchrun's error
files), not from the survivors' errors (gloo raises at once with the peer's address, NCCL raises nothing and
waits for its watchdog). CUDA ranks get NCCL's error handling in their environment."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from run.launch import CPU_RANK_ENVIRON, ClusterConfig, describe_exit, rank_environ, spawn_local

REPO = Path(__file__).resolve().parent.parent


def test_cuda_ranks_get_nccls_error_handling_and_cpu_ranks_no_onednn_kernel_cache():
    cuda = ClusterConfig(device="H100-80GB", procs_per_node=8)
    assert rank_environ(cuda, {}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert rank_environ(cuda, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) == {}  # the user's choice stays
    cpu = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "1"}
    assert rank_environ(ClusterConfig(device="cpu"), {}) == cpu
    assert rank_environ(ClusterConfig(device="cpu"), {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}) == {
        "LRU_CACHE_CAPACITY": "1"
    }


# a bf16 matmul per shape, 600 shapes after 20 warm ones: the process's RSS growth over them, MiB
_SHAPES_RSS = """
import psutil, torch
torch.set_num_threads(1)
w = torch.randn(128, 256, dtype=torch.bfloat16)
for n in range(1, 21):
    torch.randn(n, 128, dtype=torch.bfloat16) @ w
start = psutil.Process().memory_info().rss
for n in range(21, 621):
    torch.randn(n, 128, dtype=torch.bfloat16) @ w
print((psutil.Process().memory_info().rss - start) / 2**20)
"""


def test_a_cpu_rank_keeps_no_bf16_kernel_per_matmul_shape():
    """Packed micro-batches give every step new matmul shapes: with oneDNN's or ideep's cache, a bf16 rank's RSS grows
    by ~1 MB a shape up to 1024 shapes (outside any tensor, so outside any plan); with the rank's environment by at
    most its 16 kernels."""
    base = {k: v for k, v in os.environ.items() if k not in CPU_RANK_ENVIRON}

    def growth(env: dict[str, str]) -> float:
        out = subprocess.run([sys.executable, "-c", _SHAPES_RSS], env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.split()[-1])

    cached = growth(base)  # the libraries' defaults
    if cached < 100:
        pytest.skip(f"this CPU's bf16 matmuls keep no kernel per shape ({cached:.1f} MiB over 600 shapes)")
    assert growth({**base, **rank_environ(ClusterConfig(device="cpu"), base)}) < 40, cached  # 16 kernels: ~10 MB


def _rank_1_dies_rank_0_waits_silently(marker_dir: str) -> int:
    if int(os.environ["RANK"]) == 1:  # exit 3 only if the launcher gave this rank NCCL's error handling
        return 3 if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1" else 4
    time.sleep(120)  # as NCCL does with a dead peer: no exception, the rank just waits in the collective
    Path(marker_dir, "rank0-outlived").touch()
    return 0


def test_the_launcher_names_a_dead_rank_whose_peers_raise_nothing(capfd, tmp_path):
    environ = rank_environ(ClusterConfig(device="H100-80GB", procs_per_node=2), {})
    assert spawn_local(_rank_1_dies_rank_0_waits_silently, 2, (str(tmp_path),), environ) == 3
    assert "rank 1 exited with code 3; stopping ranks [0]" in capfd.readouterr().err
    assert not list(tmp_path.iterdir())  # rank 0 was stopped, not waited for
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # set for the ranks only


def test_a_rank_ended_by_nccls_watchdog_says_so():
    assert describe_exit(-signal.SIGABRT) == (
        "was killed by SIGABRT (on CUDA: NCCL's watchdog, a collective that waited cluster.timeout_s)"
    )
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL" and describe_exit(2) == "exited with code 2"


RANK_SCRIPT = """
import os, sys, time
sys.path.insert(0, {repo!r})
from run.launch import ClusterConfig, run_launched

def rank_main():
    if os.environ["RANK"] == "1":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (rank 1)")
    time.sleep(120)  # a survivor on NCCL: no exception, it waits
    return 0

sys.exit(run_launched(rank_main, ClusterConfig(device="cpu")))
"""


def test_torchrun_names_the_first_rank_to_fail_from_its_error_file(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT.format(repo=str(REPO))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path, env=env)
    assert done.returncode != 0
    root = done.stderr[done.stderr.index("Root Cause (first observed failure)") :]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root), done.stderr[-3000:]
    assert "CUDA error: an illegal memory access was encountered (rank 1)" in root  # the rank's own traceback
