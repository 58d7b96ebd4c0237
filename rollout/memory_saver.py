"""Tagged, pausable memory: ``region(tag)`` / ``pause(tag)`` / ``resume(tag)`` with a per-tag byte ledger.

Allocate inside ``with saver.region("weights"):`` and hand each tensor to ``saver.track(tensor)``
(the ledger counts tracked bytes; the portable backend needs the tensors to release them).

Backends:
- ``torch_memory_saver`` (CUDA, when the package is installed): allocations inside the region come from
  torch-memory-saver's pool; ``pause`` unmaps the physical pages and keeps virtual addresses, so
  pointers (and CUDA graphs) stay valid.
- ``portable`` (CPU and CUDA): ``pause`` shrinks each tracked tensor's storage to 0 bytes
  (``untyped_storage().resize_(0)``) and ``resume`` re-allocates it (same tensor objects, new address,
  contents zero unless ``cpu_backup``). Large host allocations are mmapped by glibc, so freeing them
  returns pages to the OS; :func:`colocation.host_memory.release_freed_host_memory` returns what the heap
  can.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from colocation.host_memory import release_freed_host_memory
from colocation.phases import ENGINE_STATE

TAGS = ENGINE_STATE  # the step's names for the engine's state (colocation/phases.py)
BACKENDS = ("auto", "portable", "torch_memory_saver")


def torch_memory_saver_available() -> bool:
    try:
        # optional: torch_memory_saver is imported where it is used, not every install has it
        import torch_memory_saver  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class MemorySaver:
    """Per-tag pausable memory with a byte ledger (``bytes_by_tag()`` -> {tag: resident bytes})."""

    def __init__(self, backend: str = "auto", device: torch.device | str = "cpu") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"memory saver backend={backend!r} is not one of {BACKENDS}")
        device = torch.device(device)
        if backend == "auto":
            backend = "torch_memory_saver" if device.type == "cuda" and torch_memory_saver_available() else "portable"
        if backend == "torch_memory_saver":
            if device.type != "cuda" or not torch_memory_saver_available():
                raise ValueError(
                    "rollout.memory_saver=torch_memory_saver needs CUDA and the package: "
                    "`make install EXTRAS=dev,gpu`, or use rollout.memory_saver=portable"
                )
            # optional: torch_memory_saver is imported where it is used, not every install has it
            import torch_memory_saver

            tms = torch_memory_saver.torch_memory_saver
            # Without LD_PRELOAD of its hook library, use torch's pluggable-allocator hook (must be chosen
            # before the first region; newer releases expose it as `hook_mode`).
            if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", "") and getattr(tms, "_impl", None) is None:
                with contextlib.suppress(AttributeError):
                    tms.hook_mode = "torch"
            self._tms = tms
        else:
            self._tms = None
        self.backend = backend
        self.device = device
        self._tensors: dict[str, list[torch.Tensor]] = {}
        self._nbytes: dict[str, list[int]] = {}
        self._backups: dict[str, list[torch.Tensor | None]] = {}
        self._cpu_backup: dict[str, bool] = {}
        self._paused: set[str] = set()
        self._current: list[str] = []

    @contextlib.contextmanager
    def region(self, tag: str, cpu_backup: bool = False) -> Iterator[MemorySaver]:
        """Allocations made (and tracked) inside belong to ``tag``; ``cpu_backup`` keeps contents across pause."""
        if tag in self._paused:
            raise RuntimeError(f"tag {tag!r} is paused; resume it before allocating into it")
        self._cpu_backup[tag] = cpu_backup
        self._tensors.setdefault(tag, [])
        self._nbytes.setdefault(tag, [])
        self._current.append(tag)
        try:
            if self._tms is not None:
                with self._tms.region(tag=tag, enable_cpu_backup=cpu_backup):
                    yield self
            else:
                yield self
        finally:
            self._current.pop()

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Record ``tensor`` (allocated inside the current region) under the region's tag; returns it."""
        if not self._current:
            raise RuntimeError("track() must be called inside `with saver.region(tag):`")
        tag = self._current[-1]
        self._tensors[tag].append(tensor)
        self._nbytes[tag].append(tensor.untyped_storage().nbytes())
        return tensor

    def is_paused(self, tag: str) -> bool:
        return tag in self._paused

    def pause(self, tag: str) -> int:
        """Release the memory of ``tag``; returns the bytes released (0 when already paused or unknown)."""
        if tag in self._paused or tag not in self._tensors:
            return 0
        released = sum(self._nbytes[tag])
        if self._tms is not None:
            torch.cuda.synchronize(self.device)
            self._tms.pause(tag)
        else:
            backup = self._cpu_backup.get(tag, False)
            self._backups[tag] = []
            for tensor in self._tensors[tag]:
                storage = tensor.untyped_storage()
                # a host copy (level-1 sleep); on a CPU device it would not release anything, so skip it
                keep = backup and tensor.device.type != "cpu"
                self._backups[tag].append(tensor.detach().to("cpu", copy=True) if keep else None)
                storage.resize_(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            else:
                release_freed_host_memory()
        self._paused.add(tag)
        return released

    def resume(self, tag: str) -> int:
        """Bring back the memory of ``tag`` (zeros unless it was backed up); returns the bytes re-allocated."""
        if tag not in self._paused:
            return 0
        if self._tms is not None:
            self._tms.resume(tag)
        else:
            for tensor, nbytes, backup in zip(self._tensors[tag], self._nbytes[tag], self._backups.pop(tag)):
                tensor.untyped_storage().resize_(nbytes)
                with torch.no_grad():
                    if backup is not None:
                        tensor.copy_(backup)
                    else:
                        tensor.zero_()
        self._paused.discard(tag)
        return sum(self._nbytes[tag])

    def bytes_by_tag(self) -> dict[str, int]:
        """Resident bytes per tag (0 while paused)."""
        return {tag: 0 if tag in self._paused else sum(n) for tag, n in self._nbytes.items()}
