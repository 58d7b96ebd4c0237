"""One home per rule: the layout check every entry point calls, and the same message from each."""

from __future__ import annotations

import json

import pytest

from modelspec import ColocatedMesh, ModelShape
from modelspec.tiny import tiny_hf_config

# tiny:qwen2 has 4 heads and 2 KV heads, so TP=2 splits its attention; 255 cannot be split in two
ODD_INTERMEDIATE = 255


@pytest.fixture()
def odd_model_dir(tmp_path):
    config = tiny_hf_config("qwen2", intermediate_size=ODD_INTERMEDIATE).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _message(tp_key: str, source: str) -> str:
    return f"{tp_key}=2 must divide the intermediate size ({ODD_INTERMEDIATE}) of {source}; pick a divisor"


def test_every_entry_point_rejects_a_non_dividing_intermediate_size_with_one_message(odd_model_dir):
    from megatron_backend.layout import RankLayout, rank_pieces
    from planner import PlanInputs, device_preset
    from rl.compose import ConfigError, compose
    from rollout.layout import tp_shape, vllm_param_layouts

    shape = ModelShape.from_pretrained(odd_model_dir)
    source = str(odd_model_dir)
    actor, rollout = _message("actor.tp", source), _message("rollout.tp", source)
    raised: dict[str, str] = {}

    def expect(name, message, build):
        with pytest.raises((ValueError, ConfigError)) as info:
            build()
        raised[name] = str(info.value)
        assert str(info.value) == message, name

    model = [f"model.path={odd_model_dir}", "cluster.procs_per_node=2"]
    expect("config (actor)", actor, lambda: compose("tiny_cpu", [*model, "actor.tp=2", "rollout.tp=1"]))
    expect("config (rollout)", rollout, lambda: compose("tiny_cpu", [*model, "actor.tp=1", "rollout.tp=2"]))
    expect("mesh", actor, lambda: ColocatedMesh(world_size=2, actor_tp=2).check(shape))
    device = device_preset("cpu")
    expect("planner (actor)", actor, lambda: PlanInputs(shape=shape, device=device, actor_tp=2))
    expect("planner (rollout)", rollout, lambda: PlanInputs(shape=shape, device=device, rollout_tp=2))
    expect("megatron layout", actor, lambda: rank_pieces(shape, RankLayout(2, 1, None, 0, 0)))
    expect("rollout layout", rollout, lambda: tp_shape(shape, 2, 0))
    expect("vLLM layout", rollout, lambda: vllm_param_layouts(shape, 2, 0))
    assert len(raised) == 8


@pytest.mark.parametrize(
    "tp,pp,vpp,rollout_tp,fragment",
    [
        (4, 1, None, 1, "actor.tp=4 must divide the attention heads (4) and KV heads (2) of tiny:qwen2"),
        (1, 3, None, 1, "actor.pp x actor.vpp = 3x1 must divide the 4 layers of tiny:qwen2"),
        (1, 1, None, 3, "rollout.tp=3 must divide the attention heads (4), and divide or be a multiple of the KV"),
    ],
)
def test_mesh_check_names_the_key(tp, pp, vpp, rollout_tp, fragment):
    shape = ModelShape.from_pretrained("tiny:qwen2")
    world = 12
    with pytest.raises(ValueError, match=None) as info:
        ColocatedMesh(world_size=world, actor_tp=tp, actor_pp=pp, actor_vpp=vpp, rollout_tp=rollout_tp).check(shape)
    assert fragment in str(info.value)
    ColocatedMesh(world_size=world, actor_tp=2, actor_pp=2, rollout_tp=4).check(shape)  # KV heads replicated: fine
