"""The native engine's TorchScript decode is compiled and run before a CPU run's launch measurement
(rollout/native/decode_tp1.py::first_use, called from run/setup.py::launch_runtime_bytes), so what TorchScript
keeps per process is in the launch level rather than in the first rollout."""

from __future__ import annotations

import torch

from rollout.native import decode_tp1


def test_first_use_compiles_and_runs_the_scripted_decode_at_the_models_sizes(monkeypatch):
    monkeypatch.setattr(decode_tp1, "_SCRIPTED", {})
    calls = []
    scripted = decode_tp1.scripted_decode_layers()
    monkeypatch.setattr(decode_tp1, "_SCRIPTED", {"fn": lambda *a: calls.append(a) or scripted(*a)})
    # a grouped-query shape: 4 query heads over 2 kv heads, 3 sequences
    decode_tp1.first_use(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_seqs=3)
    assert isinstance(scripted, torch.jit.ScriptFunction)
    assert len(calls) >= 2  # profiled, then optimized: the executor's first two runs
    assert {a[0].shape for a in calls} == {torch.Size([3, 32])}
    assert len({a[-2] for a in calls}) > 1  # more than one context span, as a rollout's decode sees
