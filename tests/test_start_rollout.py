"""The first weight sync at start-up walks the step's table (run/shared_device.py::SharedDevice.first_sync), so it
never holds the actor's params and the KV cache together unless the wake strategy (checked against the plan)
does."""

from __future__ import annotations

from types import SimpleNamespace

import run.setup as rl_setup
from colocation import phases
from colocation.phases import Phase, StepFlags
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
    shared = SharedDevice(
        actor=Recorder(calls),
        ref_actor=None,
        weight_sync=None,
        flags=StepFlags(wake_strategy=strategy),  # every offload on
        timeline=None,
        device=None,
        procs_per_node=1,
    )
    shared.check_wake = lambda phase: calls.append(("check_wake", phase))
    shared.sync_weights = lambda: calls.append(("sync_weights",))

    def plan_and_build_engine(ctx):
        calls.append(("plan_and_build_engine",))  # the engine comes up fully awake
        ctx.shared.attach_engine(Recorder(calls), plan=None)
        return ctx

    monkeypatch.setattr(rl_setup, "plan_and_build_engine", plan_and_build_engine)
    monkeypatch.setattr(rl_setup, "freeze_long_lived_objects", lambda: None)
    start_rollout(SimpleNamespace(shared=shared))
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


def test_a_hand_off_added_to_the_table_is_walked_by_the_start_up_too(monkeypatch):
    """The start-up restates no phase: a hand-off that moves the actor's params, added to the table alone, runs
    in its place (here the params leave and come back before ``wake_weights``)."""
    table = phases.step_phases

    def with_added(flags):
        names = [p.name for p in table(flags)]
        added = (
            Phase(name="offload_params_early", what="the params to host", drops=("actor_params",), hand_off=True),
            Phase(name="onload_params_again", what="the params back", adds=("actor_params",), hand_off=True),
        )
        at = names.index("wake_weights")
        return (*table(flags)[:at], *added, *table(flags)[at:])

    monkeypatch.setattr(phases, "step_phases", with_added)
    calls = _start("staged", monkeypatch)
    at = calls.index(("onload", "params"))
    assert calls[at : at + 5] == [
        ("onload", "params"),
        ("offload", "params"),
        ("onload", "params"),
        ("check_wake", "wake_weights"),
        ("wake_up", ("weights",)),
    ]
