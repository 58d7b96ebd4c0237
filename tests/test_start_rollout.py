"""The first weight sync at start-up follows the step's staged wake order (run/setup.py::start_rollout), so it
never holds the actor's params and the KV cache together unless the wake strategy (checked against the plan)
does."""

from __future__ import annotations

from types import SimpleNamespace

import run.setup as rl_setup
from colocation.phases import StepFlags
from run.setup import start_rollout
from run.shared_device import SharedDevice


class Recorder:
    """The engine, the actor and the context's checks, each call appended to one list."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *(tuple(a) if isinstance(a, list | tuple) else a for a in args)))


def _start(strategy: str, monkeypatch) -> list:
    calls: list = []
    device = SharedDevice(
        actor=Recorder(calls),
        ref_actor=None,
        weight_sync=None,
        flags=StepFlags(wake_strategy=strategy),  # every offload on
        timeline=None,
        device=None,
        procs_per_node=1,
    )
    device.check_wake = lambda phase: calls.append(("check_wake", phase))
    device.sync_weights = lambda: calls.append(("sync_weights",))

    def plan_and_build_engine(ctx):
        calls.append(("plan_and_build_engine",))  # the engine comes up fully awake
        ctx.device.attach_engine(Recorder(calls), plan=None)
        return ctx

    monkeypatch.setattr(rl_setup, "plan_and_build_engine", plan_and_build_engine)
    monkeypatch.setattr(rl_setup, "freeze_long_lived_objects", lambda: None)
    start_rollout(SimpleNamespace(device=device))
    return calls


def test_the_first_sync_wakes_the_kv_cache_only_after_the_params_went_back(monkeypatch):
    calls = _start("staged", monkeypatch)
    assert calls == [
        ("offload", "optimizer"),
        ("offload", "grads"),
        ("offload", "params"),
        ("plan_and_build_engine",),
        ("sleep", ("weights", "kv_cache")),
        ("onload", "params"),
        ("check_wake", "wake_weights"),
        ("wake_up", ("weights",)),
        ("sync_weights",),
        ("offload", "params"),
        ("check_wake", "wake_kv_cache"),
        ("wake_up", ("kv_cache",)),
    ]


def test_an_all_at_once_start_up_is_checked_against_the_plan_like_its_wake(monkeypatch):
    calls = _start("all_at_once", monkeypatch)
    at = calls.index(("onload", "params"))
    assert calls[at : at + 5] == [
        ("onload", "params"),
        ("check_wake", "wake_weights"),
        ("wake_up", ("weights", "kv_cache")),
        ("sync_weights",),
        ("offload", "params"),
    ]
    assert ("check_wake", "wake_kv_cache") not in calls
