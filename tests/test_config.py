"""Hydra composition of every experiment, and one-line errors on bad input before any process starts."""

from __future__ import annotations

import pytest

from run.compose import ConfigError, compose, list_experiments
from run.config import RunConfig


def test_there_are_experiments_and_tiny_cpu_is_the_default():
    assert "tiny_cpu" in list_experiments()
    assert compose().exp == "tiny_cpu"


@pytest.mark.parametrize("exp", list_experiments())
def test_every_experiment_composes_and_validates(exp):
    cfg = compose(exp)
    assert isinstance(cfg, RunConfig)
    assert cfg.exp == exp  # each file names itself, so a copy-paste slip shows up here
    assert cfg.cluster.world_size == cfg.actor.tp * cfg.actor.pp * cfg.dp


def test_overrides_reach_the_components():
    cfg = compose(
        "tiny_cpu",
        [
            "rollout.wake_strategy=all_at_once",
            "actor.offload.optimizer=false",
            "weight_sync.bucket_mb=64",
            "rollout.gpu_memory_utilization=auto",
        ],
    )
    assert cfg.rollout.wake_strategy == "all_at_once"
    assert cfg.actor.offload.optimizer is False and cfg.actor.offload.params is True
    assert cfg.weight_sync.bucket_mb == 64
    assert cfg.rollout.gpu_memory_utilization == "auto"


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["actor.foo=1"], "unknown config key 'actor.foo'; valid keys here: tp, pp"),
        (["nonsense=1"], "unknown config key 'nonsense'"),
        (["actor.offload.everything=true"], "valid keys here: params, grads, optimizer"),
        (["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization=1.5 is outside (0, 1]"),
        (["rollout.gpu_memory_utilization=0"], "is outside (0, 1]"),
        (["rollout.gpu_memory_utilization=lots"], "must be a float in (0, 1] or 'auto'"),
        (["actor.tp=4", "cluster.procs_per_node=4"], "actor.tp=4 must divide the attention heads (4) and KV heads (2)"),
        (["actor.pp=3", "actor.tp=1", "rollout.tp=1", "cluster.procs_per_node=3"], "must divide the 4 layers"),
        (
            ["actor.pp=2", "actor.vpp=4", "cluster.procs_per_node=4"],
            "actor.pp x actor.vpp = 2x4 must divide the 4 layers",
        ),
        (["cluster.procs_per_node=3"], "actor.tp=2 x actor.pp=1 does not divide the world size 3"),
        (["actor.dp=2"], "set actor.dp=1 or actor.dp=null"),
        (["rollout.tp=8", "cluster.procs_per_node=8", "actor.tp=2"], "rollout.tp=8 must divide the attention heads"),
        (["rollout.wake_strategy=lazy"], "rollout.wake_strategy='lazy' is not one of"),
        (["rollout.engine=sglang"], "rollout.engine='sglang' is not one of"),
        (["wandb.mode=cloud"], "wandb.mode='cloud' is not one of"),
        (["model.path=/no/such/checkpoint"], "model.path='/no/such/checkpoint' has no config.json here"),
        (["actor.tp=two"], "could not be converted to Integer"),
        (["trainer.prompts_per_step=4"], "each DP rank trains on 32 sequences per step"),
        (["actor.tp=1", "trainer.prompts_per_step=3"], "must split evenly over the 2 actor DP ranks"),
        (["model.path=/nope", "model.architecture=Qwen2.5-7B"], "model.architecture='Qwen2.5-7B' is neither"),
        (["actor.max_tokens_per_micro_batch=0"], "actor.max_tokens_per_micro_batch=0 must be a positive integer"),
        (["actor.recompute=sometimes"], "actor.recompute='sometimes' is not one of"),
        (["actor.recompute_modules=[mlp]"], "only applies to actor.recompute=selective"),
        (["rollout.max_num_batched_tokens=16"], "rollout.max_num_batched_tokens=16 must be >= rollout.max_num_seqs"),
        (["algorithm.entropy_coef=-1"], "algorithm.entropy_coef=-1.0 must be >= 0"),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose("tiny_cpu", overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_lever_keys_compose_and_a_token_budget_lifts_the_micro_batch_size_check():
    cfg = compose(
        "tiny_cpu",
        [
            "trainer.prompts_per_step=4",  # 32 sequences per rank: not a multiple of micro_batch_size=64
            "actor.max_tokens_per_micro_batch=512",
            "actor.recompute=selective",
            "actor.recompute_modules=[core_attn,mlp]",
            "actor.logprob_chunk_tokens=null",
            "rollout.max_num_batched_tokens=4096",
        ],
    )
    assert cfg.actor.forward_max_tokens == 1024 and cfg.actor.recompute_modules == ["core_attn", "mlp"]
    assert cfg.actor.logprob_chunk_tokens is None and cfg.rollout.max_num_batched_tokens == 4096


def test_unknown_experiment():
    with pytest.raises(ConfigError, match="EXP='nope' is not an experiment"):
        compose("nope")


def test_real_checkpoint_dims_are_read_and_cross_checked(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    assert compose("tiny_cpu", [f"model.path={path}"]).model.path == path
    with pytest.raises(ConfigError, match="model.num_layers=8 disagrees with"):
        compose("tiny_cpu", [f"model.path={path}", "model.num_layers=8"])
