"""This machine's speeds as a :class:`planner.speed.SpeedSpec` (the ``cpu`` device has no datasheet).

Measured in about five seconds (most of it the GEMM table), median of repeats, on one core (one torch thread; the
model scales by a rank's share of the cores, planner.speed.SpeedSpec.compute_stretch):
- ``flops_per_s``: a [1024, 1024] x [1024, 1024] matmul per dtype (2 n^3 FLOPs);
- ``memory_bytes_per_s``: a 64 MiB copy into a buffer that already exists, its bytes read plus written; the links
  between ranks (on CPU copies in memory): the same copy's bytes;
- ``fresh_bytes_per_s``: 64 MiB written into a new buffer (a fresh mapping on CPU: its page faults), freed after;
- ``host_bytes_per_s``, ``host_in_bytes_per_s``: a 64 MiB storage offloaded and onloaded as the actor's offloader
  does (``megatron_backend.memory.HostCopy``: a ``pwrite`` into a temp file and the storage released; then grown
  again and filled by a ``preadv``), its bytes over each direction's median time (the way in is slower: its pages
  are fresh);
- ``gemm_seconds_per_weight_byte``: per dtype and row count (1 to 256), ``F.linear`` of [rows, in] by each
  [out, in] weight shape the planned model's engine rank multiplies by (``gemm_weights``,
  planner.sizes.engine_gemm_weights; none given: one [768, 512], qwen2_memory's qkv), cycling through 96 MiB of
  weights of that shape (more than most machines' last-level cache: each is read from memory; at most
  :data:`GEMM_RING_WEIGHTS` of them), its seconds over
  the weight's bytes, the shapes' mean weighted by their bytes. The shape matters: at 8 rows this VM's oneDNN runs
  [4096, 512] (gate_up) at 20-21e-11 s/B and [768, 512] at 15-16e-11 (docs/plan-validation.md);
- ``op_seconds``: one ``torch.add`` of 16-element tensors, the fixed cost a small op pays;
- ``gloo_all_reduce_seconds``: one gloo all-reduce of [8, 512] fp32 (16 KiB: a decode step's rows) between two
  ranks spawned as a run's are, with a small matmul between calls as a layer's work, the mean over 1000 (not the median: on
  this 2-vCPU VM a tenth of them wait ~4 ms, a scheduler tick at HZ 250, for a wake-up; the mean is what a
  rollout's thousands pay). It costs ~4 s of process start-up;
- ``gloo_exchange_bytes_per_s``: the same two ranks each send 16 MiB to the other and receive as much, with the
  weight sync's own transport (``TorchP2PTransport``, weight_sync/transport.py), the bytes one way over the median
  of 9 (gloo over loopback on 2 cores sends and receives at ~1.0-1.2 GB/s each way, a third of the copy's rate);
- ``gloo_reduce_scatter_bytes_per_s``, ``gloo_all_gather_bytes_per_s``: the same two ranks reduce-scatter a
  :data:`GLOO_BUCKET_BYTES` fp32 buffer and all-gather into one, as megatron's DDP reduces a bucket of grads and
  the distributed optimizer gathers the params (torch.distributed.reduce_scatter_tensor and all_gather_into_tensor,
  megatron/core/distributed/param_and_grad_buffer.py), the bytes one rank sends (half the buffer) over the median of
  3 (gloo's reduce-scatter runs at ~0.3 GB/s, its all-gather at ~0.45 on this VM: a twentieth of a copy, and the same
  per byte from 16 to 122 MiB);
- ``draw_seconds``: one element of ``exponential_`` over a [64, 16384] fp32 buffer (the native sampler's
  ``torch.multinomial`` draws one per vocab entry of each row: planner/step_time.py).

``python -m tools.speed_probe`` prints it as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_backend.memory import HostCopy, HostFile
from planner.sizes import engine_gemm_weights
from planner.speed import SpeedSpec
from weight_sync.transport import TorchP2PTransport

MATMUL_N = 1024
COPY_BYTES = 64 * 2**20
SMALL_OPS = 2000
DRAWS = (64, 16384)
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GEMM_WEIGHT = (768, 512)  # [out, in]
GEMM_RING_BYTES = 96 * 2**20
# at most this many weights a ring: a small weight's F.linear costs its call (~2-10 us), and 96 MiB of a tiny model's
# [64, 64] bf16 weights are 12,288 calls a pass (~30 s for the table); 512 of them are still many passes' worth of
# what such a model reads (a shape of 192 KiB or more fills the 96 MiB)
GEMM_RING_WEIGHTS = 512
GLOO_ROWS = (8, 512)  # fp32: a decode step's hidden rows, what the native engine all-reduces per layer
GLOO_CALLS = 1000  # the mean of 400 moved by +-25% between probes a minute apart; of 1000, by +-10%
GLOO_EXCHANGE_BYTES = 16 * 2**20  # each way: a weight sync bucket's size (weight_sync.bucket_mb's scale)
GLOO_EXCHANGES = 9
GLOO_BUCKET_BYTES = 64 * 2**20  # memory_cpu's one DDP bucket is 122 MB; the rate per byte is the same from 16 MiB
GLOO_BUCKET_REPEATS = 3
HOST_BYTES = 64 * 2**20


def _median_seconds(fn, repeats: int, before=None) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after a warm one; ``before`` (a gloo group's barrier: the
    ranks start each call together) runs ahead of every call, outside the time."""
    times = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first warms


def measure_cpu_speed(gemm_weights: dict[tuple[int, int], int] | None = None, dtype: str | None = None) -> SpeedSpec:
    """This machine's speeds. ``gemm_weights``: {(out, in): how many} of the planned engine rank's weights
    (planner.sizes.engine_gemm_weights), the shapes the GEMM table is measured at, in the planned ``dtype`` only
    (each shape costs ~1 s a dtype); None: :data:`GEMM_WEIGHT` in each of :data:`GEMM_DTYPES`."""
    dtypes = {str(d).removeprefix("torch."): d for d in GEMM_DTYPES}
    if gemm_weights is None:
        weights, measured = {GEMM_WEIGHT: 1}, list(dtypes)
    else:
        weights, measured = dict(gemm_weights), [dtype]
        if dtype not in dtypes:
            raise ValueError(f"dtype={dtype!r}: gemm_weights are measured in the planned dtype, one of {list(dtypes)}")
        if not weights or any(min(*shape, n) < 1 for shape, n in weights.items()):
            raise ValueError(f"gemm_weights={gemm_weights}: every (out, in) and count must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(weights, [dtypes[d] for d in measured], gemm_weights is not None)
    finally:
        torch.set_num_threads(threads)


def measure_cpu_speed_for(inputs) -> SpeedSpec:
    """This machine's speeds for a plan of ``inputs`` (planner.inputs.PlanInputs): the native engine's GEMMs, which
    the step-time model times through the GEMM table, at its rank's own weights in the model's dtype; vLLM's are
    not timed so (the default table)."""
    if inputs.rollout.engine != "native":
        return measure_cpu_speed()
    weights = engine_gemm_weights(inputs.shape, inputs.rollout.tp, *inputs.engine_expert_split)
    return measure_cpu_speed(weights, inputs.dtype)


def _measure(gemm_weights: dict[tuple[int, int], int], gemm_dtypes: list, planned: bool) -> SpeedSpec:
    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        flops[str(dtype).removeprefix("torch.")] = 2 * MATMUL_N**3 / _median_seconds(lambda: a @ b, 5)  # noqa: B023
    gemm = {str(dtype).removeprefix("torch."): _gemm_table(dtype, gemm_weights) for dtype in gemm_dtypes}
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy = COPY_BYTES / _median_seconds(lambda: dst.copy_(src), 5)
    fresh = COPY_BYTES / _median_seconds(lambda: torch.ones(COPY_BYTES // 4), 5)
    x, y, out = torch.ones(16), torch.ones(16), torch.empty(16)

    def small_ops() -> None:
        for _ in range(SMALL_OPS):
            torch.add(x, y, out=out)

    op = _median_seconds(small_ops, 5) / SMALL_OPS
    host_out, host_in = measure_host_copies()
    gloo = measure_gloo()
    noise = torch.empty(DRAWS)
    draw = _median_seconds(noise.exponential_, 5) / noise.numel()
    how = "measured by tools/speed_probe.py on this machine, one core (one torch thread)"
    return SpeedSpec(
        name="cpu",
        kind="cpu",
        flops_per_s=flops,
        memory_bytes_per_s=2 * copy,  # a copy reads and writes
        fresh_bytes_per_s=fresh,
        host_bytes_per_s=host_out,
        host_in_bytes_per_s=host_in,
        intra_node_bytes_per_s=copy,
        inter_node_bytes_per_s=copy,
        op_seconds=op,
        gemm_seconds_per_weight_byte=gemm,
        gemm_weights=sorted((*shape, n) for shape, n in gemm_weights.items()) if planned else None,
        draw_seconds=draw,
        gloo_all_reduce_seconds=gloo["all_reduce_seconds"],
        gloo_exchange_bytes_per_s=gloo["exchange_bytes_per_s"],
        gloo_reduce_scatter_bytes_per_s=gloo["reduce_scatter_bytes_per_s"],
        gloo_all_gather_bytes_per_s=gloo["all_gather_bytes_per_s"],
        cores=os.cpu_count() or 1,
        source={"all": how},
        measured=True,
    )


GEMM_DTYPES = (torch.float32, torch.bfloat16)


def _gemm_table(dtype: torch.dtype, weights: dict[tuple[int, int], int]) -> dict[int, float]:
    """Seconds per weight byte at each of :data:`GEMM_ROWS` over ``weights`` ({(out, in): how many}): each shape's
    measured, weighted by the bytes of that shape (a pass reads each weight once)."""
    tables = {shape: _gemm_seconds_per_weight_byte(dtype, shape) for shape in weights}
    return mixed_gemm_table(tables, weights)


def mixed_gemm_table(
    tables: dict[tuple[int, int], dict[int, float]], weights: dict[tuple[int, int], int]
) -> dict[int, float]:
    """{rows: seconds per byte} of ``weights`` ({(out, in): how many}) from each shape's table: the mean weighted by
    each shape's bytes, out x in x how many."""
    total = sum(out * inp * n for (out, inp), n in weights.items())
    return {
        rows: sum(tables[shape][rows] * shape[0] * shape[1] * n for shape, n in weights.items()) / total
        for rows in tables[next(iter(weights))]
    }


def _gemm_seconds_per_weight_byte(dtype: torch.dtype, shape: tuple[int, int] = GEMM_WEIGHT) -> dict[int, float]:
    """Seconds per weight byte of ``F.linear`` by an [out, in] = ``shape`` weight at each of :data:`GEMM_ROWS`, the
    weights read from memory."""
    out_features, in_features = shape
    weight_bytes = out_features * in_features * torch.finfo(dtype).bits // 8
    ring = [
        torch.randn(shape).to(dtype) for _ in range(min(GEMM_RING_WEIGHTS, max(1, GEMM_RING_BYTES // weight_bytes)))
    ]
    table = {}
    for rows in GEMM_ROWS:
        x = torch.randn(rows, in_features).to(dtype)

        def through_ring() -> None:
            for weight in ring:
                torch.nn.functional.linear(x, weight)  # noqa: B023

        table[rows] = _median_seconds(through_ring, 3) / (len(ring) * weight_bytes)
    return table


def measure_host_copies(repeats: int = 5) -> tuple[float, float]:
    """Bytes per second of the actor's CPU offload of one :data:`HOST_BYTES` storage (written out, the storage
    released) and of its onload (the storage grown again, read back), each the median of ``repeats`` round trips
    after a warm one (the offloader's copies; not its ``malloc_trim``, whose ``gc.collect`` a run's frozen heap makes
    cheap)."""
    storage = torch.ones(HOST_BYTES // 4).untyped_storage()
    out_seconds, in_seconds = [], []
    for _ in range(repeats + 1):
        host_file = HostFile()
        start = time.perf_counter()
        host = HostCopy(torch.empty(0, dtype=torch.uint8).set_(storage), host_file)
        storage.resize_(0)
        middle = time.perf_counter()
        storage.resize_(host.nbytes)
        host.copy_to(torch.empty(0, dtype=torch.uint8).set_(storage))
        end = time.perf_counter()
        host_file.close()
        out_seconds.append(middle - start)
        in_seconds.append(end - middle)
    return HOST_BYTES / statistics.median(out_seconds[1:]), HOST_BYTES / statistics.median(in_seconds[1:])


def measure_gloo(calls: int = GLOO_CALLS, exchanges: int = GLOO_EXCHANGES) -> dict[str, float]:
    """Between two ranks spawned as a run's are (run.launch.spawn_local): ``all_reduce_seconds``, the mean of
    ``calls`` 2-rank gloo all-reduces of :data:`GLOO_ROWS` fp32, the matmul between calls (a layer's work) taken out;
    ``exchange_bytes_per_s``, :data:`GLOO_EXCHANGE_BYTES` each way over the median of ``exchanges`` (module doc)."""
    from run.launch import spawn_local

    if calls < 1 or exchanges < 1:
        raise ValueError(f"measure_gloo: calls={calls} and exchanges={exchanges} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="gloo-probe-") as scratch:
        out = Path(scratch) / "rates.json"
        exit_code = spawn_local(_gloo_rank, 2, args=(calls, exchanges, str(out)))
        if exit_code:
            raise RuntimeError(f"the gloo probe's ranks failed (exit code {exit_code})")
        return json.loads(out.read_text())


def _gloo_rank(calls: int, exchanges: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows, weight = torch.randn(GLOO_ROWS), torch.randn(GLOO_ROWS[1], GLOO_ROWS[1])
    for _ in range(50):  # warm: the connections made, the buffers allocated
        dist.all_reduce(rows @ weight)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(rows @ weight)
    total = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        rows @ weight
    work = time.perf_counter() - start
    peer = 1 - dist.get_rank()
    send, receive = torch.ones(GLOO_EXCHANGE_BYTES // 4), torch.empty(GLOO_EXCHANGE_BYTES // 4)
    transport = TorchP2PTransport()

    def exchange() -> None:  # as the weight sync moves a bucket
        transport.submit_send(send, peer)
        transport.submit_recv(receive, peer)
        transport.run()

    exchange_seconds = _median_seconds(exchange, exchanges, before=dist.barrier)
    bucket = _bucket_seconds()
    if dist.get_rank() == 0:
        rates = {
            "all_reduce_seconds": max(total - work, 0.0) / calls,
            "exchange_bytes_per_s": GLOO_EXCHANGE_BYTES / exchange_seconds,
            **{f"{name}_bytes_per_s": GLOO_BUCKET_BYTES / 2 / seconds for name, seconds in bucket.items()},
        }
        Path(out).write_text(json.dumps(rates))


def _bucket_seconds() -> dict[str, float]:
    """A DDP bucket's reduce-scatter and the params' all-gather over this rank's gloo group (of two), each the median
    of :data:`GLOO_BUCKET_REPEATS` after a warm one."""
    full = torch.ones(GLOO_BUCKET_BYTES // 4)
    shard = torch.empty(full.numel() // dist.get_world_size())
    collectives = {
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
    }
    with warnings.catch_warnings():  # torch 2.13 names these deprecated; megatron-core 0.16 calls them
        warnings.simplefilter("ignore", FutureWarning)
        return {
            name: _median_seconds(collective, GLOO_BUCKET_REPEATS, before=dist.barrier)
            for name, collective in collectives.items()
        }


def main() -> int:
    speed = measure_cpu_speed()
    print(json.dumps({k: v for k, v in vars(speed).items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
