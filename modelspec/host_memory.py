"""Returning freed host memory to the OS, so the process's resident memory really drops."""

from __future__ import annotations

import ctypes
import gc


def release_freed_host_memory() -> None:
    """Collect garbage, then ``malloc_trim(0)``: glibc keeps freed heap pages mapped until asked."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
