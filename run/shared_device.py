"""What shares one rank's device, and the one place that moves it: the actor, the reference actor, the engine
and the weight sync, moved between host and device only by the step's table (colocation/phases.py).

Entering a phase first enters every hand-off phase the table lists before it (``Phase.hand_off``), each
applying its drops and adds by the table's state names (``colocation.phases.HOLDERS`` says which holder
moves each, and under which of its own names); the loop names only the phases that do work. So a hand-off
added to the table is run by the loop and walked by the planner with no other edit (tests/test_phases.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colocation.phases import ACTOR_STATE, ENGINE_STATE, HOLDERS, REF_STATE, STATE, PhaseOrder, StepFlags
from planner import check_fits
from telemetry.memory_timeline import MemoryTimeline, measured_free_bytes

if TYPE_CHECKING:
    from megatron_backend.actor import Actor
    from planner import Plan
    from rollout import RolloutEngine
    from weight_sync import SyncResult, WeightSync


# the order state leaves the device in: the engine's, the reference actor's, then the actor's last-built first
# (the optimizer's states, the grads, the params); it comes back in STATE's order
DROP_ORDER = (*ENGINE_STATE, *REF_STATE, *reversed(ACTOR_STATE))
# what the weight sync reads (the actor's params) and writes (the engine's state): all the start-up's sync moves
SYNC_STATE = frozenset(("actor_params", *ENGINE_STATE))


class MemoryPlanError(RuntimeError):
    """The memory measured free before an engine wake is less than the plan says the wake needs."""


class SharedDevice:
    """The actor, the reference actor (or None), the engine (None until :meth:`attach_engine`) and the
    weight sync of one rank, the step's flags and table, and which state is on the device now."""

    def __init__(
        self,
        *,
        actor: Actor,
        ref_actor: Actor | None,
        weight_sync: WeightSync,
        flags: StepFlags,
        timeline: MemoryTimeline,
        device: torch.device,
        procs_per_node: int,
    ):
        self.actor, self.ref_actor, self.weight_sync, self.flags = actor, ref_actor, weight_sync, flags
        self.timeline, self.device, self.procs_per_node = timeline, device, procs_per_node
        self.engine: RolloutEngine | None = None
        self.plan: Plan | None = None  # the wake checks' (None: not plannable, no checks)
        self.order = PhaseOrder(flags)  # every phase entry is checked against the table
        self.table = {phase.name: phase for phase in self.order.phases}
        holders = {"actor", "ref_actor"} if ref_actor is not None else {"actor"}
        self.resident = {state for state in STATE if HOLDERS[state][0] in holders}  # built on the device

    def attach_engine(self, engine: RolloutEngine, plan: Plan | None) -> None:
        """The engine, started fully awake, and the plan its wakes are checked against."""
        self.engine, self.plan = engine, plan
        self.resident |= set(ENGINE_STATE)

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """The hand-offs the table lists before ``name`` (:meth:`hand_offs`), then ``name`` itself, timed
        and sampled; a phase the table does not list, or out of its order, is a PhaseOrderError."""
        self.hand_offs(step, until=name)
        with self._entered(name, step):
            yield

    def hand_offs(self, step: int, *, until: str) -> None:
        """Enter, in the table's order, every hand-off phase between the last phase ``step`` entered and
        ``until``, each applying its drops and adds."""
        names = self.order.names
        entered = self.order.entered if self.order.step == step else []
        first = names.index(entered[-1]) + 1 if entered else 0
        for phase in self.order.phases[first : names.index(until)]:
            if phase.hand_off:
                with self._entered(phase.name, step):
                    self.apply(phase.name)

    @contextlib.contextmanager
    def _entered(self, name: str, step: int) -> Iterator[None]:
        self.order.enter(name, step)
        with self.timeline.phase(name, step):  # its seconds: timeline.step_phase_seconds(step)
            yield

    def apply(self, name: str) -> None:
        """Phase ``name``'s moves from the table: its drops, then its adds (an engine wake checked first)."""
        phase = self.table[name]
        self.drop(phase.drops)
        self.add(phase.adds, wake_check=name)

    def drop(self, states: Iterable[str]) -> None:
        """Move ``states`` off the device (the actor's to host, the engine's released), in DROP_ORDER."""
        moving = set(states) & self.resident
        for holder, names in self._by_holder([s for s in DROP_ORDER if s in moving]):
            if holder == "engine":
                self.engine.sleep(names)
            else:
                for name in names:  # one at a time: each offload frees before the next copies
                    getattr(self, holder).offload(name)
        self.resident -= moving

    def add(self, states: Iterable[str], wake_check: str | None = None) -> None:
        """Bring ``states`` back to the device; an engine wake is first checked against the plan's
        ``wake_check`` phase (the bytes it says the wake allocates)."""
        moving = set(states) - self.resident
        for holder, names in self._by_holder([s for s in STATE if s in moving]):
            if holder == "engine":
                if wake_check is not None:
                    self.check_wake(wake_check)
                self.engine.wake_up(names)
            else:
                for name in names:
                    getattr(self, holder).onload(name)
        self.resident |= moving

    def offload_between_uses(self, holder: str) -> None:
        """``holder``'s state that the flags keep on host between its uses, to host (what the step starts with)."""
        self.drop(s for s in STATE if HOLDERS[s][0] == holder and self.flags.offloaded(s))

    def hold_the_actor(self) -> None:
        """The engine released and all the actor's state on the device (a final checkpoint's shards)."""
        self.drop(ENGINE_STATE)
        self.add(s for s in STATE if HOLDERS[s][0] == "actor")

    @staticmethod
    def _by_holder(states: list[str]) -> list[tuple[str, list[str]]]:
        """``states`` grouped by holder, in order, each under the holder's own names."""
        groups: dict[str, list[str]] = {}
        for state in states:
            holder, name = HOLDERS[state]
            groups.setdefault(holder, []).append(name)
        return list(groups.items())

    def check_wake(self, phase: str) -> None:
        """Before an engine wake: the measured free memory against what the plan says ``phase`` allocates.
        Every rank checks; if any falls short, all stop with the worst rank's line (phase, shortfall and a
        ``rollout.kv_cache_bytes`` that fits) instead of dying inside the engine."""
        if self.plan is None:
            return

        check = check_fits(self.plan, measured_free_bytes(self.device, self.procs_per_node), phase)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (check.shortfall_bytes, check.line))
        shortfall, line = max(gathered, key=lambda g: g[0])
        if shortfall > 0:
            rank = gathered.index((shortfall, line))
            raise MemoryPlanError(f"rank {rank}: {line}")

    def first_sync(self) -> SyncResult:
        """The start-up's weight sync, from the engine fully awake and the actor as a step starts: the step's
        hand-offs that move what the sync reads or writes (:data:`SYNC_STATE`) in the table's order, the sync where
        the table has it. So the start-up never holds more than a step does: the engine sleeps, the params come
        back, ``wake_weights`` (checked against the plan), the sync, the params go back, ``wake_kv_cache``
        (checked): never the params beside the KV cache under the staged strategy."""
        for phase in self.order.phases:
            if phase.name == "weight_sync":
                result = self.sync_weights()
            elif phase.hand_off and SYNC_STATE & {*phase.adds, *phase.drops}:
                self.apply(phase.name)
        return result

    def sync_weights(self) -> SyncResult:
        """Planned reshard of the actor's shards straight into the engine's (awake) weights."""
        return sync_actor_into_engine(self.weight_sync, self.actor, self.engine)


def sync_actor_into_engine(weight_sync: WeightSync, actor: Actor, engine: RolloutEngine) -> SyncResult:
    """Planned reshard of the actor's shards straight into the engine's (awake) weights (the run's
    weight_sync phase; ``make eval`` hands its weights to the engine the same way)."""
    destinations = engine.begin_weight_update()
    result = weight_sync(actor.local_params(), destinations)
    engine.finish_weight_update()
    return result
