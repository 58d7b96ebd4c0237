"""Evaluation (rl/evaluation.py, the loop's eval phase, ``make eval``): the config group, the problems and
figures, the plan's eval phase, ``make eval``'s bad input, and RUN vs HF on the same weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from rl.batching import Sample
from rl.evaluation import EvalConfig, eval_metrics, eval_problems
from run.compose import ConfigError, compose

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["eval.every=-1"], "eval.every=-1 must be >= 0"),
        (["eval.n_samples=0"], "eval.n_samples=0 must be >= 1"),
        (["eval.n_samples=4"], "eval.n_samples=4 with eval.temperature=0 samples the same greedy answer"),
        (["eval.temperature=-0.5"], "eval.temperature=-0.5 must be >= 0"),
        (["eval.top_p=0"], "eval.top_p=0.0 must be in (0, 1]"),
        (["eval.max_problems=0"], "eval.max_problems=0 must be >= 1"),
        (["eval.max_new_tokens=0"], "eval.max_new_tokens=0 must be >= 1"),
        (["eval.data.path=test.jsonl"], "eval.data.path='test.jsonl': data.task=digit_sum evaluates on its own"),
        (["eval.colour=red"], "unknown config key 'eval.colour'; valid keys here: every, before_train, data"),
    ],
)
def test_bad_eval_config_fails_with_one_line_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose("tiny_cpu", overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_eval_config_composes_and_says_when_the_loop_evaluates():
    cfg = compose("tiny_cpu", ["eval.every=10", "eval.before_train=true", "eval.n_samples=4", "eval.temperature=0.7"])
    assert cfg.eval.every == 10 and cfg.eval.n_samples == 4 and cfg.eval.data.path is None
    assert not compose("tiny_cpu").eval.enabled  # off by default: training's steps are unchanged
    ev = EvalConfig(every=10, before_train=True)
    assert [b for b in range(41) if ev.runs_at(b, 40)] == [0, 10, 20, 30, 40]
    ev = EvalConfig(every=3)
    assert [b for b in range(8) if ev.runs_at(b, 7)] == [3, 6, 7]  # and after the last step
    assert not EvalConfig(before_train=True).runs_at(5, 5)


def test_eval_problems_are_the_digit_range_once_or_the_file_in_order(tmp_path):
    problems = eval_problems(compose("tiny_cpu"))  # max_operand 4: 25 problems, each once
    assert len(problems) == 25 == len({p.prompt for p in problems})
    assert problems[7].prompt == "1+2=" and problems[7].answer == "3"
    assert len(eval_problems(compose("tiny_cpu", ["eval.max_problems=10"]))) == 10
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    test.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"so #### {i + 1}"}) + "\n" for i in range(5)))
    gsm8k = ["data.task=gsm8k", f"data.path={train}", "trainer.sft_warmup_steps=0"]
    cfg = compose("tiny_cpu", [*gsm8k, f"eval.data.path={test}"])
    assert [(p.prompt, p.answer) for p in eval_problems(cfg)] == [(f"{i}+1?", str(i + 1)) for i in range(5)]
    cfg = compose("tiny_cpu", gsm8k)
    assert [p.answer for p in eval_problems(cfg)] == ["2"]  # no eval file: the training file's records


def test_eval_figures_accuracy_reward_length_and_pass_at_k():
    def sample(problem, reward, length):
        return Sample(problem, [1], [2] * length, [0.0] * length, "stop", reward)

    # 2 problems x 2 samples: problem 0 right once, problem 1 never
    samples = [sample(0, 1.0, 1), sample(0, 0.5, 3), sample(1, 0.0, 2), sample(1, 0.8, 2)]
    figures = eval_metrics(samples, num_problems=2, n_samples=2)
    assert figures["accuracy"] == 0.25 and figures["pass@2"] == 0.5
    assert figures["reward_mean"] == pytest.approx(0.575) and figures["response_length"] == 2.0
    assert figures["num_problems"] == 2 and figures["num_samples"] == 4
    assert "pass@1" not in eval_metrics(samples[::2], num_problems=2, n_samples=1)


def test_the_plan_has_the_eval_phase_when_the_run_evaluates_sized_by_its_batch():
    from planner import PHASES, make_plan
    from run.memory_plan import plan_inputs

    off = make_plan(plan_inputs(compose("tiny_cpu"), 6))
    assert off.names == PHASES and "eval" not in off.names
    plan = make_plan(plan_inputs(compose("tiny_cpu", ["eval.every=10"]), 6))
    assert plan.names == ("eval", *PHASES)
    eval_phase, rollout = plan.phase("eval"), plan.phase("rollout")
    # at the step boundary: the state a step starts with, plus the engine's working set for 25 eval sequences
    assert {k: v for k, v in eval_phase.components.items() if k != "engine_reserve"} == {
        k: v for k, v in rollout.components.items() if k != "engine_reserve"
    }
    assert 0 < eval_phase.components["engine_reserve"] < rollout.components["engine_reserve"]  # 25 < 256 sequences
    sampled = make_plan(
        plan_inputs(compose("tiny_cpu", ["eval.every=10", "eval.n_samples=16", "eval.temperature=1"]), 6)
    )
    assert sampled.phase("eval").components["engine_reserve"] > eval_phase.components["engine_reserve"]
    assert sampled.inputs.eval_sequences == 25 * 16


# ---------------------------------------------------------------- make eval: bad input, before any rank starts
def _fake_run(root: Path, completed_steps: list[int], vocab_size: int = 128) -> Path:
    """A run directory with config.yaml and checkpoint markers (rl_state.json, actor/metadata.json)."""
    cfg = compose("tiny_cpu")
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    for step in completed_steps:
        checkpoint = root / "checkpoints" / f"step_{step:08d}"
        (checkpoint / "actor").mkdir(parents=True)
        (checkpoint / "actor" / "metadata.json").write_text("{}")
        state = dict(
            completed_steps=step,
            sampling_seed=0,
            next_sampling_seeds=[0],
            data_num_prompts_drawn=0,
            wandb_run_id=None,
            wandb_step=0,
            world_size=2,
            layout={},
            model=dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=vocab_size),
            exp="tiny_cpu",
        )
        (checkpoint / "rl_state.json").write_text(json.dumps(state))
    return root


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "make eval needs exactly one of HF=<HF checkpoint dir> or RUN=<run dir> [STEP=<n>]"),
        (["--hf", "{hf}", "--run", "{run}"], "make eval needs exactly one of HF="),
        (["--hf", "{tmp}"], "has no config.json; point HF at a Hugging Face checkpoint directory"),
        (["--hf", "{hf}", "--step", "2"], "STEP=2 picks a checkpoint of RUN=<run dir>; drop it with HF"),
        (["--run", "{tmp}/nowhere"], "nowhere does not exist; give a run directory runs/<exp>/<time>"),
        (["--run", "{empty}"], "has no complete checkpoint under checkpoints/; a run saves one every"),
        (["--run", "{run}", "--step", "3"], "has no checkpoint of step 3; it has steps [2, 4]: STEP=<one of them>"),
        (["--run", "{other_model}"], "step 2 holds a model with vocab_size=99 but the config's model.path="),
        (["--run", "{run}", "actor.tp=3"], "actor.tp=3 x actor.pp=1 does not divide"),
    ],
)
def test_make_eval_bad_input_is_one_line_before_any_rank_starts(tmp_path, tiny_model_dirs, capsys, args, expected):
    from tools.eval import main

    places = dict(
        hf=tiny_model_dirs["qwen2"],
        tmp=str(tmp_path),
        run=str(_fake_run(tmp_path / "run", [2, 4])),
        empty=str(_fake_run(tmp_path / "empty", [])),
        other_model=str(_fake_run(tmp_path / "other", [2], vocab_size=99)),
    )
    assert main([a.format(**places) for a in args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


def test_make_eval_sees_only_the_hf_run_and_exp_it_is_given():
    """The Makefile's defaults for other targets (HF for parity, EXP for run) must not reach tools.eval."""

    def command(*variables: str) -> str:
        out = subprocess.run(["make", "-n", "eval", *variables], cwd=REPO, capture_output=True, text=True).stdout
        return next(line for line in out.splitlines() if "tools.eval" in line)

    assert command("RUN=runs/x").split("tools.eval", 1)[1].split() == ["--run", "'runs/x'"]
    assert command("RUN=runs/x", "STEP=3", "ARGS=eval.max_problems=5").split("tools.eval", 1)[1].split() == [
        "--run",
        "'runs/x'",
        "--step",
        "3",
        "eval.max_problems=5",
    ]
    assert command("HF=some/dir", "EXP=tiny_cpu_pp").split("tools.eval", 1)[1].split() == [
        "--hf",
        "'some/dir'",
        "--exp",
        "tiny_cpu_pp",
    ]


# ---------------------------------------------------------------- make eval: RUN and HF of the same weights
def _eval(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.eval", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "eval: generating" in proc.stderr  # progress on the long work
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_make_eval_of_a_run_checkpoint_and_of_its_export_agree(tmp_path, tiny_model_dirs):
    """``make eval RUN=<run>`` and ``make eval HF=<its export of the same step>`` (tools/export.py, which
    carries the run's config beside the weights) print the same reference log-prob (<= 1e-6), accuracy and
    reward. The run's step moved the weights: HF of the checkpoint it started from differs, so the agreement
    is not the starting weights read twice."""
    hf = Path(tiny_model_dirs["qwen2"])
    run_dir = tmp_path / "run"
    common = ["eval.max_problems=12", "wandb.mode=disabled"]
    cmd = [sys.executable, "-m", "run.main", "--exp", "tiny_cpu", "--run-dir", str(run_dir), f"model.path={hf}"]
    cmd += ["trainer.steps=1", "trainer.sft_warmup_steps=1", "trainer.save_every=1", "trainer.prompts_per_step=2"]
    cmd += ["rollout.n_samples_per_prompt=8", "actor.micro_batch_size=8", *common]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    export = run_dir / "hf" / "export_step_1"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.export", str(run_dir), "--out", str(export)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["files"] and (export / "run_config.yaml").is_file()

    from_run = _eval("--run", str(run_dir), *common)
    from_export = _eval("--hf", str(export), *common)
    assert from_run["step"] == 1 and from_run["num_problems"] == from_export["num_problems"] == 12
    assert from_run["reference_tokens"] == from_export["reference_tokens"] > 12
    assert abs(from_run["reference_logprob_mean"] - from_export["reference_logprob_mean"]) <= 1e-6
    assert from_run["accuracy"] == from_export["accuracy"] and from_run["reward_mean"] == from_export["reward_mean"]

    start = _eval("--hf", str(hf), *common)
    assert abs(start["reference_logprob_mean"] - from_run["reference_logprob_mean"]) > 1e-4


@pytest.mark.vllm
def test_make_eval_with_vllm_matches_the_native_engine(tiny_model_dirs):
    """The same HF checkpoint, problems and greedy sampling through both engines (the actor's reference
    log-probs do not involve the engine: equal)."""
    hf = tiny_model_dirs["qwen2"]
    native = _eval("--hf", hf, "eval.max_problems=12", "wandb.mode=disabled")
    vllm = _eval("--hf", hf, "eval.max_problems=12", "wandb.mode=disabled", "rollout.engine=vllm")
    assert vllm["engine"] == "vllm" and vllm["num_problems"] == native["num_problems"] == 12
    assert abs(vllm["accuracy"] - native["accuracy"]) <= 0.1
    assert abs(vllm["reward_mean"] - native["reward_mean"]) <= 0.1
    assert vllm["reference_logprob_mean"] == native["reference_logprob_mean"]


def test_an_hf_dir_with_its_runs_config_is_evaluated_under_that_config(tmp_path, tiny_model_dirs):
    """An export carries its run's config beside the weights (run_config.yaml): make eval HF= takes the
    task, problems, sampling and layout from it (model.path: the export), overrides on top; EXP is refused."""
    from tools.eval import RUN_CONFIG_FILE, BadInput, _hf_config

    export = tmp_path / "export"
    shutil.copytree(tiny_model_dirs["qwen2"], export)
    run_cfg = compose("tiny_cpu", ["eval.max_problems=7", "data.max_operand=3", "trainer.prompts_per_step=16"])
    (export / RUN_CONFIG_FILE).write_text(yaml.safe_dump(asdict(run_cfg), sort_keys=False))
    cfg = _hf_config(str(export), None, ["eval.n_samples=2", "eval.temperature=0.5"])
    assert cfg.model.path == str(export.resolve()) and cfg.data.max_operand == 3 and cfg.trainer.prompts_per_step == 16
    assert (cfg.eval.max_problems, cfg.eval.n_samples) == (7, 2)
    with pytest.raises(BadInput, match="carries its run's config"):
        _hf_config(str(export), "tiny_cpu", [])
    plain = _hf_config(tiny_model_dirs["qwen2"], None, [])  # no run config: the experiment's (tiny_cpu)
    assert plain.data.max_operand == 4 and plain.eval.max_problems is None


def test_a_phase_of_some_steps_is_measured_over_the_steps_that_ran_it():
    """eval.every=10 runs the eval phase on 5 of 41 steps: its steady peak is the median over those, not 0
    (a median over every step would drop it from the plan's predicted-vs-measured)."""
    from telemetry.memory_timeline import steady_peak
    from telemetry.metrics import time_summary

    rows = []
    for step in range(41):
        t = step * 10.0
        if step % 10 == 0:
            rows += [dict(t_s=t, step=step, phase="eval", rank=0, device_peak=100 + step)]
            rows += [dict(t_s=t + 0.5, step=step, phase="eval", rank=0, device_peak=100 + step)]
        if step < 40:  # the eval after the last step (40) is a boundary, not a step
            rows += [dict(t_s=t + 1, step=step, phase="rollout", rank=0, device_peak=500)]
            rows += [dict(t_s=t + 5, step=step, phase="rollout", rank=0, device_peak=500)]
    assert steady_peak(rows, ("eval",), 0) == 125  # median of steps 10, 20, 30, 40 (step 0 is not steady)
    assert steady_peak(rows, ("rollout",), 0) == 500
    # a step's seconds: whole steps only (step 1 here, step 0 is not steady), not the boundary after the last (40)
    few = [r for r in rows if r["step"] in (0, 1, 40)]
    assert time_summary(few)["step_median_seconds"] == 4.0
    # a run of one step and the eval after it (trainer.steps=1, eval.every=1): no steady whole step, so step 0's
    one_step = [r for r in rows if r["step"] == 0 and r["phase"] == "rollout"]
    one_step += [dict(r, step=1, t_s=r["t_s"] + 10) for r in rows if r["step"] == 0 and r["phase"] == "eval"]
    assert time_summary(one_step)["step_median_seconds"] == 4.0 and steady_peak(one_step, ("rollout",), 0) == 500
