"""GPU only (`make test-gpu`): what the main job (`make run EXP=qwen32b_8xh100`) runs and CPU CI cannot, at tiny
sizes, so the first GPU lent runs the main job's code, not a subset:

- vLLM in bfloat16 with CUDA graphs on (no ``enforce_eager``: engine_args leaves it False on CUDA), its log-probs
  within the bf16 engine-vs-actor gap rule of a float32 transformers forward, and the graphs still right after a
  level-2 sleep and a weight reload (the graphs keep the buffers' virtual addresses; sleep mode remaps them);
- the staged wake under vLLM's ``external_launcher`` at engine TP=2 on NCCL, from dummy weights as the run starts
  (sleep all, wake weights, write this rank's slices in place, wake the KV cache), the two TP ranks agreeing on
  sampled tokens;
- the loop itself (``run.main`` -> ``spawn_local`` -> ``run.loop.run_rank``) for 2 steps on 2 GPUs, bf16, vLLM,
  NCCL, megatron's optimizer (the distributed one at DP=2), the planner sizing the KV cache, a checkpoint.

Skipped without CUDA (tests/conftest.py: "needs CUDA"); the vLLM ones need the CUDA build of vLLM
(`make install EXTRAS=dev,gpu`). Written against the installed torch 2.13, megatron-core 0.16.1 and vLLM 0.32.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs.rollout import RolloutConfig
from rollout.engine import SamplingParams
from telemetry.metrics import LOGPROB_GAP_RULE, gap_distribution
from tests.dist import run_ranks
from tests.rollout_helpers import MAX_NEW_TOKENS, PROMPTS, hf_logprobs

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
SAMPLED = SamplingParams(n=4, temperature=1.0, max_tokens=MAX_NEW_TOKENS, seed=7)
BF16_RULE = LOGPROB_GAP_RULE["bfloat16"]


def _gaps_to_transformers(model_dir: str, results) -> dict:
    """The engine's log-prob of each token it generated against a float32 transformers forward of the same tokens:
    gap_distribution over all of them (what the run's engine-vs-actor check reads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    for prompt, samples in zip(PROMPTS, results):
        for c in samples:
            reference = torch.tensor(hf_logprobs(model, prompt, c.token_ids))
            gaps.append((torch.tensor(c.logprobs) - reference).abs())
    return gap_distribution(torch.cat(gaps))


def _within_bf16_rule(dist_: dict) -> bool:
    return dist_["p99"] < BF16_RULE.p99 and dist_["max"] < BF16_RULE.max


@pytest.mark.vllm
def test_vllm_bf16_with_cuda_graphs_within_the_gap_rule_and_after_sleep(tiny_model_dirs, monkeypatch):
    from rollout import make_engine
    from rollout.native import iter_safetensors
    from tests.dist import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model_dir = tiny_model_dirs["qwen2"]
    cfg = RolloutConfig(engine="vllm", gpu_memory_utilization=0.3, max_model_len=128, sleep_level=2)
    engine = make_engine(cfg, model_dir, dtype="bfloat16")  # no enforce_eager: what the run builds on CUDA
    vllm_config = engine.llm.llm_engine.vllm_config
    assert not vllm_config.model_config.enforce_eager
    from vllm.config.compilation import CUDAGraphMode

    assert vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    assert vllm_config.model_config.dtype == torch.bfloat16
    greedy = engine.generate(PROMPTS, GREEDY)
    before = _gaps_to_transformers(model_dir, greedy)
    assert _within_bf16_rule(before), before
    engine.sleep(["weights", "kv_cache"])  # level 2: the weights are dropped, the graphs kept
    engine.wake_up(["weights"])
    engine.load_weights(iter_safetensors(model_dir))
    engine.wake_up(["kv_cache"])
    again = engine.generate(PROMPTS, GREEDY)
    assert [c[0].token_ids for c in again] == [c[0].token_ids for c in greedy]  # same graphs, same weights
    sampled = engine.generate(PROMPTS, SAMPLED)
    after = _gaps_to_transformers(model_dir, sampled)
    assert _within_bf16_rule(after), after


def _write_slices(engine, model_dir: str, tp: int, rank: int) -> dict:
    """The weight sync's in-place path by hand: begin -> this rank's slices (rollout.layout) into vLLM's live
    bf16 parameters on the GPU -> finish; whether what vLLM reads back is those slices in bf16."""
    from safetensors.torch import load_file

    from modelspec import ModelShape
    from rollout.layout import assemble_local, split_in_place, vllm_param_layouts

    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    layouts = vllm_param_layouts(ModelShape.from_pretrained(model_dir), tp=tp, tp_rank=rank % tp)
    dst = engine.begin_weight_update()
    in_place, fell_back = split_in_place(layouts, dst)
    for layout in in_place:
        dst[layout.name].copy_(assemble_local(layout, hf))  # host fp32 -> device bf16
    readable = engine.named_parameters()
    matches = all(
        torch.equal(readable[p.name].cpu(), assemble_local(p, hf).to(readable[p.name].dtype)) for p in in_place
    )
    engine.load_weights([(s.hf_name, hf[s.hf_name]) for p in fell_back for s in p.slices])
    engine.finish_weight_update()
    return {"readable_matches": matches, "fell_back": sorted(p.name for p in fell_back)}


def _staged_wake_tp2(rank: int, world_size: int, model_dir: str) -> dict:
    import torch.distributed as dist

    from modelspec.mesh import ColocatedMesh
    from rollout.vllm_engine import VllmEngine

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")  # as init_distributed does on CUDA; vLLM's external_launcher joins it
    cfg = RolloutConfig(engine="vllm", tp=2, gpu_memory_utilization=0.3, max_model_len=128, sleep_level=2)
    mesh = ColocatedMesh(world_size=world_size, rollout_tp=2)
    engine = VllmEngine(cfg, model_dir, mesh, rank, dtype="bfloat16", load=False)  # dummy weights, as the run
    out: dict = {"awake": engine.memory()}
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(["weights", "kv_cache"])
    out["freed_bytes"] = torch.cuda.mem_get_info()[0] - free_awake
    engine.wake_up(["weights"])  # wake_weights
    out["weights_only"] = engine.memory()
    out["update"] = _write_slices(engine, model_dir, 2, rank)  # weight_sync: in place, this rank's slices
    engine.wake_up(["kv_cache"])  # wake_kv_cache, after the actor's params left
    out["greedy"] = [[(c.token_ids, c.logprobs) for c in s] for s in engine.generate(PROMPTS, GREEDY)]
    out["sampled"] = [[(c.token_ids, c.logprobs) for c in s] for s in engine.generate(PROMPTS, SAMPLED)]
    return out


@pytest.mark.vllm
def test_staged_wake_under_external_launcher_at_engine_tp2(tiny_model_dirs):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    results = run_ranks(_staged_wake_tp2, 2, tiny_model_dirs["qwen2"], timeout_s=1200)
    for r in results:
        assert r["freed_bytes"] >= 0.9 * r["awake"]["kv_cache"], r
        assert r["weights_only"]["kv_cache"] == 0 and r["weights_only"]["weights"] > 0, r
        assert r["update"]["readable_matches"] and not r["update"]["fell_back"], r["update"]
    assert results[0]["greedy"] == results[1]["greedy"]  # every TP rank samples the same tokens
    assert results[0]["sampled"] == results[1]["sampled"]


def _device_preset() -> str | None:
    """This GPU as one of planner.DEVICE_NAMES (None: the planner has no preset for it)."""
    name = torch.cuda.get_device_name(0)
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    for key, preset in (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("B200", "B200")):
        if key in name:
            return preset
    if "A100" in name:
        return "A100-80GB" if total_gb > 50 else "A100-40GB"
    return None


@pytest.mark.vllm
@pytest.mark.parametrize(
    "layout",
    [["actor.tp=2", "rollout.tp=2"], ["actor.tp=1", "rollout.tp=2"], ["actor.tp=1", "rollout.tp=1"]],
    ids=["actor_tp2_dp1", "actor_tp1_dp2_distributed_optimizer", "engine_tp1_two_replicas"],
)
def test_run_rank_two_steps_on_two_gpus(tmp_path, layout):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    preset = _device_preset()
    if preset is None:
        pytest.skip(f"the planner has no preset for {torch.cuda.get_device_name(0)}")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "run.main", "--exp", "tiny_cpu", "--run-dir", str(run_dir), *layout,
        f"cluster.device={preset}", "cluster.procs_per_node=2", "model.dtype=bfloat16", "rollout.engine=vllm",
        "rollout.gpu_memory_utilization=auto", "rollout.wake_strategy=staged", "trainer.steps=2",
        "trainer.sft_warmup_steps=2", "trainer.save_every=1", "wandb.mode=disabled",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    assert summary["memory_plan"] is not None and summary["weight_sync"]["verified"], summary
    assert summary["engine_actor_logprob_diff_max"] < BF16_RULE.max, summary
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
