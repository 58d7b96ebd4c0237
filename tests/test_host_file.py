"""The CPU offload's host tier (megatron_backend/memory.py): every storage of an offload in one temp file, written
with ``pwrite`` and read back with ``preadv``, bit-exact, with no file or descriptor left behind."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from megatron_backend import memory
from megatron_backend.memory import MemoryLedger, StorageOffloader


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_offload_writes_one_file_and_brings_every_storage_back_bit_exact(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "CPU_IO_BYTES", 4096)  # many pwrite / preadv calls per storage, a short last one
    files = []
    real_temporary_file = tempfile.TemporaryFile

    def counting_temporary_file(*args, **kwargs):
        files.append(kwargs.get("dir"))
        return real_temporary_file(*args, **kwargs)

    monkeypatch.setattr(memory.tempfile, "TemporaryFile", counting_temporary_file)
    torch.manual_seed(0)
    big = torch.randn(3 * 2**18 + 1)  # 3 MiB + 4 bytes: not a multiple of the calls' size
    tensors = [big, big[10:20], torch.randn(1000).to(torch.bfloat16), torch.arange(77, dtype=torch.int64)]
    nbytes = sum(s.nbytes() for s in memory.unique_storages(tensors))  # three storages: the view shares big's
    ledger = MemoryLedger()
    ledger.set("optimizer", resident_bytes=nbytes)
    offloader = StorageOffloader("optimizer", ledger, offload_dir=str(tmp_path))
    fds = _open_fds()
    for cycle in range(3):
        expected = [t.clone() for t in tensors]
        assert offloader.offload(tensors) == nbytes
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert ledger.host_bytes["optimizer"] == nbytes and ledger.resident_bytes["optimizer"] == 0
        assert len(files) == cycle + 1 and files[-1] == str(tmp_path)  # one file per offload, where it was asked
        assert _open_fds() == fds + 1
        assert offloader.onload() == nbytes
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True)), cycle
        assert ledger.host_bytes["optimizer"] == 0 and ledger.resident_bytes["optimizer"] == nbytes
        assert _open_fds() == fds  # the file is closed (and, unlinked from the start, gone)
        big.mul_(-1.5)  # the next offload must carry the new values
    assert os.listdir(tmp_path) == []


def test_a_file_that_ends_short_is_an_error_not_zeros(tmp_path):
    host_file = memory.HostFile(str(tmp_path))
    offset = host_file.append(torch.arange(10, dtype=torch.uint8))
    try:
        with pytest.raises(EOFError, match="10 bytes short"):
            host_file.read_into(torch.zeros(20, dtype=torch.uint8), offset)
    finally:
        host_file.close()


def test_the_speed_probe_times_the_offloads_own_copies(monkeypatch):
    from tools import speed_probe

    calls = []
    for name in ("append", "read_into"):
        real = getattr(memory.HostFile, name)
        monkeypatch.setattr(
            memory.HostFile, name, lambda self, *a, _real=real, _name=name: calls.append(_name) or _real(self, *a)
        )
    monkeypatch.setattr(speed_probe, "HOST_BYTES", 2**20)
    out_rate, in_rate = speed_probe.measure_host_copies(repeats=2)
    assert out_rate > 0 and in_rate > 0
    assert calls == ["append", "read_into"] * 3  # a warm-up and two timed round trips
