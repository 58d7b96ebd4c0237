"""This machine's speeds as a :class:`planner.speed.SpeedSpec` (the ``cpu`` device has no datasheet).

Measured in about a second, median of repeats, on one core (one torch thread; the model scales by a rank's share of
the cores, planner.speed.SpeedSpec.compute_stretch):
- ``flops_per_s``: a [1024, 1024] x [1024, 1024] matmul per dtype (2 n^3 FLOPs);
- ``memory_bytes_per_s`` (and the host and intra-node links, which on CPU are copies in memory): a 64 MiB copy
  into a buffer that already exists;
- ``op_seconds``: one ``torch.add`` of 16-element tensors, the fixed cost a small op pays.

``python -m tools.speed_probe`` prints it as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from planner.speed import SpeedSpec

MATMUL_N = 1024
COPY_BYTES = 64 * 2**20
SMALL_OPS = 2000


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu_speed() -> SpeedSpec:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure()
    finally:
        torch.set_num_threads(threads)


def _measure() -> SpeedSpec:
    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        flops[str(dtype).removeprefix("torch.")] = 2 * MATMUL_N**3 / _median_seconds(lambda: a @ b, 5)  # noqa: B023
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy = COPY_BYTES / _median_seconds(lambda: dst.copy_(src), 5)
    x, y, out = torch.ones(16), torch.ones(16), torch.empty(16)

    def small_ops() -> None:
        for _ in range(SMALL_OPS):
            torch.add(x, y, out=out)

    op = _median_seconds(small_ops, 5) / SMALL_OPS
    how = "measured by tools/speed_probe.py on this machine, one core (one torch thread)"
    return SpeedSpec(
        name="cpu",
        kind="cpu",
        flops_per_s=flops,
        memory_bytes_per_s=copy,
        host_bytes_per_s=copy,
        intra_node_bytes_per_s=copy,
        inter_node_bytes_per_s=copy,
        op_seconds=op,
        cores=os.cpu_count() or 1,
        source={"all": how},
        measured=True,
    )


def main() -> int:
    speed = measure_cpu_speed()
    print(json.dumps({k: v for k, v in vars(speed).items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
