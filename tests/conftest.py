"""Shared fixtures: tiny HF checkpoints built in-process once per session (no downloads)."""

from __future__ import annotations

import pytest
import torch

from modelspec.tiny import SIZED_FAMILIES, TINY_FAMILIES, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a freshly written tiny checkpoint (not the sized ones: hundreds of MB)."""
    root = tmp_path_factory.mktemp("tiny_models")
    families = [f for f in TINY_FAMILIES if f not in SIZED_FAMILIES]
    return {family: str(write_tiny_model(family, root / family)) for family in families}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
