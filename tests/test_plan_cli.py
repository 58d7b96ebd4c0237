"""``make plan`` (python -m tools.plan): every experiment plans without GPUs or checkpoints and writes the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner import COMPONENTS, PHASES, make_plan
from run.compose import ConfigError, compose, list_experiments
from tools.plan import main, plan_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent
KEYS = (
    "phases",
    "peak_bytes",
    "peak_phase",
    "fits",
    "recommended_gpu_memory_utilization",
    "kv_cache_bytes",
    "kv_cache_tokens",
)


def check_keys(result: dict) -> None:
    assert set(KEYS) <= set(result)
    assert [p["name"] for p in result["phases"]] == list(PHASES)
    for p in result["phases"]:
        assert tuple(p["components"]) == COMPONENTS
        assert p["predicted_bytes"] == sum(p["components"].values())
    assert result["peak_bytes"] == max(p["predicted_bytes"] for p in result["phases"])
    assert result["peak_phase"] in PHASES


def test_python_m_tools_plan_writes_the_json_for_the_32b_experiment(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.plan", "--exp", "qwen32b_8xh100", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    check_keys(result)
    # the experiment is tuned to fit an H100 80GB with the 5% fragmentation margin to spare
    assert result["fits"] and result["peak_phase"] == "train"
    assert result["peak_bytes"] <= result["device"]["budget_bytes"] < result["device"]["capacity_bytes"]
    assert 0 < result["recommended_gpu_memory_utilization"] < 1
    assert result["kv_cache_tokens"] == result["kv_cache_bytes"] // result["kv_bytes_per_token"] // 16 * 16
    assert "fits: peak train" in proc.stdout and "rollout" in proc.stdout


@pytest.mark.parametrize("exp", list_experiments())
def test_every_experiment_plans(exp, tmp_path, capsys):
    out = tmp_path / f"{exp}.json"
    assert main(["--exp", exp, "--json", str(out)]) == 0
    check_keys(json.loads(out.read_text()))
    assert "phase (GiB)" in capsys.readouterr().out


def test_overrides_are_planned_against_the_experiments_kv_cache(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["actor.offload.params=false", "rollout.wake_strategy=all_at_once"]
    assert main(["--exp", "qwen32b_8xh100", "--json", str(out), *args]) == 0
    result = json.loads(out.read_text())
    base = result["with_experiment_kv_cache"]
    assert result["overrides"] == args and base["kv_cache_bytes"] > 0
    text = capsys.readouterr().out
    assert "against qwen32b_8xh100 as composed: largest safe KV cache" in text
    # an explicit KV budget the staged plan leaves room for overflows once the params stay through the wake
    assert main(["--exp", "qwen32b_8xh100", "--json", str(out), *args, "rollout.gpu_memory_utilization=0.9"]) == 0
    result = json.loads(out.read_text())
    assert not result["fits"] and {o["phase"] for o in result["overflows"]} >= {"rollout", "wake_weights"}
    assert main(["--exp", "qwen32b_8xh100", "--check", *args, "rollout.gpu_memory_utilization=0.9"]) == 1


def test_config_errors_are_one_line(capsys):
    assert main(["--exp", "qwen32b_8xh100", "cluster.device=TPU"]) == 2
    assert "config error: cluster.device='TPU' is not one of" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="architecture 'Nope' is not shipped; choose one of"):
        compose("qwen7b_1xh200", ["model.architecture=arch:Nope"])


def test_run_config_maps_onto_the_planner_inputs():
    cfg = compose("qwen32b_8xh100")
    inputs = plan_inputs(cfg)
    # the planner reads the run's own component configs, not a copy of their fields
    assert inputs.actor is cfg.actor and inputs.rollout is cfg.rollout
    assert (inputs.actor.tp, inputs.actor.pp, inputs.actor_dp, inputs.rollout.tp) == (8, 1, 1, 4)
    assert inputs.device.name == "H100-80GB" and inputs.shape.source == "arch:Qwen2.5-32B-Instruct"
    # DP=1, but megatron's optimizer CPU offload (actor.optimizer_offload_fraction) needs the distributed optimizer
    assert inputs.distributed_optimizer and inputs.actor.optimizer_offload_fraction == 0.3
    assert inputs.sequences_per_step == 128 * 8
    assert (inputs.prompt_tokens, inputs.response_tokens) == (768 - 512, 512)  # max_model_len bounds both
    assert inputs.rollout.utilization is None  # auto
    tiny = plan_inputs(compose("tiny_cpu"))
    assert tiny.device.kind == "cpu" and tiny.attention == "unfused" and tiny.rollout.engine == "native"
    assert tiny.utilization_capacity_bytes == 2**30 and tiny.rollout.utilization == 0.5


def test_make_plan_uses_the_tasks_longest_prompt_as_the_run_does(tmp_path, tiny_model_dirs, capsys):
    """make plan EXP=tiny_cpu plans what the run's own plan (run/setup.py plan_and_build_engine) does: the task's longest
    prompt tokenized with the checkpoint's tokenizer (4 tokens for "4+4="), not the max_model_len bound."""
    from transformers import AutoTokenizer

    from rl.data import longest_prompt_tokens

    cfg = compose("tiny_cpu")
    # the run: its own tokenizer (the written checkpoint's) and task, through the same function
    run_prompt = longest_prompt_tokens(
        cfg.data.build(seed=cfg.trainer.seed), AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    )
    run_plan = make_plan(plan_inputs(cfg, run_prompt))
    out = tmp_path / "plan.json"
    assert main(["--exp", "tiny_cpu", "--json", str(out)]) == 0
    assert "prompts: data.task=digit_sum's longest prompt, 4 tokens (as the run plans)" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["prompt_tokens"] == run_prompt == 4 and written["prompt_from_data"]
    assert written["peak_bytes"] == run_plan.peak_bytes
    train = next(p for p in written["phases"] if p["name"] == "train")
    assert train["predicted_bytes"] == run_plan.phase("train").predicted_bytes
    bound = make_plan(plan_inputs(cfg))  # the max_model_len bound: what make plan said before
    assert bound.phase("train").predicted_bytes > 4 * train["predicted_bytes"]


def test_make_plan_says_when_the_data_is_absent(tmp_path, capsys):
    """No tokenizer here (a cluster checkpoint path): the bound is used and the output says so."""
    out = tmp_path / "plan.json"
    assert (
        main(["--exp", "tiny_cpu", "model.path=/nonexistent/ckpt", "model.architecture=tiny:qwen2", "--json", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "no tokenizer at model.path='/nonexistent/ckpt'" in printed and "max_model_len bound" in printed
    written = json.loads(out.read_text())
    assert not written["prompt_from_data"] and written["prompt_tokens"] > 4
    gsm8k = ["data.task=gsm8k", "data.path=/nonexistent/gsm8k.jsonl", "trainer.sft_warmup_steps=0"]
    assert main(["--exp", "tiny_cpu", *gsm8k]) == 0
    assert "no data here" in capsys.readouterr().out


def test_plan_json_has_the_headroom_beyond_uncertainty_and_the_nodes_host_memory(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--exp", "qwen32b_8xh100", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["headroom_beyond_uncertainty_bytes"] >= 4 * 2**30
    assert written["headroom_beyond_uncertainty_bytes"] == written["headroom_bytes"] - sum(
        written["uncertainty_bytes"].values()
    )
    host = written["host"]
    assert {"peak_bytes_per_node", "node_memory_bytes", "peak_phase", "fits"} <= set(host)
    assert host["node_memory_bytes"] == 2 * 2**40 and host["fits"] is True
    # every phase holds the pinned offload buffers and the checkpoint's staging; weight_sync adds the reference
    # check's gathered tensors on the host (planner/plan.py::reference_check_bytes)
    assert host["peak_phase"] == "weight_sync" and host["peak_bytes_per_node"] > 2**40
    assert host["peak_components_per_rank"]["reference_check"] > 0
    assert {c["name"] for c in written["communicators"]} >= {"world", "megatron TP", "vLLM dp (PyNccl)"}
    assert written["recommended_optimizer_offload_fraction"] <= 0.3
