"""Device presets: how many bytes one rank's device holds.

A CUDA preset's ``total_bytes`` is the memory NVML reports for the board (``nvidia-smi``'s total);
the CUDA context, library workspaces and kernels come off it as the plan's runtime overhead. ``cpu``
is this machine's memory (psutil) shared by the ranks running on it, so one rank's share is the total
divided by the ranks per node.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_KINDS = ("cuda", "cpu")
GIB = 2**30
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One rank's device: a name, ``cuda`` or ``cpu``, and the bytes it holds."""

    name: str
    kind: str
    total_bytes: int

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"device kind {self.kind!r} is not one of {DEVICE_KINDS}")
        if self.total_bytes <= 0:
            raise ValueError(f"device {self.name!r}: total_bytes={self.total_bytes} must be > 0")


# name -> total bytes per board (nvidia-smi's "MiB" total).
CUDA_PRESETS: dict[str, int] = {
    "H100-80GB": 81559 * MIB,
    "H200-141GB": 143771 * MIB,
    "A100-80GB": 81920 * MIB,
    "A100-40GB": 40960 * MIB,
    "B200": 183359 * MIB,
}
DEVICE_NAMES = (*CUDA_PRESETS, "cpu")


def device_preset(name: str, ranks_per_node: int = 1) -> DeviceSpec:
    """``H100-80GB`` / ``H200-141GB`` / ``A100-80GB`` / ``A100-40GB`` / ``B200`` / ``cpu`` (case-insensitive).

    ``ranks_per_node`` only matters for ``cpu``: the ranks of one machine share its memory.
    """
    by_lower = {n.lower(): n for n in DEVICE_NAMES}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"device {name!r} is not a preset; choose one of {list(DEVICE_NAMES)}")
    if canonical == "cpu":
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1")
        import psutil  # the machine's memory; only the cpu preset needs it

        return DeviceSpec(name="cpu", kind="cpu", total_bytes=psutil.virtual_memory().total // ranks_per_node)
    return DeviceSpec(name=canonical, kind="cuda", total_bytes=CUDA_PRESETS[canonical])
