"""Shared fixtures: tiny HF checkpoints built in-process once per session (no downloads)."""

from __future__ import annotations

import pytest
import torch

from modelspec.tiny import TINY_FAMILIES, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a freshly written tiny checkpoint."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: str(write_tiny_model(family, root / family)) for family in TINY_FAMILIES}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
