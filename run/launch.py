"""Start the ranks of a run: locally (one process per rank, spawned here) or under torchrun / srun.

``python -m run.main`` composes and validates the config in the parent first (bad input fails in
one line before any process group starts), prepares the run directory, then either

- spawns ``cluster.procs_per_node`` local ranks (``cluster.num_nodes == 1``; CPU gloo or one GPU
  per rank), watching them: if one fails, the others are stopped and the exit code is non-zero; or
- runs as one rank when the environment already says so (``WORLD_SIZE`` set by torchrun / srun).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

from planner.devices import CUDA_PRESETS, DEVICE_NAMES

_PR_SET_PDEATHSIG = 1  # prctl(2)
# what a launcher passes on to its ranks: Slurm's warning before the time limit, and preemption / kill
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A rank stopped by SIGUSR1 / SIGTERM saves a checkpoint and exits with this code; experiments/slurm/job.sbatch's
# USR1 trap then requeues the job (its step must end with 0: "step finished with exit code 0").
PREEMPTED_EXIT_CODE = 0


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the ranks run (``cluster.*``): world size = num_nodes x procs_per_node."""

    num_nodes: int = 1
    procs_per_node: int = 2  # GPUs per node on a cluster, CPU processes on a laptop/CI
    device: str = "cpu"  # what one rank runs on, for the memory planner: one of planner.DEVICE_NAMES
    # one node's RAM for the host plan (planner/host.py); None: the device preset's (its system's datasheet)
    host_memory_gib: float | None = None
    # --- Slurm (`make sbatch`, tools/sbatch.py). Unset: SBATCH_TIMELIMIT / SBATCH_PARTITION / SBATCH_ACCOUNT
    # from the environment, else the cluster's defaults.
    slurm_time: str | None = None  # --time, e.g. "04:00:00" (checked by tools/sbatch.py, with the environment's)
    slurm_partition: str | None = None
    slurm_account: str | None = None
    slurm_gpus_per_node: int | None = None  # None: procs_per_node on a CUDA cluster.device, else 0 (a CPU job)
    slurm_signal_seconds: int = 300  # USR1 this long before the time limit: ranks checkpoint, the job requeues
    # every collective (and the rendezvous) gives up after this long: a rank whose peer died raises, never hangs
    timeout_s: float = 600.0
    # ... except inside a checkpoint's file work (checkpointing/checkpoint.py, Checkpointer.window): a rank writing its ~56 GB
    # of a 32B checkpoint, or rank 0 deleting an old one, while the others wait in a collective
    file_timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        if self.device not in DEVICE_NAMES:
            raise ValueError(f"cluster.device={self.device!r} is not one of {list(DEVICE_NAMES)}")
        if self.host_memory_gib is not None and self.host_memory_gib <= 0:
            raise ValueError(f"cluster.host_memory_gib={self.host_memory_gib} must be > 0, or null for the preset's")
        if self.num_nodes < 1:
            raise ValueError(f"cluster.num_nodes={self.num_nodes} must be >= 1")
        if self.procs_per_node < 1:
            raise ValueError(f"cluster.procs_per_node={self.procs_per_node} must be >= 1")
        if self.slurm_gpus_per_node not in (None, 0, self.procs_per_node):
            raise ValueError(
                f"cluster.slurm_gpus_per_node={self.slurm_gpus_per_node}: one rank per GPU, so use 0 (CPU job) or "
                f"cluster.procs_per_node={self.procs_per_node}"
            )
        if self.timeout_s < 10:
            raise ValueError(
                f"cluster.timeout_s={self.timeout_s} must be >= 10 (collectives of a slow step take seconds)"
            )
        if self.file_timeout_s < self.timeout_s:
            raise ValueError(
                f"cluster.file_timeout_s={self.file_timeout_s} must be >= cluster.timeout_s={self.timeout_s} "
                "(it bounds the collectives around checkpoint file work, which take longer than a step's)"
            )
        if self.slurm_signal_seconds < 30:
            raise ValueError(
                f"cluster.slurm_signal_seconds={self.slurm_signal_seconds} must be >= 30 (time to checkpoint)"
            )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.procs_per_node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_externally() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def interface_to(address: str) -> tuple[str, str]:
    """(interface name, local IPv4 address) this machine reaches ``address`` (a host name or IP) through.

    The kernel's route decides: ``connect`` on a UDP socket sends nothing, it only picks the source
    address, whose interface ``psutil.net_if_addrs`` names. Raises OSError if the name does not resolve.
    """

    ip = socket.gethostbyname(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))
        local_ip = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
            return name, local_ip
    raise OSError(f"no interface holds {local_ip}, the address that reaches {address} ({ip})")


def bind_gloo_to_master_interface(environ: dict[str, str] = os.environ) -> str | None:
    """Under torchrun / srun on several nodes: gloo listens on the interface that carries ``MASTER_ADDR``.

    Left to itself gloo binds whatever this host's name resolves to, which on many clusters (and Debian's
    /etc/hosts: ``127.0.1.1 <hostname>``) is loopback, and peers on other nodes then cannot connect.
    Sets ``GLOO_SOCKET_IFNAME`` unless it is set already or the master is on loopback (one node); returns
    a line saying what it chose, or None.
    """
    master = environ.get("MASTER_ADDR")
    if not master or "GLOO_SOCKET_IFNAME" in environ:
        return None
    name, local_ip = interface_to(master)
    if local_ip.startswith("127."):
        return None
    environ["GLOO_SOCKET_IFNAME"] = name
    return f"gloo: GLOO_SOCKET_IFNAME={name} ({local_ip}), the interface that reaches MASTER_ADDR={master}"


_PEER_IN_ERROR = re.compile(r"\[(\d+\.\d+\.\d+\.\d+)\]:\d+")  # gloo: "Connection closed by peer [10.77.0.12]:4711"


def lost_peer_line(error: str, rank_hosts: list[tuple[str, str]], rank: int) -> str | None:
    """One line naming the ranks a failed collective lost, from the peer address in gloo's error message
    and every rank's (host name, address) gathered at the start; None if the message names no known peer."""
    addresses = {ip for ip in _PEER_IN_ERROR.findall(error)} - {rank_hosts[rank][1]}
    lost = [r for r, (_, ip) in enumerate(rank_hosts) if ip in addresses]
    if not lost:
        return None
    hosts = ", ".join(sorted({f"{rank_hosts[r][0]} ({rank_hosts[r][1]})" for r in lost}))
    return f"rank {rank} on {rank_hosts[rank][0]}: lost rank(s) {lost} on {hosts}: {error.splitlines()[0][:200]}"


# What the ranks of a CUDA run get in their environment (unless it sets them already), read by ProcessGroupNCCL
# when the group is made (torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp). A dead peer makes gloo
# raise at once; NCCL raises nothing: the waiting ranks sit in the collective until its timeout (cluster.timeout_s,
# init_process_group's `timeout`), when the watchdog acts. ASYNC_ERROR_HANDLING=1 (TearDown) makes that act an
# abort of the communicators and the end of the process (SIGABRT), so the wait is bounded by the timeout and the
# launcher sees the exit; torchrun sets the same for its workers. Not TORCH_NCCL_BLOCKING_WAIT: it would turn every
# collective into a host-side wait (a Python exception at the timeout, but no CPU/GPU overlap at any time).
# Who died is named by the launcher from exit codes (spawn_local; torchrun's error files), not by the survivors.
NCCL_RANK_ENVIRON = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
# What the ranks of a CPU run get. torch's 16-bit matmuls on a CPU with native bf16 (e.g. AVX512_BF16) go to oneDNN,
# which keeps a JIT-compiled kernel per matmul shape (its primitive cache, ~0.6 MB each, up to 1024), and ideep, torch's
# wrapper, a second cache of its own, of primitive descriptors (LRU_CACHE_CAPACITY, its utils::computation_cache,
# ~0.4 MB each, up to 1024). Packed micro-batches vary in tokens, so both grow over the steps, outside any tensor: the
# default bf16 run's RSS rose ~6 MB a step for 18 steps, 66 MiB over its plan on every phase at step 200. Neither can be
# 0: no oneDNN cache JIT-compiles every call (a bf16 run's 12 steps 43 s against 28 s with 16), and ideep's at 0
# crashes torch 2.13. 16 kernels (one micro-batch's forward and backward shapes, ~10 MB) and one descriptor stay.
CPU_RANK_ENVIRON = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "1"}


def rank_environ(cluster: ClusterConfig, environ: dict[str, str] = os.environ) -> dict[str, str]:
    """The variables a rank of ``cluster`` needs and ``environ`` does not set yet (NCCL's error handling on CUDA,
    no oneDNN or ideep kernel cache on CPU)."""
    needed = NCCL_RANK_ENVIRON if cluster.device in CUDA_PRESETS else CPU_RANK_ENVIRON
    return {k: v for k, v in needed.items() if k not in environ}


def run_launched(fn: Callable, cluster: ClusterConfig, *args: Any) -> Any:
    """``fn(*args)`` as one rank under torchrun / srun: :func:`rank_environ` set before any process group is made,
    and an exception recorded (torch's ``record``) in the error file torchrun gives each rank, from which torchrun
    names the first rank to fail ("Root Cause (first observed failure)": rank, host, exit code, traceback) before
    it stops the others; a rank killed by a signal it names by that signal. Every backend gives this."""

    os.environ.update(rank_environ(cluster))
    result = record(fn)(*args)
    end_process_groups()
    return result


def missing_devices(cluster: ClusterConfig, external: bool) -> str | None:
    """Why this machine cannot run ``cluster.device`` ranks (None: it can). Checked before anything starts.

    A CUDA experiment needs CUDA; started locally (``external=False``) it also needs ``procs_per_node`` GPUs.
    Under torchrun / srun each rank only needs its own.
    """
    if cluster.device not in CUDA_PRESETS:
        return None

    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    found = torch.cuda.device_count()
    if not external and found < cluster.procs_per_node:
        return f"this machine has {found} CUDA device(s)"
    return None


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this rank when the launcher dies, so ``kill -9`` of ``make run`` leaves no
    orphan ranks behind (they would go on writing checkpoints into a run that is being restarted)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def forked_children_die_with_this_process() -> None:
    """Every child this process forks (not exec'd: ``subprocess`` skips the hooks) gets SIGKILL when this
    process dies. megatron's checkpoint writer forks one worker per write bucket
    (``FileSystemWriterAsync.write_preloaded_data_multiproc``); a worker of a rank SIGKILLed mid-save
    otherwise lives on, blocked on its results queue, holding the launcher's resource tracker open and
    able to write into a checkpoint directory the next attempt reuses. PR_SET_PDEATHSIG is not inherited
    across fork, hence the hook; a child whose parent is already gone when the hook runs exits at once."""
    parent = os.getpid()

    def in_child() -> None:
        _die_with_parent()
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
            os._exit(128 + signal.SIGKILL)

    os.register_at_fork(after_in_child=in_child)


@contextlib.contextmanager
def updated_environ(**values: str) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    _die_with_parent()
    forked_children_die_with_this_process()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    exit_code = fn(*args)
    end_process_groups()
    if exit_code:
        sys.exit(exit_code)


def end_process_groups() -> None:
    """Destroy this rank's process groups after its run returned (not after an exception: another rank may still
    wait in a collective). Without it gloo's worker threads outlive the interpreter, and a rank that finished every
    step can die at exit with "terminate called without an active exception" (SIGABRT: pytorch/pytorch#190489;
    seen once in CI's slow suite on 2026-11-26, tests/test_memory_cpu.py, rank 1 after its last step)."""

    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_state is not None:  # vLLM's groups: its TP group's shared-memory broadcaster is unlinked only here
        vllm_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def describe_exit(exitcode: int) -> str:
    if exitcode == -signal.SIGABRT:  # NCCL's watchdog ends a rank this way (NCCL_RANK_ENVIRON)
        return "was killed by SIGABRT (on CUDA: NCCL's watchdog, a collective that waited cluster.timeout_s)"
    return f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}"


def shell_exit_code(exitcode: int) -> int:
    """A child's exit code as a shell reports it: 128 + N for death by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def spawn_local(
    fn: Callable, world_size: int, args: tuple[Any, ...] = (), environ: dict[str, str] | None = None
) -> int:
    """Run ``fn(*args)`` on ``world_size`` local ranks (env set as torchrun would, plus ``environ``, e.g.
    :func:`rank_environ`); returns an exit code.

    SIGTERM / SIGUSR1 sent to this process are forwarded to every rank (they checkpoint and exit 0).
    When a rank dies, one line names it and how it died, the others are killed at once (a checkpoint
    needs every rank, so none can complete; the last complete one stays as it is) and the exit code is
    non-zero: the rank's own, or 128 + the signal that killed it.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world_size, port, fn, args), name=f"rank{r}")
        for r in range(world_size)
    ]

    def forward(signum, frame) -> None:
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    # Each rank's OpenMP pool is sized when torch is imported, which a spawned rank does while unpickling
    # `fn`, before `_rank_entry` runs: so the thread count must be in the environment it is spawned with.
    # Two ranks of two threads each on two cores spend most of a CPU step waiting on each other.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world_size))
    with updated_environ(OMP_NUM_THREADS=threads, **(environ or {})):
        for p in procs:
            p.start()
    exit_code = 0
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)  # peers of a dead rank fail right after it: collect them, then name the cause
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                failed.sort(key=lambda item: (item[1] >= 0, item[0]))  # a death by signal first: it is the cause
                rank, code = failed[0]
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                also = "".join(f"; rank {r} {describe_exit(c)}" for r, c in failed[1:])
                print(
                    f"rank {rank} {describe_exit(code)}{also}; stopping ranks {alive}",
                    file=sys.stderr,
                    flush=True,
                )
                exit_code = shell_exit_code(code)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        exit_code = 130
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code or max((shell_exit_code(p.exitcode or 0) for p in procs), default=0)
