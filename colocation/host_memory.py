"""Returning freed host memory to the OS, so the process's resident memory really drops, and keeping
glibc's allocator from fragmenting it."""

from __future__ import annotations

import atexit
import ctypes
import gc


def release_freed_host_memory() -> None:
    """Collect garbage, then ``malloc_trim(0)``: glibc keeps freed heap pages mapped until asked."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


def freeze_long_lived_objects() -> None:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze()``), after a collection.

    A rank's setup builds hundreds of thousands of long-lived objects (megatron's modules, the engine,
    transformers' tokenizer). Without this, each :func:`release_freed_host_memory` and each of Python's own
    full collections walks all of them: measured on tiny_cpu, a third of a CPU step. Frozen objects are
    still freed by reference counting; only cycles among them are left to the end of the process, which
    unfreezes them first (else its last collection skips them and nanobind's modules report them leaked).
    """
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)


# mallopt(3) parameters
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# allocations of this size or more are mmapped, and unmapped on free (configure_host_allocator)
MMAP_THRESHOLD_BYTES = 4 << 10
# ... unless glibc's free heap can serve them: it maps a buffer only when no free chunk fits (sysmalloc), and the
# heap keeps up to M_TOP_PAD / M_TRIM_THRESHOLD (128 KiB each) free at its top. Measured (minor faults per decode
# step of the native engine under this allocator, tiny:qwen2 and tiny:qwen2_memory at 1, 8 and 64 sequences:
# docs/plan-validation.md, 2026-11-30 afternoon): its new tensors of 16 KiB or more fault every page in, smaller ones
# mostly come from the heap. The step-time model (planner/step_time.py) counts the first kind's pages.
FAULTING_TENSOR_BYTES = 16 << 10


def configure_host_allocator(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES, arena_max: int = 1) -> bool:
    """Make glibc hand buffers straight back to the OS and reuse the rest; False where not glibc.

    glibc's defaults let a process's RSS creep for several steps of a loop that frees and re-allocates
    activations of varying sizes: its mmap threshold rises after each large free (up to 32 MiB), so
    later buffers below it come from heaps that fragment, one heap per thread (an arena each). A fixed
    threshold (allocations of ``mmap_threshold_bytes`` or more are mmapped, and unmapped on free) and
    ``arena_max`` arenas keep the resident memory flat from step to step. Call it early, before
    threads start allocating.

    Why a page (4 KiB): what lives in the heap between two trims is what the RSS cannot follow. After a
    trim the heap's free pages are not resident, and a phase's small allocations fault them back in
    wherever glibc places them, so a phase's RSS rises above its tensors by how much free heap it walks
    (MoE layers' many small per-expert tensors walked 10-14 MiB at a 64 KiB threshold). With every buffer of
    a page or more mmapped, the RSS is the tensors: the fitted CPU factors are ~1 (train 0.99, the
    native engine 0.91), their workspaces under 1 MiB. The price is a page fault per page of every buffer
    (docs/plan-validation.md, 2026-11-27).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes))) and bool(mallopt(_M_ARENA_MAX, int(arena_max)))
