"""Run a function on N gloo ranks in fresh processes (real torch.distributed, no mocks).

The ranks are forked from one forkserver per pytest process that has imported torch, megatron-core and the
project once (:data:`PRELOAD`): a rank starts in ~0.1 s instead of paying ~8 s of CPU on imports. Each rank is a
new process with no process group, no parallel state and no tensors of an earlier test; it gets the caller's
environment and working directory as they are when it starts (as a spawned one would), and the thread count.
"""

from __future__ import annotations

import os
import pickle
import traceback

import torch
import torch.multiprocessing as mp

from run.launch import free_port

# Threads per rank (1: two ranks share the 2 CI cores). `make test-threads` runs the numeric tests again with
# RLMEM_TEST_RANK_THREADS=2, so no cross-layout tolerance holds only for one reduction order.
RANK_THREADS_ENV = "RLMEM_TEST_RANK_THREADS"


# Imported once in the forkserver; every module a rank's function imports later costs that rank alone. Only
# imports here: the server must not compute (a fork of a process whose OpenMP pool has started hangs in it).
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "transformers",
    "safetensors.torch",
    "megatron_backend.actor",
    "rollout.native",
    "weight_sync.sync",
]


def _context():
    """The forkserver context with :data:`PRELOAD` (the server starts with the first rank, once per process); where
    CUDA is available, spawn: a process forked from one that has started CUDA cannot use it, and on the lent H200
    every forked rank failed so ("Cannot re-initialize CUDA in forked subprocess" in torch.cuda.set_device)."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world_size: int, port: int, fn, args, result_queue, environ: dict, cwd: str) -> None:
    # a forked rank has the server's environment and directory: take the caller's, as a spawned rank would
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    num_threads = int(os.environ.get(RANK_THREADS_ENV, "1"))
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(num_threads),
    )
    import torch

    torch.set_num_threads(num_threads)
    try:
        # plain pickle: tensors travel by value, not as shared-memory fds that die with this process
        result_queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, then exit non-zero
        result_queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on every rank; return the per-rank results in rank order.

    ``fn`` must be importable (module level). Any rank's exception fails the caller with its traceback.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, environ, cwd)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
