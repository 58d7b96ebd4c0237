"""``make gpu-check`` (tools/gpu_check.py) on CPU: the stages a lent GPU runs, with the same code at small shapes,
so that a broken kit is found here and not in a session's 15 minutes of device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import psutil
import pytest

from planner.calibration import from_json
from tools import gpu_check

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))


def test_every_stage_runs_on_cpu_and_the_report_is_what_the_device_brings_back(tmp_path):
    out = tmp_path / "out"
    stages = ["main_0.5b", "main_1.5b", "fit", "sync", "moe"]  # "tests" only collects the gpu tests on CPU
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--device", "cpu", "--out", str(out), "--stages", *stages],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {n: s.get("tail") for n, s in report["stages"].items() if s["status"] != "passed"}
    assert proc.returncode == 0 and not failed, (proc.stderr[-2000:], failed)
    assert list(report["stages"]) == stages  # in the order that yields the constants first

    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= gpu_check.OUT_FILES and all(p.is_file() for p in out.iterdir())
    assert {"gpu_check.json", "cpu.json", "summary_0.5b.json", "summary_1.5b.json", "summary_moe.json"} <= set(files)
    with tarfile.open(out / gpu_check.RUNS_ARCHIVE) as tar:  # each step's phase seconds, for make calibrate-time
        records = set(tar.getnames())
        steps = [json.loads(line) for line in tar.extractfile("run_0.5b/metrics.jsonl").read().splitlines()]
    assert {f"run_{n}/{f}" for n in gpu_check.RUNS for f in ("metrics.jsonl", "summary.json")} <= records
    assert not any("/checkpoints" in m or "/hf" in m or "/model" in m for m in records)
    assert sum("time/train" in m for m in steps) >= 2

    main = report["stages"]["main_0.5b"]["results"]
    assert main["exported"] == ["step_00000002"] and main["checkpoints"] and main["eval"] is not None
    assert {"rollout", "train", "weight_sync"} <= set(main["phase_peak_bytes"]) and main["train_tokens_per_s"] > 0
    assert report["stages"]["main_1.5b"]["results"]["checkpoints"] == []

    fit = report["stages"]["fit"]["results"]
    assert fit["fitted"]["runtime_overhead_bytes"]["value"] > 0
    checked = fit["check_1.5b"]
    assert checked["config"] == "gpu_check_1.5b" and {"rollout", "train"} <= set(checked["phases"])
    proposal = from_json(json.loads((out / "cpu.json").read_text()))
    assert proposal["runtime_overhead_bytes"].source == "fit"
    assert proposal.value("runtime_overhead_bytes") == fit["fitted"]["runtime_overhead_bytes"]["value"]
    assert {"runs", "checked_on", "device", "date", "versions"} <= set(proposal.provenance)

    sync = report["stages"]["sync"]["results"]
    assert sync["engine_weight_bytes"] > 0 and sync["device_copy_gbps"] > 0
    assert report["stages"]["moe"]["results"]["phase_peak_bytes"]["train"] > 0


def _environ(process) -> dict:
    try:
        return process.environ()
    except (psutil.Error, OSError):  # gone, or not ours to read
        return {}


def test_a_failed_or_late_stage_is_reported_and_the_next_one_still_runs(tmp_path):
    env = _env()
    # no runs yet: fit and sync each fail on their own, and both are reported
    report = gpu_check.check_all(tmp_path / "out", tmp_path, "cpu", 120.0, ["fit", "sync"], env)
    assert [s["status"] for s in report["stages"].values()] == ["failed", "failed"]
    assert "run_0.5b" in report["stages"]["sync"]["tail"]  # the cause, in the stage's last lines
    # a main job cannot finish in 12 s: it is stopped at its box, and what is left is too little to start another
    marked = dict(env, GPU_CHECK_TEST_MARK=str(tmp_path))  # every process the stage starts inherits it
    report = gpu_check.check_all(tmp_path / "out", tmp_path, "cpu", 12.0, ["main_0.5b", "sync"], marked)
    assert report["stages"]["main_0.5b"]["status"] == "timed_out"
    # with the run it started and the run's ranks: none outlives its stage to share the device with the next one's
    assert not [p.pid for p in psutil.process_iter() if _environ(p).get("GPU_CHECK_TEST_MARK") == str(tmp_path)]
    assert report["stages"]["sync"]["status"] == "skipped"


def test_bad_input_is_one_line_before_any_stage(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "o"), "--budget-s", "0"])
    assert "--budget-s=0.0 must be > 0" in capsys.readouterr().err
    (tmp_path / "wheels").mkdir()
    with pytest.raises(SystemExit, match="holds no wheels; run `make gpu-wheels`"):
        gpu_check.main(["--out", str(tmp_path / "o"), "--wheels", str(tmp_path / "wheels")])
