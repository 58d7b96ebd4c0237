"""The per-phase memory timeline: what each rank holds, sampled at every phase boundary and inside phases.

Metric names (DESIGN.md, "Memory: names and sources"), per rank and sample:

- ``device_allocated`` / ``device_reserved``: torch's CUDA allocator. On CPU there is no device, so
  both are the sum of the project's per-tag ledger (what the actor and engine hold under their tags).
- ``device_used``: NVML's used memory for this GPU (includes vLLM pools, NCCL buffers: memory outside
  torch's allocator). On CPU: the process RSS, the closest thing to "everything this rank holds".
- ``host_rss``: process resident set size (psutil).
- ``host_pinned``: bytes the project pinned (reported by the ledgers' ``host_pinned`` entry).
- ``tag/<name>``: bytes held under each memory-saver tag: ``weights``, ``kv_cache`` (engine),
  ``actor_params``, ``actor_grads``, ``optimizer`` (actor).

:class:`MemoryTimeline` samples at the start and end of every ``with timeline.phase(name, step):``
and, inside it, from a background thread every ``interval_s`` (default 50 ms), so each phase has a
true peak, not just end points. Rows are plain dicts: ``t_s, step, phase, rank, <metrics>``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import torch

from megatron_backend.memory import TAGS as ACTOR_TAGS
from planner.plan import PHASES  # the step's phases in order (DESIGN.md, "The one loop"), shared with the planner
from rollout.memory_saver import TAGS as ENGINE_TAGS

# Memory tags: the engine's (rollout.memory_saver) and the actor's (megatron_backend.memory), each named once.
TAGS = ENGINE_TAGS + ACTOR_TAGS
BASE_METRICS = ("device_allocated", "device_reserved", "device_used", "host_rss", "host_pinned")
METRICS = BASE_METRICS + tuple(f"tag/{tag}" for tag in TAGS)
# The metric a phase's peak is reported in (`memory/peak/<phase>`, summary.json's phase_peak_bytes).
PEAK_METRIC = "device_allocated"

LedgerFn = Callable[[], dict[str, int]]


class MemoryProbe:
    """Reads one sample of this rank's memory. ``ledgers`` return ``{tag: bytes}`` (may include ``host_pinned``)."""

    def __init__(self, device: torch.device, ledgers: list[LedgerFn] | None = None):
        self.device = device
        self.ledgers: list[LedgerFn] = list(ledgers or [])
        self._process = psutil.Process(os.getpid())
        self._nvml_handle = None
        if device.type == "cuda":
            with contextlib.suppress(Exception):  # NVML missing (e.g. some containers): device_used = reserved
                import pynvml

                pynvml.nvmlInit()
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)

    def add_ledger(self, ledger: LedgerFn) -> None:
        self.ledgers.append(ledger)

    def read(self) -> dict[str, int]:
        tags = dict.fromkeys(TAGS, 0)
        host_pinned = 0
        for ledger in self.ledgers:
            for key, value in ledger().items():
                if key == "host_pinned":
                    host_pinned += int(value)
                else:
                    tags[key] = tags.get(key, 0) + int(value)
        host_rss = self._process.memory_info().rss
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            used = reserved
            if self._nvml_handle is not None:
                import pynvml

                used = int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
        else:
            allocated = reserved = sum(tags.values())
            used = host_rss
        sample = dict(
            device_allocated=allocated,
            device_reserved=reserved,
            device_used=used,
            host_rss=host_rss,
            host_pinned=host_pinned,
        )
        sample.update({f"tag/{tag}": value for tag, value in tags.items()})
        return sample


class MemoryTimeline:
    """Per-rank samples at phase boundaries plus a background sampler inside phases."""

    def __init__(self, probe: MemoryProbe, rank: int, interval_s: float = 0.05, t0: float | None = None):
        if interval_s <= 0:
            raise ValueError(f"memory sampler interval_s={interval_s} must be > 0")
        self.probe = probe
        self.rank = rank
        self.interval_s = interval_s
        self.t0 = time.monotonic() if t0 is None else t0
        self.rows: list[dict] = []
        self.phase_seconds: dict[tuple[int, str], float] = {}
        self._lock = threading.Lock()

    def sample(self, step: int, phase: str) -> dict:
        row = dict(t_s=time.monotonic() - self.t0, step=step, phase=phase, rank=self.rank, **self.probe.read())
        with self._lock:
            self.rows.append(row)
        return row

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Sample at entry and exit; a daemon thread samples every ``interval_s`` in between."""
        if self.probe.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.probe.device)
        start = time.monotonic()
        self.sample(step, name)
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(self.interval_s):
                self.sample(step, name)

        thread = threading.Thread(target=sampler, name=f"memory-sampler-{name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            end_row = self.sample(step, name)
            if self.probe.device.type == "cuda":
                # the allocator's own high-water mark catches peaks between two samples
                end_row["device_allocated"] = max(
                    end_row["device_allocated"], torch.cuda.max_memory_allocated(self.probe.device)
                )
            self.phase_seconds[(step, name)] = time.monotonic() - start

    def take_rows(self) -> list[dict]:
        """Rows recorded since the last call (for gathering to rank 0 once per step)."""
        with self._lock:
            rows, self.rows = self.rows, []
        return rows


def phase_peaks(rows: list[dict], metric: str = PEAK_METRIC) -> dict[str, int]:
    """phase -> max of ``metric`` over all given rows (all ranks, all samples) of that phase."""
    peaks: dict[str, int] = {}
    for row in rows:
        peaks[row["phase"]] = max(peaks.get(row["phase"], 0), int(row[metric]))
    return peaks


def window_peak(rows: list[dict], first_phase: str, last_phase: str, metric: str = PEAK_METRIC) -> int:
    """Max of ``metric`` over the phases from ``first_phase`` to ``last_phase`` (in PHASES order)."""
    i, j = PHASES.index(first_phase), PHASES.index(last_phase)
    window = set(PHASES[i : j + 1])
    return max((int(r[metric]) for r in rows if r["phase"] in window), default=0)
