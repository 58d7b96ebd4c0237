"""``python -m tools.phase_tensors RUN_DIR``: what each phase's rise was made of, for a run made with
``trainer.count_tensors=true`` (telemetry/live_tensors.py).

Per phase, steady steps (median over steps per rank; the rank whose rise is largest), the measured rise (peak
over the level at the phase's start: RSS on CPU), split into
- ``ledger``: what the components' ledgers say they took during the phase (their tags at its end less at its
  start: a wake's KV cache, an onload's states; storages grown in place or filled outside torch's dispatcher,
  which the tensor count does not see),
- ``tensors``: the tensors the phase made, at their widest moment (counted per aten op),
- ``beside``: the rest. On CPU, glibc's heap: pages small allocations fault back after a trim, freed blocks
  it keeps; what the planner does not count.
Prints a table, or one JSON object per phase with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from telemetry.memory_timeline import PEAK_METRIC, TENSOR_PEAK, phase_samples, read_timeline_csv, steady_steps

MIB = 2**20


def _ledger(row: dict) -> int:
    return sum(v for k, v in row.items() if k.startswith("tag/"))


def phase_parts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """phase -> {rise_bytes, ledger_bytes, tensor_peak_bytes, beside_bytes} (see the module doc); phases whose
    exit rows carry no tensor count are left out."""
    steps = set(steady_steps(rows))
    per: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for (rank, step, phase), samples in phase_samples(rows).items():
        if step not in steps or TENSOR_PEAK not in samples[-1]:
            continue
        rise = max(int(r[PEAK_METRIC]) for r in samples) - int(samples[0]["device_used"])
        ledger = max(0, _ledger(samples[-1]) - _ledger(samples[0]))
        per.setdefault((phase, rank), []).append((rise, ledger, int(samples[-1][TENSOR_PEAK])))
    out: dict[str, dict[str, int]] = {}
    for (phase, _), values in per.items():
        rise, ledger, tensors = (int(statistics.median(v[i] for v in values)) for i in range(3))
        if phase not in out or rise > out[phase]["rise_bytes"]:
            out[phase] = dict(
                rise_bytes=rise, ledger_bytes=ledger, tensor_peak_bytes=tensors, beside_bytes=rise - ledger - tensors
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON object per phase instead of the table")
    args = parser.parse_args(argv)
    timeline = args.run_dir / "memory_timeline.csv"
    if not timeline.is_file():
        print(f"phase_tensors: no {timeline}: not a run directory", file=sys.stderr)
        return 2
    parts = phase_parts(read_timeline_csv(timeline))
    if not parts:
        print(
            f"phase_tensors: {args.run_dir} counted no tensors: run it with trainer.count_tensors=true", file=sys.stderr
        )
        return 2
    ordered = sorted(parts.items(), key=lambda kv: -kv[1]["rise_bytes"])
    if args.json:
        for phase, part in ordered:
            print(json.dumps({"phase": phase, **part}))
        return 0
    print(f"{'phase':18s} {'rise':>8s} {'ledger':>8s} {'tensors':>8s} {'beside':>8s}   (MiB)")
    for phase, part in ordered:
        values = (part[k] / MIB for k in ("rise_bytes", "ledger_bytes", "tensor_peak_bytes", "beside_bytes"))
        print(f"{phase:18s} " + " ".join(f"{v:8.1f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
