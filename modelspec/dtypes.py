"""Dtype names as configs spell them, and their torch dtypes (the one table)."""

from __future__ import annotations

import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """'bfloat16' -> torch.bfloat16 (ValueError naming the choices otherwise)."""

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not one of {DTYPE_NAMES}")
    return getattr(torch, name)


def element_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]
