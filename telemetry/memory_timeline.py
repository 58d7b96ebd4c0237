"""The per-phase memory timeline: what each rank holds, measured at every phase boundary and inside phases.

Metric names (DESIGN.md, "Memory: names and sources"), per rank and sample. Every ``device_*`` figure
is a measurement; the tags only explain it.

- ``device_used``: what the device reports in use at the sample. CUDA: ``total - free`` from
  ``torch.cuda.mem_get_info(device)`` (cudaMemGetInfo on the device this process sees, so
  ``CUDA_VISIBLE_DEVICES`` is honoured; it includes vLLM's sleep-mode pool, torch-memory-saver,
  NCCL buffers and the CUDA context: memory torch's allocator never sees). CPU: the process's
  resident memory (RSS) minus the baseline taken when the probe was built (after imports and
  process-group setup), so it counts what the run allocated, not the Python runtime and libraries.
- ``device_peak``: the highest device memory since the current phase began, measured. CUDA: torch's
  allocator high-water mark (``max_memory_reserved``, its peak counters reset at every phase entry)
  over what the device holds outside the allocator at the sample (``device_used - memory_reserved``).
  CPU: the kernel's RSS high-water mark (``VmHWM`` of ``/proc/self/status``, reset at every phase
  entry through ``/proc/self/clear_refs``) minus the baseline, so a peak between two samples is caught.
- ``device_allocated`` / ``device_reserved``: torch's CUDA allocator at the sample. On CPU there is no
  allocator to ask; both repeat ``device_used``.
- ``host_rss``: the process's resident set size (absolute).
- ``host_pinned``: bytes the project pinned in host memory (the ledgers' ``host_pinned`` entry, CUDA).
- ``tensor_peak`` (``trainer.count_tensors``, a phase's exit row only): the most bytes of tensors the phase made
  and referenced at once, counted per aten op (telemetry/live_tensors.py): on CPU, what of the phase's rise is
  tensors, the rest being glibc's heap; slow, off by default.
- ``tag/<name>``: bytes the components' ledgers say they hold under each tag: ``weights``,
  ``kv_cache`` (engine), ``actor_params``, ``actor_grads``, ``optimizer`` (actor), ``ref_params``
  (the reference actor). An explanation of ``device_used``, never a substitute for it.

Why RSS on CPU and not USS/PSS: the pages a process shares are the libraries mapped at import (torch,
megatron, gloo), all in the baseline and constant afterwards, so RSS minus the baseline counts what the
run allocates; the offload host tier is a file mapping whose pages are dropped from the process after
the copy (``megatron_backend/memory.py``). USS/PSS have no kernel high-water mark and cost a walk of
``/proc/self/smaps`` per sample.

:class:`MemoryTimeline` samples at the start and end of every ``with timeline.phase(name, step):``
and, inside it, from a background thread every ``interval_s``. Rows are plain dicts:
``t_s, step, phase, rank, <metrics>``. The functions at the end read rows (from a run, or from
``memory_timeline.csv`` with :func:`read_timeline_csv`): per-phase peaks, what each phase released
(measured next to the ledger's expectation), the per-phase drift over steps.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
import torch

from colocation.host_memory import release_freed_host_memory
from colocation.phases import (  # noqa: F401 (re-exported)
    ACTOR_STATE,
    ALL_PHASES,
    ENGINE_STATE,
    EVAL_PHASE,
    EXPORT_PHASE,
    PHASES,
    REF_STATE,
    SAVE_PHASE,
    WAKE_WINDOW,
    released_tags,
    wake_window_phases,
)
from planner import Plan, StepLengths
from telemetry.live_tensors import LiveTensorBytes

# The step's phases (colocation/phases.py, the one table): PHASES run every step; the timeline records every
# phase a step may run, in order: PHASES and, at the step boundaries that evaluate, the eval before rollout,
# after train on the steps that save, the checkpoint's shards, and on the steps that export, the HF export.
TIMELINE_PHASES = ALL_PHASES

# Memory tags: the step's state names (colocation/phases.py), which the engine's and the actor's ledgers
# use; the reference actor's params are its ledger's actor_params, renamed in run.setup.
TAGS = ENGINE_STATE + ACTOR_STATE + REF_STATE
BASE_METRICS = ("device_used", "device_peak", "device_allocated", "device_reserved", "host_rss", "host_pinned")
METRICS = BASE_METRICS + tuple(f"tag/{tag}" for tag in TAGS)
# with trainer.count_tensors, a phase's exit row only: the most bytes of tensors the phase made and referenced at
# once (telemetry/live_tensors.py), to tell its tensors from the allocator's share of its rise
TENSOR_PEAK = "tensor_peak"
# The measured metrics: a phase's peak (`memory/peak/<phase>`, summary.json's phase_peak_bytes) and what
# the device holds at a sample (memory after a phase, bytes released by a phase).
PEAK_METRIC = "device_peak"
USED_METRIC = "device_used"
# Phases that hand memory back, and the tags whose ledger says how much (the expected bytes): the table's drops
RELEASE_TAGS = released_tags()

LedgerFn = Callable[[], dict[str, int]]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class ProcessMemory:
    """This process's resident memory and the kernel's high-water mark of it (Linux), resettable.

    ``read()`` -> (rss, peak rss since the last ``reset_peak()``). Where ``/proc`` is missing or
    ``clear_refs`` refuses the reset, the peak is the current RSS and only the sampler sees inside phases
    (``tracks_peak`` says which).
    """

    def __init__(self) -> None:
        self._process = psutil.Process(os.getpid())
        self.tracks_peak = _STATUS.exists() and self._try_reset()

    @staticmethod
    def _try_reset() -> bool:
        try:
            _CLEAR_REFS.write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS, proc(5)
        except OSError:
            return False
        return True

    def reset_peak(self) -> None:
        if self.tracks_peak:
            self._try_reset()

    def read(self) -> tuple[int, int]:
        if not self.tracks_peak:
            rss = self._process.memory_info().rss
            return rss, rss
        status = _STATUS.read_text()
        rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024
        hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024
        return rss, max(rss, hwm)


# how device_peak is measured (summary.json["memory_peak_method"]); only the last misses short peaks
PEAK_METHODS = {
    "cuda_allocator_peak": "CUDA: used per torch.cuda.mem_get_info + the allocator's max_memory_reserved since the "
    "phase began",
    "rss_high_water_mark": "CPU: the process's RSS high-water mark (VmHWM) above its start, reset at each phase "
    "through /proc/self/clear_refs",
    "rss_sampled": "CPU: RSS sampled at phase boundaries and every trainer.memory_sample_interval_s "
    "(/proc/self/clear_refs not writable): a peak between two samples is missed",
}


class MemoryProbe:
    """Reads one sample of this rank's memory (see the module doc for what each metric measures).

    Build it after imports and process-group setup: on CPU that moment is the baseline. ``ledgers``
    return ``{tag: bytes}`` (may include ``host_pinned``).
    """

    def __init__(self, device: torch.device, ledgers: list[LedgerFn] | None = None):
        self.device = torch.device(device)
        self.ledgers: list[LedgerFn] = list(ledgers or [])
        self.process = ProcessMemory()
        self.on_cuda = self.device.type == "cuda"
        # CPU: what the process held before the run allocated anything (runtime, libraries, groups)
        self.baseline_bytes = 0 if self.on_cuda else self.process.read()[0]

    @property
    def peak_method(self) -> str:
        """A key of :data:`PEAK_METHODS`."""
        if self.on_cuda:
            return "cuda_allocator_peak"
        return "rss_high_water_mark" if self.process.tracks_peak else "rss_sampled"

    def add_ledger(self, ledger: LedgerFn) -> None:
        self.ledgers.append(ledger)

    def reset_peak(self) -> None:
        """Start a new high-water mark (at every phase entry; nothing else may reset it mid-phase)."""
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.process.reset_peak()

    def tags(self) -> tuple[dict[str, int], int]:
        """The ledgers' {tag: bytes} and host_pinned bytes."""
        tags = dict.fromkeys(TAGS, 0)
        host_pinned = 0
        for ledger in self.ledgers:
            for key, value in ledger().items():
                if key == "host_pinned":
                    host_pinned += int(value)
                else:
                    tags[key] = tags.get(key, 0) + int(value)
        return tags, host_pinned

    def runtime_level_bytes(self) -> int:
        """CPU: what this rank holds beside the tensors its ledgers name, now (RSS over the baseline, freed heap
        returned first, minus the tags): taken at launch, before the first step (run/setup.py::plan_and_build_engine), it
        is the plan's runtime level for this run (``PlanInputs.launch_runtime_bytes``), so the model's Python
        objects, the tokenizer, W&B's threads and what the warm-up left in the heap are measured on this
        machine, not fitted elsewhere."""

        release_freed_host_memory()
        sample = self.read()
        return sample["device_used"] - sum(v for k, v in sample.items() if k.startswith("tag/"))

    def read(self) -> dict[str, int]:
        tags, host_pinned = self.tags()
        host_rss, host_rss_peak = self.process.read()
        if self.on_cuda:
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # outside the allocator (context, vLLM's pool, NCCL) as at this sample, plus torch's own peak
            peak = used - reserved + torch.cuda.max_memory_reserved(self.device)
        else:
            used = host_rss - self.baseline_bytes
            allocated = reserved = used
            peak = host_rss_peak - self.baseline_bytes
        sample = dict(
            device_used=used,
            device_peak=max(peak, used),
            device_allocated=allocated,
            device_reserved=reserved,
            host_rss=host_rss,
            host_pinned=host_pinned,
        )
        sample.update({f"tag/{tag}": value for tag, value in tags.items()})
        return sample


class MemoryTimeline:
    """Per-rank samples at phase boundaries plus one background sampler thread inside phases.

    The sampler is one daemon thread for the whole run (a thread per phase would leave a stack and a
    malloc arena behind now and then: memory growth the timeline itself would cause). A lock keeps its
    samples strictly inside the phase they are labelled with.
    """

    def __init__(
        self,
        probe: MemoryProbe,
        rank: int,
        interval_s: float = 0.05,
        t0: float | None = None,
        count_tensors: bool = False,
    ):
        if interval_s <= 0:
            raise ValueError(f"memory sampler interval_s={interval_s} must be > 0")
        self.probe = probe
        self.rank = rank
        self.interval_s = interval_s
        self.count_tensors = count_tensors  # each phase's exit row gets tensor_peak (telemetry/live_tensors.py)
        if rank == 0 and probe.peak_method == "rss_sampled":  # once per run: rank 0 speaks for the node
            print(f"warning: memory peaks are {PEAK_METHODS['rss_sampled']}", file=sys.stderr, flush=True)
        self.t0 = time.monotonic() if t0 is None else t0
        self.rows: list[dict] = []
        self.phase_seconds: dict[tuple[int, str], float] = {}
        self._rows_lock = threading.Lock()
        self._phase_lock = threading.Lock()  # held while a phase starts or ends, and by each background sample
        self._active: tuple[int, str] | None = None  # (step, phase) being sampled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_method(self) -> str:
        """How its peaks are measured (a key of PEAK_METHODS; summary.json's memory_peak_method)."""
        return self.probe.peak_method

    def sample(self, step: int, phase: str) -> dict:
        row = dict(t_s=time.monotonic() - self.t0, step=step, phase=phase, rank=self.rank, **self.probe.read())
        with self._rows_lock:
            self.rows.append(row)
        return row

    def _sampler(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._phase_lock:
                if self._active is not None:
                    self.sample(*self._active)

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Reset the peak trackers and sample at entry; the sampler samples every ``interval_s``; sample at exit."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._sampler, name="memory-sampler", daemon=True)
            self._thread.start()
        start = time.monotonic()
        with self._phase_lock:
            self.probe.reset_peak()
            self.sample(step, name)
            self._active = (step, name)
        tensors = LiveTensorBytes() if self.count_tensors else None
        try:
            with tensors if tensors is not None else contextlib.nullcontext():
                yield
        finally:
            with self._phase_lock:
                self._active = None
                row = self.sample(step, name)
                if tensors is not None:
                    row[TENSOR_PEAK] = tensors.peak
            self.phase_seconds[(step, name)] = time.monotonic() - start

    def step_phase_seconds(self, step: int) -> dict[str, float]:
        """phase -> seconds, of the phases ``step`` has run so far."""
        return {name: seconds for (at, name), seconds in self.phase_seconds.items() if at == step}

    def close(self) -> None:
        """Stop the sampler thread (it is a daemon: a run that ends without this loses nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take_rows(self) -> list[dict]:
        """Rows recorded since the last call (for gathering to rank 0 once per step)."""
        with self._rows_lock:
            rows, self.rows = self.rows, []
        return rows


# ---------------------------------------------------------------- reading rows
def read_timeline_csv(path: str | Path, skip_broken: bool = False) -> list[dict]:
    """``memory_timeline.csv`` -> rows as the timeline made them (ints, ``t_s`` float; empty cells left
    out). ``skip_broken``: drop a row that does not parse (the last line of a file cut by a kill) instead of
    raising."""

    def parse(key: str, value: str):
        if key == "phase":
            return value
        return float(value) if key == "t_s" else int(value)

    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            try:
                rows.append({k: parse(k, v) for k, v in raw.items() if v != ""})
            except (TypeError, ValueError):  # a missing cell reads as None, a cut number as garbage
                if not skip_broken:
                    raise
    return rows


def steady_steps(rows: Iterable[dict]) -> list[int]:
    """The steps to judge steady state on: the whole steps (those that ran ``PHASES[0]``) but the first when
    there are more (step 0 creates the optimizer's states and warms the allocators), and the boundary after the
    last of them (the eval after the last step: a run of one step has it too). Rows without phases: all steps
    but the first when there are more."""
    rows = list(rows)
    steps = {int(r["step"]) for r in rows}
    whole = sorted({int(r["step"]) for r in rows if r.get("phase") == PHASES[0]}) or sorted(steps)
    return sorted(set(whole[1:] if len(whole) > 1 else whole) | {s for s in steps if s > whole[-1]})


def phase_samples(rows: Iterable[dict]) -> dict[tuple[int, int, str], list[dict]]:
    """(rank, step, phase) -> its rows in time order."""
    out: dict[tuple[int, int, str], list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["t_s"]):
        out.setdefault((int(row["rank"]), int(row["step"]), row["phase"]), []).append(row)
    return out


def phase_peaks(rows: Iterable[dict], metric: str = PEAK_METRIC) -> dict[str, int]:
    """phase -> max of ``metric`` over all given rows (all ranks, all samples) of that phase."""
    peaks: dict[str, int] = {}
    for row in rows:
        value = int(row[metric])
        peaks[row["phase"]] = max(peaks.get(row["phase"], value), value)
    return peaks


def steady_peak(rows: list[dict], phases: Iterable[str], rank: int) -> int:
    """Median over the steady steps that ran ``phases`` (eval, save_checkpoint: only some steps do) of one
    rank's measured peak over them (one step each)."""
    phases = set(phases)
    ran = {r["step"] for r in rows if r["rank"] == rank and r["phase"] in phases}
    per_step = [
        max(
            (int(r[PEAK_METRIC]) for r in rows if r["rank"] == rank and r["step"] == step and r["phase"] in phases),
            default=0,
        )
        for step in steady_steps(rows)
        if step in ran
    ]
    return int(statistics.median(per_step)) if per_step else 0


def steady_peak_over_ranks(rows: list[dict], phases: Iterable[str]) -> int:
    """Max over the ranks in ``rows`` of :func:`steady_peak` (0: none of ``phases`` measured)."""
    phases = tuple(phases)
    return max((steady_peak(rows, phases, rank) for rank in sorted({int(r["rank"]) for r in rows})), default=0)


def phase_after(rows: list[dict], rank: int, step: int) -> dict[str, dict]:
    """phase -> the last sample of ``phase`` on ``rank`` in ``step``: the memory after that phase."""
    return {phase: samples[-1] for (r, s, phase), samples in phase_samples(rows).items() if r == rank and s == step}


def released_bytes(rows: list[dict]) -> dict[str, dict[str, int]]:
    """What each hand-off phase gave back, per rank, measured next to expected.

    phase -> {measured, expected, rank}: ``device_used`` at the phase's first sample minus at its last
    (measured) and the drop of the phase's tags in the ledgers (expected), median over the steady
    steps, for the rank where the two differ most. Only phases whose ledger expected a release appear.
    """
    groups = phase_samples(rows)
    steady = set(steady_steps(rows))
    out: dict[str, dict[str, int]] = {}
    for phase, tags in RELEASE_TAGS.items():
        per_rank: dict[int, tuple[list[int], list[int]]] = {}
        for (rank, step, name), samples in groups.items():
            if name != phase or step not in steady:
                continue
            first, last = samples[0], samples[-1]
            expected = sum(int(first.get(f"tag/{t}", 0)) - int(last.get(f"tag/{t}", 0)) for t in tags)
            measured = int(first[USED_METRIC]) - int(last[USED_METRIC])
            per_rank.setdefault(rank, ([], []))
            per_rank[rank][0].append(measured)
            per_rank[rank][1].append(expected)
        candidates = []
        for rank, (measured, expected) in per_rank.items():
            m, e = int(statistics.median(measured)), int(statistics.median(expected))
            if e > 0:
                candidates.append(dict(measured=m, expected=e, rank=rank))
        if candidates:
            out[phase] = max(candidates, key=lambda c: abs(c["measured"] - c["expected"]))
    return out


def phase_peak_rows(rows: Iterable[dict], metric: str = PEAK_METRIC) -> list[dict]:
    """One row per (rank, step, phase): its peak of ``metric`` (what :func:`phase_drift` needs, compactly)."""
    return [
        dict(rank=rank, step=step, phase=phase, **{metric: max(int(s[metric]) for s in samples)})
        for (rank, step, phase), samples in phase_samples(rows).items()
    ]


def phase_drift(rows: list[dict], metric: str = PEAK_METRIC) -> dict[str, dict[str, float]]:
    """Growth of each phase's measured peak over the steady steps, per rank; the worst rank per phase.

    phase -> {bytes, fraction, rank, steps}: the Theil-Sen slope of the per-step peak (the median of the
    slopes between every two steps) times (last step - first step), and that over the phase's peak. A
    leak grows every step and shows in full; a one-time rise (allocators warming up over the first
    steps) or a noisy step moves the median little. Needs at least 3 steady steps (else empty). Takes
    samples or :func:`phase_peak_rows`.
    """
    steps = set(steady_steps(rows))
    if len(steps) < 3:
        return {}
    peaks: dict[tuple[int, str], dict[int, int]] = {}
    for row in rows:
        if row["step"] in steps:
            by_step = peaks.setdefault((int(row["rank"]), row["phase"]), {})
            by_step[row["step"]] = max(by_step.get(row["step"], int(row[metric])), int(row[metric]))
    out: dict[str, dict[str, float]] = {}
    for (rank, phase), by_step in peaks.items():
        xs = sorted(by_step)
        if len(xs) < 3:
            continue
        slope = statistics.median((by_step[b] - by_step[a]) / (b - a) for i, a in enumerate(xs) for b in xs[i + 1 :])
        growth = slope * (xs[-1] - xs[0])
        entry = dict(bytes=growth, fraction=growth / max(max(by_step.values()), 1), rank=rank, steps=len(xs))
        if phase not in out or entry["fraction"] > out[phase]["fraction"]:
            out[phase] = entry
    return out


def measured_free_bytes(device: torch.device, ranks_per_node: int = 1) -> int:
    """What a new allocation can take now. CUDA: the device's free memory (``mem_get_info``: vLLM's sleep
    pool and torch-memory-saver allocate outside torch's cache, so its cached blocks do not count). CPU: the
    machine's available memory, shared evenly by the ranks on it."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available) // max(1, ranks_per_node)


def plans_at_recorded_lengths(plan: Plan, lengths: dict[int, StepLengths], rows: list[dict]) -> list[Plan]:
    """``plan`` evaluated at each steady step's recorded lengths (``lengths``: step -> the lengths its sequences
    had, telemetry/metrics.py::recorded_lengths); steps without a record are left out (none: [])."""
    by_lengths: dict[StepLengths, Plan] = {}
    for step in steady_steps(rows):
        if step in lengths and lengths[step] not in by_lengths:
            by_lengths[lengths[step]] = plan.at_lengths(lengths[step])
    return [by_lengths[lengths[step]] for step in steady_steps(rows) if step in lengths]


def prediction_errors(
    plan: Plan, rows: list[dict], min_bytes: int = 0, lengths: dict[int, StepLengths] | None = None
) -> dict[str, dict[str, float]]:
    """phase -> predicted (the plan's worst rank, plus its runtime overhead: the measurement includes the
    CUDA context or, on CPU, what the process allocates beside the tensors), measured (max over ranks of
    the median over the steady steps of the phase's measured peak) and their relative error (predicted /
    measured - 1), for the phases the run measured at or above ``min_bytes``. With ``lengths`` (step -> the
    lengths it recorded) the prediction is the median over the steady steps of the plan at each step's lengths
    (:func:`plans_at_recorded_lengths`): the model of what the step held, where ``plan`` alone is the launch's
    bound (the longest prompt, ``max_new_tokens`` responses)."""
    at_lengths = plans_at_recorded_lengths(plan, lengths, rows) if lengths else []
    out = {}
    for phase in plan.phases:
        measured = steady_peak_over_ranks(rows, (phase.name,))
        if measured <= 0 or measured < min_bytes:
            continue
        if at_lengths:
            predicted = int(statistics.median(p.measurable_bytes(phase.name) for p in at_lengths))
        else:
            predicted = plan.measurable_bytes(phase.name)
        out[phase.name] = {
            "predicted_bytes": predicted,
            "measured_bytes": measured,
            "relative_error": predicted / measured - 1.0,
        }
    return out


# What a sweep compares point by point (summary.json's "memory_figures", a W&B run's summary, tools/sweep's
# table and chart), each planned and measured alike: a peak as prediction_errors compares a phase (the plan's
# worst rank plus its runtime overhead; max over ranks of the median over the steady steps), over these phases
FIGURE_PHASES = {"wake_window_peak": wake_window_phases(), "rollout_peak": ("rollout",), "train_peak": ("train",)}
# ... and the KV cache: the plan's against what the engine's ledger says it allocated (tag kv_cache)
FIGURES = (*FIGURE_PHASES, "kv_cache")
FIGURES_KEY = "memory_figures"


def memory_figures(plan: Plan | None, rows: list[dict]) -> dict[str, int | None]:
    """``planned_<figure>_bytes`` and ``measured_<figure>_bytes`` for each of :data:`FIGURES` (None: no plan,
    the plan has none of the figure's phases, or nothing measured). ``rows``: the run's timeline, all ranks."""
    out: dict[str, int | None] = {}
    for figure, phases in FIGURE_PHASES.items():
        planned = [plan.measurable_bytes(name) for name in plan.names if name in phases] if plan is not None else []
        out[f"planned_{figure}_bytes"] = max(planned, default=None)
        out[f"measured_{figure}_bytes"] = steady_peak_over_ranks(rows, phases) or None
    out["planned_kv_cache_bytes"] = plan.kv_cache_bytes if plan is not None else None
    out["measured_kv_cache_bytes"] = max((int(r.get("tag/kv_cache") or 0) for r in rows), default=0) or None
    return out
