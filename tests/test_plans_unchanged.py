"""Every experiment's and every plan-run configuration's memory plan, field for field against the plans recorded at
120ac35, before the component configs moved into configs/ (issue 42: no behaviour change, proven).

What is compared: ``make plan EXP=<e> JSON=...``'s JSON (the plan and its side-by-side variants) for every
experiment, the launch's plan and KV choice (run.memory_plan.plan_launch), and for every fit and validation
configuration of tools/plan_runs.py (CPU and CUDA) the run's own plan, that plan at a step's recorded lengths, and
on CPU at a measured launch level. A plan that changes on purpose regenerates the record:
``python -m tests.test_plans_unchanged --write`` (and says so in its commit).
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

RECORD = Path(__file__).parent / "data" / "plans_at_120ac35.json.gz"
MIB = 2**20
CUDA_PRESET = "H100-80GB"
# the CPU plans size the device and the host from this machine's RAM (planner.devices: psutil.virtual_memory().total);
# a VM's MemTotal moves by a few hundred KiB between boots and within one (24,684,084 kB when the record was made,
# 24,683,656 kB on 2026-12-01), so the plans are captured at the recording machine's
NODE_MEMORY_BYTES = 25_276_502_016


def capture() -> dict[str, dict]:
    with mock.patch("psutil.virtual_memory", return_value=SimpleNamespace(total=NODE_MEMORY_BYTES)):
        return _capture()


def _capture() -> dict[str, dict]:
    from planner import make_plan, variants
    from planner.inputs import StepLengths
    from planner.report import plan_json
    from run.compose import compose
    from run.memory_plan import data_prompt_length, plan_inputs, plan_launch
    from tools import plan_runs

    out = {}
    for path in sorted((Path(__file__).parent.parent / "experiments" / "conf" / "exp").glob("*.yaml")):
        if path.name.startswith("tuned_"):  # what `make tune` wrote here (git-ignored), not the repository's
            continue
        cfg = compose(path.stem)
        inputs = plan_inputs(cfg, data_prompt_length(cfg).tokens)
        out[f"exp:{path.stem}"] = plan_json(make_plan(inputs), variants(inputs))
        try:
            launch = plan_launch(cfg)
        except ValueError as exc:
            out[f"launch:{path.stem}"] = {"error": str(exc)}
            continue
        out[f"launch:{path.stem}"] = {
            "problem": launch.problem,
            "kv": None if launch.kv_choice is None else launch.kv_choice.line(),
            "plan": None if launch.plan is None else plan_json(launch.plan),
        }
    specs = (
        *plan_runs.FIT_SET,
        *plan_runs.VALIDATION_SET,
        *plan_runs.cuda_fit_set(CUDA_PRESET),
        *plan_runs.cuda_validation_set(CUDA_PRESET),
    )
    for spec in specs:
        plan = plan_runs.plan_for(spec)
        out[f"spec:{spec.name}"] = plan_json(plan)
        i = plan.inputs
        response = max(1, i.response_tokens * 2 // 3)  # a step shorter than the launch's bound
        lengths = StepLengths(
            longest_prompt=max(1, i.prompt_tokens - 1),
            longest_response=response,
            longest_sequence=max(1, i.prompt_tokens - 1) + response,
            mean_prompt=i.prompt_tokens * 0.7,
            mean_response=response * 0.6,
            routed_copies_ratio=1.1 if i.shape.is_moe else 1.0,
        )
        out[f"spec:{spec.name}:at_lengths"] = plan_json(make_plan(i.at_lengths(lengths, plan.kv_cache_bytes)))
        if i.device.kind == "cpu":
            out[f"spec:{spec.name}:launch_runtime"] = plan_json(plan_runs.plan_for(spec, launch_runtime_bytes=40 * MIB))
    return json.loads(json.dumps(out))  # tuples as lists, as the record holds them


def differences(before, after, path: str = "") -> list[str]:
    """Where two JSON values differ; floats may differ in their last digit (1e-12 relative), nothing else may."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = [f"{path}/{k}: only {'after' if k in after else 'before'}" for k in sorted(set(before) ^ set(after))]
        for k in sorted(set(before) & set(after)):
            out += differences(before[k], after[k], f"{path}/{k}")
        return out
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for n, (a, b) in enumerate(zip(before, after)) for d in differences(a, b, f"{path}[{n}]")]
    if isinstance(before, float) and isinstance(after, float) and math.isclose(before, after, rel_tol=1e-12):
        return []
    return [] if before == after and type(before) is type(after) else [f"{path}: {before!r} -> {after!r}"]


def test_every_plan_is_what_it_was_before_the_configs_moved():
    before = json.loads(gzip.decompress(RECORD.read_bytes()))
    after = capture()
    assert len(after) == len(before) == 88  # 10 experiments x 2; 18 CPU configurations x 3, 7 CUDA x 2
    assert differences(before, after) == []


def test_the_comparison_sees_a_changed_byte_and_forgives_only_a_floats_last_digit():
    plan = {"phases": [{"name": "train", "predicted_bytes": 100, "components": {"kv_cache": 0}}], "util": 0.1 + 0.2}
    assert differences(plan, json.loads(json.dumps(plan))) == []
    assert differences(plan, {**plan, "util": 0.3}) == []  # 0.30000000000000004 -> 0.3
    changed = json.loads(json.dumps(plan))
    changed["phases"][0]["components"]["kv_cache"] = 1
    assert differences(plan, changed) == ["/phases[0]/components/kv_cache: 0 -> 1"]
    assert differences(plan, {**plan, "util": 0.31}) == ["/util: 0.30000000000000004 -> 0.31"]
    assert differences({"a": 1}, {"a": 1.0}) == ["/a: 1 -> 1.0"]


if __name__ == "__main__" and "--write" in sys.argv:
    RECORD.write_bytes(gzip.compress((json.dumps(capture(), indent=1, sort_keys=True) + "\n").encode(), mtime=0))
    print(f"wrote {RECORD}")
