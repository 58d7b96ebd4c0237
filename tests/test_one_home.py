"""One home per rule: the layout check every entry point calls, and the same message from each."""

from __future__ import annotations

import json

import pytest

from modelspec import ColocatedMesh, ModelShape
from modelspec.tiny import tiny_hf_config
from tests.planner_inputs import make_inputs, merged

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
    from planner import device_preset
    from rollout.layout import tp_shape, vllm_param_layouts
    from run.compose import ConfigError, compose

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
    expect("planner (actor)", actor, lambda: make_inputs(actor=dict(tp=2), shape=shape, device=device))
    expect("planner (rollout)", rollout, lambda: make_inputs(rollout=dict(tp=2), shape=shape, device=device))
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


# ---------------------------------------------------------------- engine memory behaviour: colocation.engines
def test_one_engine_list_everywhere():
    from colocation.engines import ENGINE_PROFILES, ENGINES
    from configs.rollout import RolloutConfig
    from planner import device_preset

    assert set(ENGINES) == set(ENGINE_PROFILES) == {"native", "vllm"}
    shape = ModelShape.from_pretrained("tiny:qwen2")
    for engine in ENGINES:
        RolloutConfig(engine=engine)
        make_inputs(rollout=dict(engine=engine), shape=shape, device=device_preset("cpu"))
    unknown = r"rollout.engine='sglang' is not one of \('native', 'vllm'\)"
    with pytest.raises(ValueError, match=unknown):
        RolloutConfig(engine="sglang")
    with pytest.raises(ValueError, match=unknown):
        make_inputs(rollout=dict(engine="sglang"), shape=shape, device=device_preset("cpu"))


@pytest.mark.parametrize("engine", ["native", "vllm"])
@pytest.mark.parametrize("device_kind", ["cpu", "cuda"])
def test_the_kv_sizing_rule_and_its_inverse_agree(engine, device_kind):
    from colocation.engines import KvSizing, engine_profile

    profile = engine_profile(engine)
    sizing = KvSizing(
        device_kind=device_kind,
        device_total_bytes=80 * 2**30,
        capacity_bytes=2 * 2**30 if device_kind == "cpu" else 80 * 2**30,
        weight_bytes=300 * 2**20,
        activation_reserve_bytes=64 * 2**20,
        profiled_reserve_bytes=3 * 2**30,
    )
    kv = profile.kv_cache_bytes(0.5, sizing)
    assert profile.utilization(kv, sizing) == pytest.approx(0.5)
    reserve = 3 * 2**30 if profile.profiles_activations(device_kind) else 64 * 2**20
    capacity = sizing.device_total_bytes if profile.profiles_activations(device_kind) else sizing.capacity_bytes
    assert kv == capacity // 2 - 300 * 2**20 - reserve


def test_the_planner_sizes_the_native_kv_cache_as_the_engine_does():
    """The planner and the engine apply the same rule (colocation.engines) to the same config."""
    from configs.rollout import RolloutConfig
    from planner import PlanInputs, device_preset, make_plan
    from planner.sizes import engine_param_count

    shape = ModelShape.from_pretrained("tiny:qwen2")
    cfg = RolloutConfig(
        engine="native", gpu_memory_utilization=0.3, cpu_capacity_gb=0.5, max_num_seqs=100_000, max_new_tokens=1024
    )
    inputs = PlanInputs(shape=shape, device=device_preset("cpu"), dtype="float32", rollout=cfg)  # the same object
    plan = make_plan(inputs)
    weights = engine_param_count(shape, 1) * 4
    assert plan.engine_weight_bytes == weights
    engine_budget = cfg.kv_cache_budget_bytes("cpu", int(0.5 * 2**30), weights)
    block = plan.kv_bytes_per_token * inputs.kv_block_size
    assert plan.kv_cache_source == "gpu_memory_utilization"
    assert plan.kv_cache_bytes == engine_budget // block * block > 0
    assert inputs.kv_block_size == cfg.block_size_on("cpu") == 16


def test_the_planner_asks_the_profile_not_the_name(monkeypatch):
    """An engine that cannot sleep or repacks on sync: the plan follows its profile, no code names it."""
    from dataclasses import replace

    from colocation import engines
    from planner import device_preset, make_plan

    shape = ModelShape.from_pretrained("tiny:qwen2")
    awake = replace(engines.ENGINE_PROFILES["native"], name="awake", sleeps=False, repacks_weights_on=("cpu",))
    monkeypatch.setitem(engines.ENGINE_PROFILES, "awake", awake)
    common = dict(actor=dict(tp=1), rollout=dict(kv_cache_bytes=2**24), shape=shape, device=device_preset("cpu"))
    native = make_plan(make_inputs(**merged(common, dict(rollout=dict(engine="native")))))
    plan = make_plan(make_inputs(**merged(common, dict(rollout=dict(engine="awake")))))
    weights = native.engine_weight_bytes
    assert native.phase("train").components["engine_weights"] == 0
    assert plan.phase("train").components["engine_weights"] == weights  # never released
    assert plan.phase("train").components["kv_cache"] == native.kv_cache_bytes
    reserve = plan.phase("weight_sync").components["engine_reserve"]
    assert reserve - native.phase("weight_sync").components["engine_reserve"] == weights  # the repack copy


# ---------------------------------------------------------------- gpu_memory_utilization=auto: run.memory_plan
def test_auto_is_one_value_resolved_in_one_place():
    from configs.rollout import AUTO
    from planner import make_plan
    from run.compose import ConfigError, compose
    from run.main import check_launch
    from run.memory_plan import choose_kv_cache, engine_config, plan_inputs, plan_launch

    cfg = compose("qwen7b_1xh200", [])  # gpu_memory_utilization: auto
    assert cfg.rollout.gpu_memory_utilization == AUTO and cfg.rollout.utilization is None
    assert cfg.rollout.planner_sizes_kv_cache and plan_inputs(cfg).rollout.utilization is None
    choice = choose_kv_cache(cfg, make_plan(plan_inputs(cfg)))
    engine_cfg = engine_config(cfg, choice)  # what the engine gets: bytes and a float, never "auto"
    assert type(engine_cfg.gpu_memory_utilization) is float and not engine_cfg.planner_sizes_kv_cache
    assert engine_cfg.utilization == pytest.approx(choice.gpu_memory_utilization)
    assert engine_cfg.kv_cache_bytes == choice.kv_cache_bytes
    floats = compose("tiny_cpu", ["rollout.gpu_memory_utilization=1"])
    assert type(floats.rollout.gpu_memory_utilization) is float and floats.rollout.utilization == 1.0

    offloads = [f"actor.offload.{what}=false" for what in ("params", "grads", "optimizer")]
    tight = compose("qwen7b_1xh200", offloads)
    with pytest.raises(ValueError) as planned:
        plan_launch(tight)
    with pytest.raises(ConfigError) as launched:
        check_launch(tight, None)
    assert str(launched.value) == str(planned.value)
    assert str(planned.value).startswith("rollout.gpu_memory_utilization=auto: DOES NOT FIT")


# ---------------------------------------------------------------- the shape: read once per run
def _counting_reads(reads: list[str]):
    """ModelShape.from_pretrained, the one reader of config.json, wrapped to record each call."""
    real = ModelShape.from_pretrained.__func__

    def counting(cls, path):
        reads.append(str(path))
        return real(cls, path)

    return classmethod(counting)


def _rank_reads(rank: int, world_size: int, cfg, run_dir: str) -> list[str]:
    from run.loop import run_rank

    reads: list[str] = []
    ModelShape.from_pretrained = _counting_reads(reads)  # this rank's process only
    assert run_rank(cfg, run_dir) == 0
    return reads


def test_the_shape_is_read_once_per_run_and_passed_down(tmp_path, monkeypatch):
    """The launcher reads the shape (composition, then once more when tiny:qwen2 becomes a directory);
    preflight, the planner, the actor, the reference actor and the engine of every rank reuse it."""
    from modelspec.tiny import resolve_model_path
    from run.compose import compose, resolve_path
    from run.main import check_launch, prepare
    from run.memory_plan import plan_inputs
    from run.preflight import preflight
    from tests.dist import run_ranks

    reads: list[str] = []
    monkeypatch.setattr(ModelShape, "from_pretrained", _counting_reads(reads))
    overrides = ["trainer.steps=1", "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=4", "trainer.save_every=0"]
    overrides += ["actor.micro_batch_size=16", "algorithm.kl_coef=0.01", "wandb.mode=disabled"]
    cfg = compose("tiny_cpu", [*overrides, f"output_dir={tmp_path}"])
    assert reads == ["tiny:qwen2"]  # composition (RunConfig's layout check): the tiny config, in memory
    launch = check_launch(cfg, None)
    cfg.model.path = resolve_model_path(resolve_path(cfg.model.path))
    preflight(cfg, None, launch)
    plan_inputs(cfg)
    run_dir = prepare(cfg, tmp_path / "run")
    assert reads == ["tiny:qwen2", cfg.model.path]  # the checkpoint directory's config.json, once
    per_rank = run_ranks(_rank_reads, 2, cfg, str(run_dir), timeout_s=600)
    assert per_rank == [[], []]  # actor, reference actor, engine, planner: the launcher's shape
