"""Device presets: how many bytes one rank's device holds, and how much RAM its node has.

A CUDA preset's ``total_bytes`` is what ``torch.cuda.mem_get_info`` reports as the total (``cudaMemGetInfo``,
the same figure as ``cudaGetDeviceProperties().totalGlobalMem`` and deviceQuery's "Total amount of global
memory"): what the runs measure against, a few hundred MiB less than NVML's (``nvidia-smi``'s) total. Where no
such figure is sourced the preset says so (``total_source`` "estimate") and carries an uncertainty, which the
plan counts in its headroom. The CUDA context, library workspaces and kernels come off it as the plan's
runtime overhead. ``cpu`` is this machine's memory (psutil) shared by the ranks running on it, so one rank's
share is the total divided by the ranks per node.

``host_memory_bytes`` is one node's RAM (the host plan, planner/host.py, compares a node's ranks against it),
from the system's datasheet; ``cluster.host_memory_gib`` overrides it (run/memory_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

DEVICE_KINDS = ("cuda", "cpu")
GIB = 2**30
MIB = 2**20
TIB = 2**40


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One rank's device: a name, ``cuda`` or ``cpu``, the bytes it holds (with the uncertainty of that figure
    and its source) and its node's RAM (None: unknown)."""

    name: str
    kind: str
    total_bytes: int
    total_uncertainty_bytes: int = 0
    total_source: str = ""
    host_memory_bytes: int | None = None
    host_memory_source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"device kind {self.kind!r} is not one of {DEVICE_KINDS}")
        if self.total_bytes <= 0:
            raise ValueError(f"device {self.name!r}: total_bytes={self.total_bytes} must be > 0")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise ValueError(f"device {self.name!r}: host_memory_bytes={self.host_memory_bytes} must be > 0, or None")


@dataclass(frozen=True)
class CudaPreset:
    nvml_total_bytes: int  # nvidia-smi's total ("MiB")
    total_bytes: int  # torch.cuda.mem_get_info()'s total
    total_uncertainty_bytes: int
    total_source: str
    host_memory_bytes: int  # one node's RAM (the board's usual 8-GPU system)
    host_memory_source: str


# NVML's total less what cudaMemGetInfo reports where both are sourced: A100-40GB 40960 - 40339 = 621 MiB,
# B200 183359 - 182630 = 729 MiB. Presets without a sourced cudaMemGetInfo total take NVML's less the mean gap,
# the spread of the two gaps as their uncertainty.
_NVML_GAP_BYTES = 675 * MIB
_NVML_GAP_UNCERTAINTY_BYTES = 128 * MIB
_ESTIMATE = (
    "estimate: NVML's total less 675 MiB, the mean gap between NVML's and cudaMemGetInfo's totals on the two "
    "boards with both sourced (A100-40GB 621 MiB, B200 729 MiB); read torch.cuda.mem_get_info()[1] on one to source it"
)
_DGX_2TIB = (
    "NVIDIA DGX {} datasheet: 2 TB system memory (the OS reports a little less: override with cluster.host_memory_gib)"
)
CUDA_PRESETS: dict[str, CudaPreset] = {
    "H100-80GB": CudaPreset(
        81559 * MIB,
        81559 * MIB - _NVML_GAP_BYTES,
        _NVML_GAP_UNCERTAINTY_BYTES,
        _ESTIMATE,
        2 * TIB,
        _DGX_2TIB.format("H100"),
    ),
    "H200-141GB": CudaPreset(
        143771 * MIB,
        143771 * MIB - _NVML_GAP_BYTES,
        _NVML_GAP_UNCERTAINTY_BYTES,
        _ESTIMATE,
        2 * TIB,
        _DGX_2TIB.format("H200"),
    ),
    "A100-80GB": CudaPreset(
        81920 * MIB,
        81920 * MIB - _NVML_GAP_BYTES,
        _NVML_GAP_UNCERTAINTY_BYTES,
        _ESTIMATE,
        2 * TIB,
        "NVIDIA DGX A100 640GB datasheet: 2 TB system memory",
    ),
    "A100-40GB": CudaPreset(
        40960 * MIB,
        42298834944,
        0,
        "deviceQuery on an A100-SXM4-40GB: 'Total amount of global memory: 40339 MBytes (42298834944 bytes)' "
        "(bottlerocket-os/bottlerocket#3873)",
        1 * TIB,
        "NVIDIA DGX A100 320GB datasheet: 1 TB system memory",
    ),
    "B200": CudaPreset(
        183359 * MIB,
        round(178.35 * GIB),
        5 * MIB,
        "cudaGetDeviceProperties on a B200: 'Total Global Memory: 178.35 GB' (GiB: 2^30; pytorch/ao#4002), "
        "+- its rounding",
        2 * TIB,
        "NVIDIA DGX B200 datasheet: 2 TB system memory (up to 4 TB)",
    ),
}
DEVICE_NAMES = (*CUDA_PRESETS, "cpu")


def device_preset(name: str, ranks_per_node: int = 1, host_memory_bytes: int | None = None) -> DeviceSpec:
    """``H100-80GB`` / ``H200-141GB`` / ``A100-80GB`` / ``A100-40GB`` / ``B200`` / ``cpu`` (case-insensitive).

    ``ranks_per_node`` only matters for ``cpu``: the ranks of one machine share its memory.
    ``host_memory_bytes`` overrides the preset's node RAM (``cluster.host_memory_gib``).
    """
    by_lower = {n.lower(): n for n in DEVICE_NAMES}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"device {name!r} is not a preset; choose one of {list(DEVICE_NAMES)}")
    override = "cluster.host_memory_gib"
    if canonical == "cpu":
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1")

        total = psutil.virtual_memory().total
        return DeviceSpec(
            name="cpu",
            kind="cpu",
            total_bytes=total // ranks_per_node,
            total_source="psutil.virtual_memory().total / ranks per node",
            host_memory_bytes=host_memory_bytes or total,
            host_memory_source=override if host_memory_bytes else "psutil.virtual_memory().total",
        )
    preset = CUDA_PRESETS[canonical]
    return DeviceSpec(
        name=canonical,
        kind="cuda",
        total_bytes=preset.total_bytes,
        total_uncertainty_bytes=preset.total_uncertainty_bytes,
        total_source=preset.total_source,
        host_memory_bytes=host_memory_bytes or preset.host_memory_bytes,
        host_memory_source=override if host_memory_bytes else preset.host_memory_source,
    )
