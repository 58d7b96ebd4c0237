"""The actor's per-tag memory ledger and the storage offloader behind offload/onload.

Tags (DESIGN.md, "Memory: names and sources"): ``actor_params``, ``actor_grads``, ``optimizer``. The
ledger counts the bytes each tag holds in the actor's working memory (the GPU on CUDA; the original
tensor storages on CPU) and, separately, the host copies made by offload. Every operation runs inside
``ledger.op(name)`` and leaves its peak per tag in ``ledger.peaks[name]``. The ledger explains memory, it
does not measure it: the measurement (``telemetry/memory_timeline.py``) owns the device's peak counters and resets them
once per phase, so nothing here touches ``torch.cuda.reset_peak_memory_stats`` (a reset inside a phase
would make the phase's peak cover only its last operation).

Offload copies each distinct storage behind a set of tensors into one host buffer, then releases the
original with ``untyped_storage().resize_(0)``: parameter, ``main_grad`` and optimizer-state views keep
their identity (and the DDP buffer views stay valid), so onload is ``resize_`` back + copy, bit-exact.
Grads are the exception: the next step zeroes them before use, so they are released without a copy
and come back zeroed.

The host buffer is pinned host memory on CUDA, exactly as large as the storage (``cudaHostRegister`` on
a plain host tensor, not torch's caching host allocator, which rounds up to powers of two). It is
registered once, at the first offload, and kept for the run: every later offload/onload of the same
storage copies into and out of the same buffer (registering pins and maps every page: ~57 GB per rank per
step for qwen32b_8xh100 if redone each time). So on CUDA the ledger's ``host/<tag>`` stays at the pinned
bytes after onload, as the host really holds them;
:meth:`StorageOffloader.release_host` unregisters. On CPU the "device" already is host memory, so the
host tier is one temporary file per offload (in ``offload_dir``: the page cache), every storage at its own
offset, written with ``pwrite`` and read back with ``preadv`` straight into the re-grown storage: nothing is
ever mapped into this process, and ``malloc_trim`` hands the freed original back to the OS, so process RSS
really drops by what was offloaded. One file and plain writes, not a file and a shared mapping per storage:
an optimizer's ~100 small storages cost 0.24 ms each to create and map, and page faults into a mapped
file of a few MiB run at half the rate of a ``write`` (docs/plan-validation.md, 2026-11-30).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile

import torch

from colocation.host_memory import release_freed_host_memory
from colocation.phases import ACTOR_STATE

TAGS = ACTOR_STATE  # the step's names for the actor's state (colocation/phases.py)
CPU_IO_BYTES = 1 << 30  # the most one pwrite/preadv moves (Linux stops a single call near 2 GiB)


class MemoryLedger:
    """Bytes per tag, resident (working memory) and offloaded (host copies), with per-op peaks."""

    def __init__(self) -> None:
        self.resident_bytes = dict.fromkeys(TAGS, 0)
        self.host_bytes = dict.fromkeys(TAGS, 0)
        self.peaks: dict[str, dict[str, int]] = {}
        self._current: dict[str, int] | None = None

    def set(self, tag: str, resident_bytes: int | None = None, host_bytes: int | None = None) -> None:
        if tag not in TAGS:
            raise ValueError(f"unknown memory tag {tag!r}; tags are {TAGS}")
        if resident_bytes is not None:
            self.resident_bytes[tag] = int(resident_bytes)
        if host_bytes is not None:
            self.host_bytes[tag] = int(host_bytes)
        self._observe()

    def snapshot(self) -> dict[str, int]:
        """{tag: resident bytes} plus ``host/<tag>`` for offloaded copies."""
        out = dict(self.resident_bytes)
        out.update({f"host/{tag}": n for tag, n in self.host_bytes.items()})
        out["host_pinned"] = sum(self.host_bytes.values()) if torch.cuda.is_available() else 0
        return out

    def _observe(self) -> None:
        if self._current is None:
            return
        for key, value in self.snapshot().items():
            self._current[key] = max(self._current.get(key, 0), value)

    @contextlib.contextmanager
    def op(self, name: str):
        """Track the ledger's peak per tag while ``name`` runs; kept in ``peaks[name]`` (no device counters)."""
        outer = self._current
        self._current = {}
        self._observe()
        try:
            yield
        finally:
            self._observe()
            self.peaks[name] = self._current
            if outer is not None:
                for key, value in self._current.items():
                    outer[key] = max(outer.get(key, 0), value)
            self._current = outer


def unique_storages(tensors) -> list[torch.UntypedStorage]:
    """Distinct non-empty storages behind ``tensors`` (views of one buffer count once)."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


def storage_bytes(tensors) -> int:
    return sum(s.nbytes() for s in unique_storages(tensors))


def _cudart():
    return torch.cuda.cudart()


def pinned_empty(nbytes: int, cudart=None) -> torch.Tensor:
    """Exactly ``nbytes`` of page-locked host memory: a plain host tensor registered with
    ``cudaHostRegister``. ``torch.empty(pin_memory=True)`` goes through torch's caching host allocator,
    which rounds every block up to a power of two and keeps it after the tensor dies: offloading a 7B
    model's params and optimizer that way pins ~1.7x the bytes moved. Release with :func:`unpin`."""
    cudart = cudart or _cudart()
    host = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes], malloc/mmap'd: the exact size, page-rounded
    err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)  # 0: cudaHostRegisterDefault
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {int(err)}")
    return host


def unpin(host: torch.Tensor | None, cudart=None) -> None:
    """Undo :func:`pinned_empty` (before the tensor's memory goes back to the host allocator)."""
    if host is None:
        return
    cudart = cudart or _cudart()
    err = cudart.cudaHostUnregister(host.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed with cudaError {int(err)}")


def _bytes_of(view: torch.Tensor) -> memoryview:
    """The bytes of ``view`` ([nbytes] uint8, CPU) as a memoryview over its memory. Not ``view.numpy()``: sharing a
    storage with numpy marks it not resizable, and the offload resizes it to 0."""
    return memoryview((ctypes.c_ubyte * view.numel()).from_address(view.data_ptr())).cast("B")


class HostFile:
    """CPU's host tier for one offload: a temporary file (the page cache) holding each storage at its own offset,
    written and read with plain ``pwrite`` / ``preadv`` calls, so none of it is ever mapped into this process."""

    def __init__(self, offload_dir: str | None = None):
        self._file = tempfile.TemporaryFile(dir=offload_dir, prefix="actor-offload-")
        self.nbytes = 0

    def append(self, view: torch.Tensor) -> int:
        """Write ``view`` ([nbytes] uint8) at the end of the file; returns its offset."""
        offset, data = self.nbytes, _bytes_of(view)
        done = 0
        while done < len(data):
            done += os.pwrite(self._file.fileno(), data[done : done + CPU_IO_BYTES], offset + done)
        self.nbytes += len(data)
        return offset

    def read_into(self, view: torch.Tensor, offset: int) -> None:
        """Fill ``view`` ([nbytes] uint8) from the bytes written at ``offset``."""
        data, done = _bytes_of(view), 0
        while done < len(data):
            read = os.preadv(self._file.fileno(), [data[done : done + CPU_IO_BYTES]], offset + done)
            if read == 0:
                raise EOFError(f"the offload file ends {len(data) - done} bytes short of a storage at {offset}")
            done += read

    def close(self) -> None:
        self._file.close()


class HostCopy:
    """The bytes of one storage while offloaded: pinned memory on CUDA (kept across offloads: :meth:`refill`),
    a slice of the offload's :class:`HostFile` on CPU (``pin=True`` takes the CUDA path anywhere, for tests with a
    stub ``cudart``)."""

    def __init__(self, view: torch.Tensor, host_file: HostFile | None = None, pin: bool | None = None, cudart=None):
        # view: [nbytes] uint8 over the storage being offloaded
        self.nbytes = view.numel()
        self.pinned = view.device.type == "cuda" if pin is None else pin
        self._cudart = cudart
        if self.pinned:
            self._host = pinned_empty(self.nbytes, cudart=cudart)
            self._host.copy_(view)
            return
        self._file, self._offset = host_file, host_file.append(view)

    def refill(self, view: torch.Tensor) -> None:
        """Pinned only: copy ``view`` into the buffer already registered (no new registration)."""
        self._host.copy_(view)

    def copy_to(self, view: torch.Tensor) -> None:
        if self.pinned:
            view.copy_(self._host, non_blocking=True)
            return
        self._file.read_into(view, self._offset)

    def free(self) -> None:
        """Pinned only: unregister the buffer (a CPU copy goes with its offload's file)."""
        unpin(self._host, cudart=self._cudart)
        self._host = None


class StorageOffloader:
    """Moves the storages behind one tag's tensors to a host buffer and back (bit-exact)."""

    def __init__(
        self,
        tag: str,
        ledger: MemoryLedger,
        offload_dir: str | None = None,
        keep_contents: bool = True,
        pin: bool | None = None,
        cudart=None,
    ):
        self.tag = tag
        self.ledger = ledger
        self.offload_dir = offload_dir  # CPU only: where an offload's host file lives (None: $TMPDIR)
        # False (grads): the next use zeroes the tensors first, so offload only releases the storages and
        # onload hands them back zeroed; nothing crosses to the host either way
        self.keep_contents = keep_contents
        self.pin, self.cudart = pin, cudart  # None: pinned iff the storage is on CUDA; cudart: a stub in tests
        self._saved: list[tuple[torch.UntypedStorage, HostCopy | int]] = []
        # pinned host buffers, one per storage in offload order, registered once and reused every offload
        self._pinned: list[HostCopy] = []
        self._host_file: HostFile | None = None  # CPU: the current offload's file, closed by the onload

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    @torch.no_grad()
    def offload(self, tensors) -> int:
        """Copy to host then release the originals; returns the bytes released."""
        if self._saved:
            return 0
        released = 0
        for i, storage in enumerate(unique_storages(tensors)):
            nbytes = storage.nbytes()
            if self.keep_contents:
                view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # [nbytes] bytes
                if i < len(self._pinned) and self._pinned[i].nbytes == nbytes:
                    host = self._pinned[i]  # registered at an earlier offload: reuse it
                    host.refill(view)
                else:
                    pin = view.device.type == "cuda" if self.pin is None else self.pin
                    if not pin and self._host_file is None:
                        self._host_file = HostFile(self.offload_dir)
                    host = HostCopy(view, self._host_file, pin=pin, cudart=self.cudart)
                    if host.pinned:
                        self._keep_pinned(i, host)
                        self.ledger.set(self.tag, host_bytes=self.ledger.host_bytes[self.tag] + nbytes)
                del view
                self._saved.append((storage, host))
                if not host.pinned:
                    self.ledger.set(self.tag, host_bytes=self.ledger.host_bytes[self.tag] + nbytes)  # both copies exist
            else:
                self._saved.append((storage, nbytes))
            storage.resize_(0)
            released += nbytes
            self.ledger.set(self.tag, resident_bytes=self.ledger.resident_bytes[self.tag] - nbytes)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        else:
            release_freed_host_memory()
        return released

    @torch.no_grad()
    def onload(self) -> int:
        """Re-allocate the original storages and copy the host bytes back; returns the bytes restored."""
        restored = 0
        for storage, host in self._saved:
            nbytes = host.nbytes if isinstance(host, HostCopy) else host
            storage.resize_(nbytes)
            view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            if isinstance(host, HostCopy):
                host.copy_to(view)
            else:
                view.zero_()
            del view
            restored += nbytes
            self.ledger.set(self.tag, resident_bytes=self.ledger.resident_bytes[self.tag] + nbytes)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._host_file is not None:  # CPU: the file goes; pinned buffers stay registered for the next offload
            self._host_file.close()
            self._host_file = None
        self._saved = []
        self.ledger.set(self.tag, host_bytes=sum(h.nbytes for h in self._pinned))
        if not torch.cuda.is_available():
            release_freed_host_memory()
        return restored

    def _keep_pinned(self, index: int, host: HostCopy) -> None:
        """Remember a new pinned buffer at ``index`` (replacing, and unregistering, one of another size)."""
        if index < len(self._pinned):
            old = self._pinned[index]
            self.ledger.set(self.tag, host_bytes=self.ledger.host_bytes[self.tag] - old.nbytes)
            old.free()
            self._pinned[index] = host
        else:
            self._pinned.append(host)

    def release_host(self) -> None:
        """Unregister and drop the pinned host buffers (onloaded state only; the end of a run)."""
        if self._saved:
            raise RuntimeError(f"{self.tag} is offloaded: onload it before releasing its host buffers")
        for host in self._pinned:
            host.free()
        self._pinned = []
        self.ledger.set(self.tag, host_bytes=0)
