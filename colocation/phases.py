"""The RL step as data: its phases in order, and for each the memory it adds, drops and holds transiently.

One table that everything reads: ``run/loop.py::rl_step`` runs these phases and nothing else, in this
order (``run.shared_device.SharedDevice.phase`` checks every entry against :class:`PhaseOrder`); the planner
(``planner/plan.py``) predicts each phase's bytes by walking :func:`step_phases`; the memory timeline
(``telemetry/memory_timeline.py``) takes its phase order and what each hand-off releases (``RELEASE_TAGS``) from here;
the engine's wake strategies (``configs/rollout.py::WAKE_TAGS``) are the wake phases' ``adds``.

State that stays resident between phases is named by its memory-ledger tag (``telemetry/memory_timeline.py`` TAGS):
the engine's ``weights`` and ``kv_cache`` (``rollout/memory_saver.py``), the actor's ``actor_params``,
``actor_grads``, ``optimizer`` (``megatron_backend/memory.py``) and the reference actor's ``ref_params``.
A transient is memory a phase takes and gives back before it ends (activations, a sync bucket); the
planner sizes each kind (``planner/plan.py::_phases``).

Which state a phase moves depends on the run's flags (:class:`StepFlags`: the offload flags, the wake
strategy, a reference actor): an onload whose state is not offloaded still runs, and moves nothing, so
every step enters the same phases; only ``eval`` (``eval.every``, ``eval.before_train``),
``save_checkpoint`` (``trainer.save_every``, a stop) and ``export_hf`` (``trainer.export_every``,
``trainer.export_at_end``) run on some steps (``every_step=False``).

A hand-off phase (``hand_off=True``) only moves state between host and device: the run enters it by itself
between the loop's other phases and applies its adds and drops (``run/shared_device.py``), as the planner
walks them. Adding a hand-off phase is a :class:`Phase` here, in its place, and nothing else
(``tests/test_phases.py`` runs a copy of the table with one added). A phase that does work besides is also a
``with phase("<name>", step):`` in ``rl_step`` (or in ``run_rank`` after the step), and its transients' bytes
in ``planner/plan.py::_phases`` if it has any; ``tests/test_phases.py`` fails until they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

# State resident across phases, by memory tag (see the module doc).
ACTOR_STATE = ("actor_params", "actor_grads", "optimizer")
ENGINE_STATE = ("weights", "kv_cache")
REF_STATE = ("ref_params",)
STATE = (*ACTOR_STATE, *REF_STATE, *ENGINE_STATE)
# state -> what holds it on the run's side and that holder's own name for it (Actor.offload's "params",
# the engine's sleep tags): the one translation, applied by run/shared_device.py
HOLDERS = {
    **{state: ("actor", state.removeprefix("actor_")) for state in ACTOR_STATE},
    **{state: ("ref_actor", state.removeprefix("ref_")) for state in REF_STATE},
    **{state: ("engine", state) for state in ENGINE_STATE},
}

# Memory a phase holds only while it runs (the planner sizes each; planner/plan.py::_phases).
TRANSIENTS = (
    "engine_activations",  # the engine generating: its working set beyond weights and KV cache
    "eval_activations",  # the same for the eval batch (every eval problem x eval.n_samples)
    "rollout_heap",  # CPU: what rollout's freed small allocations leave in the heap until the sleep trims it
    "forward_pass",  # a forward-only log-prob pass: one layer's activations, the logits' chunk
    "train_pass",  # micro-batches through forward and backward: kept activations, logits
    "sync_bucket",  # the weight sync's staging bucket (and the engine's reload copy where it has one)
    "hf_export",  # the export: the params-only save's staged copies, then one HF tensor and the chunks it reads
)

WAKE_STRATEGIES = ("staged", "all_at_once")


@dataclass(frozen=True, kw_only=True)
class StepFlags:
    """What decides which state each phase moves: ``actor.offload.*``, ``rollout.wake_strategy`` and
    whether there is a reference actor (``algorithm.kl_coef > 0``)."""

    offload_params: bool = True
    offload_grads: bool = True
    offload_optimizer: bool = True
    reference_model: bool = False
    offload_ref_params: bool = True
    wake_strategy: str = "staged"  # one of WAKE_STRATEGIES: RolloutConfig checks it, where it is set

    def offloaded(self, state: str) -> bool:
        """Whether ``state`` lives on host between its uses (``ref_params``: only with a reference actor)."""
        if state == "ref_params":
            return self.reference_model and self.offload_ref_params
        return {
            "actor_params": self.offload_params,
            "actor_grads": self.offload_grads,
            "optimizer": self.offload_optimizer,
        }.get(state, False)

    def resident_at_step_start(self) -> frozenset[str]:
        """What is resident when ``rollout`` begins (and when the step ends): the engine awake, the actor
        holding what its flags keep (the reference actor's params only when there is one)."""
        actor = {s for s in (*ACTOR_STATE, "ref_params") if not self.offloaded(s)}
        if not self.reference_model:
            actor.discard("ref_params")
        return frozenset(actor | set(ENGINE_STATE))


# The phases only some steps run (every_step=False)
EVAL_PHASE = "eval"
SAVE_PHASE = "save_checkpoint"
EXPORT_PHASE = "export_hf"

# Every flag combination under which each hand-off phase moves its state (for flag-independent readers).
EVERY_HANDOFF = StepFlags(reference_model=True)


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase of the step: what runs, and the memory it adds, drops and holds transiently."""

    name: str
    what: str  # one line, what runs (docs/DESIGN.md, "The one loop", says the same)
    adds: tuple[str, ...] = ()  # state resident at the phase's end that was not at its start (a STATE tag)
    drops: tuple[str, ...] = ()  # state resident at its start and not at its end
    transients: tuple[str, ...] = ()  # TRANSIENTS held inside the phase
    every_step: bool = True  # False: only on some steps (EVAL_PHASE, SAVE_PHASE, EXPORT_PHASE)
    hand_off: bool = False  # only moves state (adds, drops): the run enters it between the loop's other phases

    def __post_init__(self) -> None:
        if self.hand_off and not self.every_step:
            raise ValueError(f"phase {self.name}: a hand-off runs every step (every_step=True)")
        for field_name, allowed in (("adds", STATE), ("drops", STATE), ("transients", TRANSIENTS)):
            unknown = set(getattr(self, field_name)) - set(allowed)
            if unknown:
                raise ValueError(f"phase {self.name}: {field_name} {sorted(unknown)} are not in {allowed}")


def step_phases(flags: StepFlags) -> tuple[Phase, ...]:
    """The step's phases in order, with the state each moves under ``flags``."""

    def moved(state: str) -> tuple[str, ...]:
        return (state,) if flags.offloaded(state) else ()

    staged = flags.wake_strategy == "staged"
    return (
        Phase(
            name=EVAL_PHASE,
            what="at the step boundary, engine awake: the eval problems through the engine, greedy by default "
            "(every eval.every steps, before the first with eval.before_train, and after the last)",
            transients=("eval_activations",),
            every_step=False,
        ),
        Phase(
            name="rollout",
            what="the task draws the prompts; each engine replica generates its share; every rank gathers all samples",
            transients=("engine_activations",),
        ),
        Phase(
            name="engine_sleep",
            what="the engine releases its weights and KV cache",
            drops=ENGINE_STATE,
            transients=("rollout_heap",),
            hand_off=True,
        ),
        Phase(name="onload_params", what="the actor's params back from host", adds=moved("actor_params"), hand_off=True),
        Phase(name="onload_grads", what="the actor's grad buffers back", adds=moved("actor_grads"), hand_off=True),
        Phase(name="onload_optimizer", what="the optimizer's states back from host", adds=moved("optimizer"), hand_off=True),
        Phase(
            name="old_logprob",
            what="this rank's batch, the actor's forward-only log-prob pass, the engine-vs-actor log-prob check",
            transients=("forward_pass",),
        ),
        Phase(name="onload_ref", what="the reference actor's params back from host", adds=moved("ref_params"), hand_off=True),
        Phase(
            name="ref_logprob",
            what="the reference actor's forward-only log-prob pass",
            transients=("forward_pass",) if flags.reference_model else (),
        ),
        Phase(name="offload_ref", what="the reference actor's params to host", drops=moved("ref_params"), hand_off=True),
        Phase(name="train", what="trainer.ppo_epochs x (micro-batches, optimizer step)", transients=("train_pass",)),
        Phase(
            name=SAVE_PHASE,
            what="the actor's shards into the checkpoint's temporary directory (save steps and stops only)",
            every_step=False,
        ),
        Phase(
            name=EXPORT_PHASE,
            what="the actor's weights as a HF directory <run dir>/hf/step_<n> (trainer.export_every / export_at_end "
            "steps only): a params-only distributed checkpoint, then each rank writes its share of the files",
            transients=("hf_export",),
            every_step=False,
        ),
        Phase(name="offload_optimizer", what="the optimizer's states to host", drops=moved("optimizer"), hand_off=True),
        Phase(name="offload_grads", what="the actor's grad buffers released", drops=moved("actor_grads"), hand_off=True),
        Phase(
            name="wake_weights",
            what="the engine takes back its weights (and its KV cache, all_at_once)",
            adds=("weights",) if staged else ENGINE_STATE,
            hand_off=True,
        ),
        Phase(
            name="weight_sync",
            what="planned reshard of the actor's shards into the engine's weights",
            transients=("sync_bucket",),
        ),
        Phase(name="offload_params", what="the actor's params to host", drops=moved("actor_params"), hand_off=True),
        Phase(
            name="wake_kv_cache",
            what="the engine takes back its KV cache (staged)",
            adds=("kv_cache",) if staged else (),
            hand_off=True,
        ),
        Phase(
            name="log",
            what="rank 0 writes the step's metrics and memory rows; the checkpoint begun after train is completed "
            "(renamed once the metrics are on disk)",
        ),
    )


def phase_names(
    flags: StepFlags = EVERY_HANDOFF,
    *,
    saves: bool | None = None,
    evaluates: bool | None = None,
    exports: bool | None = None,
) -> tuple[str, ...]:
    """The phases' names in order: all of them (all None), or those a step runs that does or does not
    save, evaluate and export (a None beside a bool: does not)."""
    if saves is None and evaluates is None and exports is None:
        return tuple(p.name for p in step_phases(flags))
    optional = {SAVE_PHASE: bool(saves), EVAL_PHASE: bool(evaluates), EXPORT_PHASE: bool(exports)}
    return tuple(p.name for p in step_phases(flags) if p.every_step or optional[p.name])


# The names every step runs, and every name a step may run (flag-independent: the phases are the same).
PHASES = phase_names(saves=False)
ALL_PHASES = phase_names()


# Where the engine and the actor change hands: the wake strategies differ only from the first phase to the last.
WAKE_WINDOW = ("wake_weights", "wake_kv_cache")


def wake_window_phases() -> tuple[str, ...]:
    """The phases from ``wake_weights`` to ``wake_kv_cache``, in order."""
    return PHASES[PHASES.index(WAKE_WINDOW[0]) : PHASES.index(WAKE_WINDOW[1]) + 1]


def engine_wakes(wake_strategy: str) -> dict[str, tuple[str, ...]]:
    """Wake phase -> the engine's tags it takes back under ``wake_strategy`` (empty: a wake phase that
    takes nothing back under this strategy)."""
    flags = StepFlags(wake_strategy=wake_strategy)
    return {p.name: p.adds for p in step_phases(flags) if p.name.startswith("wake_")}


def released_tags(flags: StepFlags = EVERY_HANDOFF) -> dict[str, tuple[str, ...]]:
    """Hand-off phase -> the state it drops (the memory it gives back)."""
    return {p.name: p.drops for p in step_phases(flags) if p.drops}


class PhaseOrderError(RuntimeError):
    """A step entered a phase the table does not list, or out of the table's order."""


class PhaseOrder:
    """Checks, as steps run, that each enters the table's phases in order and skips none that runs every
    step. ``enter(name, step)`` at every phase entry; a new step number starts over (after checking that
    the step before it ran every phase)."""

    def __init__(self, flags: StepFlags):
        self.phases = step_phases(flags)
        self.names = tuple(p.name for p in self.phases)
        self.step: int | None = None
        self.entered: list[str] = []

    def enter(self, name: str, step: int) -> None:
        if name not in self.names:
            raise PhaseOrderError(f"step {step}: phase {name!r} is not in the step's table {self.names}")
        if step != self.step:
            self.finish()
            self.step, self.entered = step, []
        last = self.names.index(self.entered[-1]) if self.entered else -1
        index = self.names.index(name)
        skipped = [p.name for p in self.phases[last + 1 : index] if p.every_step]
        if index <= last or skipped:
            why = f"after {self.entered[-1]!r}" if self.entered else "first"
            missing = f", skipping {skipped}" if skipped else ""
            raise PhaseOrderError(
                f"step {step}: phase {name!r} entered {why}{missing}; the table's order is {self.names}"
            )
        self.entered.append(name)

    def finish(self) -> None:
        """The step so far ran every phase that runs every step (call when it should be complete)."""
        if self.step is None:
            return
        missing = [p.name for p in self.phases if p.every_step and p.name not in self.entered]
        if missing:
            raise PhaseOrderError(f"step {self.step} ended without phases {missing}")
