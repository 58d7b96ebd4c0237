"""rollout.memory_saver: the portable backend releases storages, re-allocates them, and keeps a ledger."""

from __future__ import annotations

import pytest
import torch

from rollout.memory_saver import MemorySaver


def test_portable_pause_resume_and_ledger():
    saver = MemorySaver("portable", "cpu")
    with saver.region("weights"):
        w = saver.track(torch.full((1000,), 3.0))
        view = w[10:20]
    with saver.region("kv_cache"):
        kv = saver.track(torch.ones(4, 256))
    assert saver.bytes_by_tag() == {"weights": 4000, "kv_cache": 4096}
    assert saver.pause("weights") == 4000 and saver.pause("weights") == 0
    assert w.untyped_storage().nbytes() == 0 and saver.bytes_by_tag() == {"weights": 0, "kv_cache": 4096}
    assert torch.equal(kv, torch.ones(4, 256))  # other tags untouched
    with pytest.raises(RuntimeError, match="paused"):
        with saver.region("weights"):
            pass
    assert saver.resume("weights") == 4000
    assert w.untyped_storage().nbytes() == 4000 and not w.any()  # re-allocated, zeroed, same tensor object
    w.fill_(5.0)
    assert torch.equal(view, torch.full((10,), 5.0))  # views follow the storage
    assert saver.bytes_by_tag() == {"weights": 4000, "kv_cache": 4096}


def test_track_outside_region_and_unknown_backend():
    saver = MemorySaver("portable")
    with pytest.raises(RuntimeError, match="inside"):
        saver.track(torch.zeros(1))
    with pytest.raises(ValueError, match="backend"):
        MemorySaver("mmap")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="EXTRAS=dev,gpu"):
            MemorySaver("torch_memory_saver", "cpu")


@pytest.mark.gpu
def test_cuda_pause_releases_device_memory():
    saver = MemorySaver("auto", "cuda")
    with saver.region("kv_cache"):
        kv = saver.track(torch.ones(64, 2**20, device="cuda"))  # 256 MiB
    free_before = torch.cuda.mem_get_info()[0]
    saver.pause("kv_cache")
    assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * 256 * 2**20
    saver.resume("kv_cache")
    kv.fill_(2.0)
    assert float(kv.sum()) == 2.0 * 64 * 2**20
