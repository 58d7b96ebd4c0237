"""How fast one rank's device and its links are: the rates the step-time model (planner/step_time.py) divides
counted work by.

A CUDA preset's figures are its datasheet's, each with its source: dense (not "with sparsity") peak FLOP/s per
dtype, memory bandwidth, NVLink per direction (the datasheet's total is both directions), the host link (PCIe,
per direction) and the node's network per GPU (the DGX system's InfiniBand adapters over its 8 GPUs). No efficiency
is in them: the fitted efficiencies (planner/calibration/<kind>_time.json) say how much of a peak a phase reaches.

``cpu`` has no datasheet: this machine's figures are measured on one core (tools/speed_probe.py: a matmul's FLOP/s,
a large copy's bytes/s, one small torch op's seconds, one random draw's seconds) and passed in; a rank's share of the cores scales them
(:meth:`SpeedSpec.compute_stretch`). Pure standard library.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

GB = 10**9
TFLOPS = 10**12


@dataclass(frozen=True, kw_only=True)
class SpeedSpec:
    """One rank's rates. ``flops_per_s`` by model dtype; bandwidths in bytes/s, one direction (memory: the bytes a
    kernel reads plus those it writes); ``op_seconds``: one
    small operation's fixed cost (a kernel launch on CUDA, a torch op's dispatch on CPU); ``cores`` (CPU): the
    machine's cores, which its ranks share."""

    name: str
    kind: str  # "cuda" | "cpu"
    flops_per_s: dict[str, float]
    memory_bytes_per_s: float
    host_bytes_per_s: float  # device -> host, an offload (PCIe); on CPU the offload's write into its host file
    intra_node_bytes_per_s: float  # between two ranks of a node (NVLink; CPU: a copy in memory)
    inter_node_bytes_per_s: float  # between nodes, per GPU (InfiniBand)
    op_seconds: float
    # one random draw of torch's ``exponential_`` (torch.multinomial's one-sample path draws one per vocab entry);
    # None: a CUDA device's, whose Philox draws cost their 4-byte write at the memory bandwidth
    draw_seconds: float | None = None
    # bytes/s written into fresh allocations; None: ``memory_bytes_per_s`` (CUDA's caching allocator hands back
    # blocks already mapped; a CPU buffer of a page or more is a fresh mapping, faulted in: colocation/host_memory.py)
    fresh_bytes_per_s: float | None = None
    # host -> device, an onload; None: ``host_bytes_per_s`` (PCIe runs as fast both ways). CPU: the onload's read
    # back into the storage grown again (tools/speed_probe.py), slower than the write out: its pages are fresh
    host_in_bytes_per_s: float | None = None
    # CPU: one 2-rank gloo all-reduce of a decode step's rows (16 KiB), mean over many with a layer's work between,
    # the wake-ups it waits for included (tools/speed_probe.py); None: not measured (CUDA: NCCL)
    gloo_all_reduce_seconds: float | None = None
    # CPU: bytes one rank sends (and as many it receives at once) per second when two gloo ranks exchange 16 MiB,
    # as the weight sync's transport does (tools/speed_probe.py); None: not measured (CUDA: NCCL over the link)
    gloo_exchange_bytes_per_s: float | None = None
    # CPU: bytes one rank sends per second in a 2-rank gloo reduce-scatter of a 64 MiB fp32 buffer (half of it), and
    # in an all-gather into one (tools/speed_probe.py): megatron's DP gradient reduction and param gather (gloo's are
    # ~0.3 and ~0.45 GB/s here, a twentieth of a copy); None: not measured (CUDA: NCCL over the link)
    gloo_reduce_scatter_bytes_per_s: float | None = None
    gloo_all_gather_bytes_per_s: float | None = None
    cores: int = 0  # CPU: the cores the node's ranks share (0: not a CPU)
    # CPU: seconds per weight byte of one torch ``F.linear`` of [rows, in] by an [out, in] weight read from memory
    # (not from cache), by dtype and row count (tools/speed_probe.py): a skinny GEMM (a decode step's, one expert's
    # few rows) neither reads its weight at the copy's bandwidth nor reaches the matmul's FLOP/s. None: a CUDA
    # device's, whose GEMM reads its weight at the memory bandwidth and runs its FLOPs at the peak
    gemm_seconds_per_weight_byte: dict[str, dict[int, float]] | None = None
    # CPU: the (out, in, how many) weights that table was measured at, the planned engine rank's, in the planned
    # dtype only (the table is their byte-weighted mean; tools/speed_probe.py); None: its one default shape in each
    # dtype, or no table
    gemm_weights: tuple[tuple[int, int, int], ...] | None = None
    source: dict[str, str] = field(default_factory=dict)
    measured: bool = False  # measured on this machine (CPU) rather than read from a datasheet

    def __post_init__(self) -> None:
        rates = (self.memory_bytes_per_s, self.host_bytes_per_s, self.intra_node_bytes_per_s)
        if min(rates) <= 0 or self.inter_node_bytes_per_s <= 0 or self.op_seconds <= 0:
            raise ValueError(f"speed {self.name!r}: every rate and op_seconds must be > 0")
        if self.fresh_bytes_per_s is not None and self.fresh_bytes_per_s <= 0:
            raise ValueError(f"speed {self.name!r}: fresh_bytes_per_s={self.fresh_bytes_per_s} must be > 0")
        for name in (
            "host_in_bytes_per_s",
            "gloo_exchange_bytes_per_s",
            "gloo_all_reduce_seconds",
            "gloo_reduce_scatter_bytes_per_s",
            "gloo_all_gather_bytes_per_s",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"speed {self.name!r}: {name}={value} must be > 0 (None: not measured)")
        if self.draw_seconds is not None and self.draw_seconds <= 0:
            raise ValueError(
                f"speed {self.name!r}: draw_seconds={self.draw_seconds} must be > 0 (None: a CUDA device's)"
            )
        if not self.flops_per_s or min(self.flops_per_s.values()) <= 0:
            raise ValueError(f"speed {self.name!r}: flops_per_s needs a rate > 0 per dtype")
        if self.gemm_seconds_per_weight_byte is not None:  # JSON keys are strings: rows as ints
            table = {
                dtype: {int(rows): float(s) for rows, s in by_rows.items()}
                for dtype, by_rows in self.gemm_seconds_per_weight_byte.items()
            }
            if any(not by_rows or min(by_rows) < 1 or min(by_rows.values()) <= 0 for by_rows in table.values()):
                raise ValueError(
                    f"speed {self.name!r}: gemm_seconds_per_weight_byte needs, per dtype, rows >= 1 and seconds > 0"
                )
            object.__setattr__(self, "gemm_seconds_per_weight_byte", table)
        if self.gemm_weights is not None:  # speed.json's lists as the tuples the probe made
            object.__setattr__(self, "gemm_weights", tuple(tuple(int(n) for n in w) for w in self.gemm_weights))

    @property
    def fresh_write_bytes_per_s(self) -> float:
        """Bytes/s written into fresh allocations (``fresh_bytes_per_s``, else the memory bandwidth)."""
        return self.fresh_bytes_per_s or self.memory_bytes_per_s

    @property
    def onload_bytes_per_s(self) -> float:
        """Bytes/s of an onload, host to device (``host_in_bytes_per_s``, else ``host_bytes_per_s``)."""
        return self.host_in_bytes_per_s or self.host_bytes_per_s

    @property
    def seconds_per_draw(self) -> float:
        return self.draw_seconds if self.draw_seconds is not None else 4 / self.memory_bytes_per_s

    def flops(self, dtype: str) -> float:
        if dtype not in self.flops_per_s:
            raise ValueError(
                f"speed {self.name!r} has no FLOP/s for dtype {dtype!r}; it has {sorted(self.flops_per_s)}"
            )
        return self.flops_per_s[dtype]

    def gemm_seconds_per_byte(self, dtype: str, rows: float) -> float | None:
        """Seconds per weight byte of a GEMM of ``rows`` rows (:attr:`gemm_seconds_per_weight_byte`), interpolated
        log-log between the measured row counts; fewer than the first: the first's (the weight is read whatever
        the rows); more than the last: the last's, growing with the rows (the FLOPs bound it). None: no table."""
        table = (self.gemm_seconds_per_weight_byte or {}).get(dtype)
        if not table:
            return None
        measured = sorted(table)
        rows = max(float(rows), float(measured[0]))
        if rows >= measured[-1]:
            return table[measured[-1]] * rows / measured[-1]
        upper = next(r for r in measured if r >= rows)
        lower = max(r for r in measured if r <= rows)
        if upper == lower:
            return table[lower]
        fraction = math.log(rows / lower) / math.log(upper / lower)
        return math.exp(math.log(table[lower]) * (1 - fraction) + math.log(table[upper]) * fraction)

    def oversubscription(self, ranks_per_node: int) -> float:
        """CPU: how many ranks share one core (>= 1); each rank's serial work takes that many times longer. CUDA: 1."""
        return max(1.0, ranks_per_node / self.cores) if self.kind == "cpu" and self.cores else 1.0

    def compute_stretch(self, ranks_per_node: int) -> float:
        """CPU: a rank's math runs on cores / ranks of the machine (run/launch.py::spawn_local gives each rank that
        many OpenMP threads, at least 1), and ``flops_per_s`` is one core's: the time's factor ranks / cores. CUDA: 1."""
        return ranks_per_node / self.cores if self.kind == "cpu" and self.cores else 1.0


# Kernel launch: ~5 us per launch is what NVIDIA's CUDA C++ Best Practices Guide's "kernel launch overhead" section
# and the nsys traces in megatron's issues show for eager PyTorch; never measured here (a lent GPU's gpu-check fits it).
_LAUNCH_SECONDS = 5e-6
_SOURCE_H100 = {
    "flops": "NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 TFLOPS with sparsity (989 dense), FP32 67 TFLOPS",
    "memory": "same datasheet: HBM3 3.35 TB/s",
    "intra_node": "same datasheet: NVLink 900 GB/s (both directions; 450 GB/s each way)",
    "host": "PCIe Gen5 x16: 64 GB/s each way",
    "inter_node": "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU (50 GB/s)",
    "op": "estimate: ~5 us per eager kernel launch; no GPU has measured it here",
}
_H100 = SpeedSpec(
    name="H100-80GB",
    kind="cuda",
    flops_per_s={"bfloat16": 989 * TFLOPS, "float16": 989 * TFLOPS, "float32": 67 * TFLOPS},
    memory_bytes_per_s=3350 * GB,
    host_bytes_per_s=64 * GB,
    intra_node_bytes_per_s=450 * GB,
    inter_node_bytes_per_s=50 * GB,
    op_seconds=_LAUNCH_SECONDS,
    source=_SOURCE_H100,
)
_A100_80 = SpeedSpec(
    name="A100-80GB",
    kind="cuda",
    flops_per_s={"bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS, "float32": 19.5 * TFLOPS},
    memory_bytes_per_s=2039 * GB,
    host_bytes_per_s=32 * GB,
    intra_node_bytes_per_s=300 * GB,
    inter_node_bytes_per_s=25 * GB,
    op_seconds=_LAUNCH_SECONDS,
    source={
        "flops": "NVIDIA A100 Tensor Core GPU datasheet, SXM: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS",
        "memory": "same datasheet, 80GB SXM: HBM2e 2,039 GB/s",
        "intra_node": "same datasheet: NVLink 600 GB/s (both directions; 300 GB/s each way)",
        "host": "PCIe Gen4 x16: 32 GB/s each way",
        "inter_node": "NVIDIA DGX A100 datasheet: 8x ConnectX-6 200 Gb/s, one per GPU (25 GB/s)",
        "op": _SOURCE_H100["op"],
    },
)
SPEED_PRESETS: dict[str, SpeedSpec] = {
    "H100-80GB": _H100,
    # the same compute and links as the H100; more HBM, faster
    "H200-141GB": dataclasses.replace(
        _H100,
        name="H200-141GB",
        memory_bytes_per_s=4800 * GB,
        source={
            **_SOURCE_H100,
            "flops": "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity (989 dense), FP32 67",
            "memory": "same datasheet: HBM3e 4.8 TB/s",
            "inter_node": "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU (50 GB/s)",
        },
    ),
    "A100-80GB": _A100_80,
    "A100-40GB": dataclasses.replace(
        _A100_80,
        name="A100-40GB",
        memory_bytes_per_s=1555 * GB,
        source={**_A100_80.source, "memory": "same datasheet, 40GB SXM: HBM2 1,555 GB/s"},
    ),
    "B200": SpeedSpec(
        name="B200",
        kind="cuda",
        flops_per_s={"bfloat16": 2250 * TFLOPS, "float16": 2250 * TFLOPS, "float32": 75 * TFLOPS},
        memory_bytes_per_s=8000 * GB,
        host_bytes_per_s=64 * GB,
        intra_node_bytes_per_s=900 * GB,
        inter_node_bytes_per_s=50 * GB,
        op_seconds=_LAUNCH_SECONDS,
        source={
            "flops": "NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 4.5 PFLOPS with sparsity (2.25 dense), FP32 75 TFLOPS",
            "memory": "same datasheet: HBM3e 8 TB/s per GPU",
            "intra_node": "same datasheet: NVLink 5 1.8 TB/s per GPU (both directions; 900 GB/s each way)",
            "host": "PCIe Gen5 x16: 64 GB/s each way",
            "inter_node": "NVIDIA DGX B200 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU (50 GB/s)",
            "op": _SOURCE_H100["op"],
        },
    ),
}


def speed_preset(name: str) -> SpeedSpec:
    """The datasheet speeds of a CUDA preset (planner.devices.DEVICE_NAMES, case-insensitive). ``cpu`` has none: its
    speeds are this machine's, measured by tools/speed_probe.py::measure_cpu_speed."""
    by_lower = {n.lower(): n for n in SPEED_PRESETS}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        hint = "; cpu's speeds are measured (tools/speed_probe.py)" if str(name).lower() == "cpu" else ""
        raise ValueError(f"no speed profile for device {name!r}; choose one of {list(SPEED_PRESETS)}{hint}")
    return SPEED_PRESETS[canonical]
