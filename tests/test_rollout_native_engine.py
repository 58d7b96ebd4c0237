"""The native engine against transformers (TP=1, TP=2, TP=4 with replicated KV heads), its layout,
continuous batching, sampling and tagged sleep / wake."""

from __future__ import annotations

import os

import pytest
import torch

from configs.rollout import RolloutConfig
from modelspec.families import FAMILIES as MODEL_FAMILIES
from rollout import make_engine
from rollout.engine import RolloutEngine, SamplingParams
from rollout.layout import assemble_local, vllm_param_layouts
from rollout.native import NativeEngine, iter_safetensors
from tests.dist import run_ranks
from tests.rollout_helpers import MAX_NEW_TOKENS, PROMPTS, hf_greedy, hf_logprobs, max_abs_diff

FAMILIES = tuple(MODEL_FAMILIES)  # every family of modelspec.families
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
SMALL = dict(cpu_capacity_gb=0.25, activation_reserve_mb=16)  # a 64 MiB KV budget is plenty here


def _engine(model_dir: str, **cfg) -> NativeEngine:
    return NativeEngine(RolloutConfig(**{**SMALL, **cfg}), model_dir, device="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_tp1(tiny_model_dirs, family):
    engine = _engine(tiny_model_dirs[family])
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(PROMPTS, GREEDY)
    for (hf_tokens, hf_lps), (completion,) in zip(hf_greedy(tiny_model_dirs[family]), out):
        assert completion.token_ids == hf_tokens
        assert max_abs_diff(completion.logprobs, hf_lps) < 1e-4
        assert completion.finish_reason == ("stop" if hf_tokens[-1] == 2 else "length")


def _tp_ranks(rank: int, world_size: int, model_dirs: dict[str, str], families: tuple[str, ...]):
    """Each rank: greedy outputs per family, its params vs the layout, and a sleep / wake / reload round."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    results = {}
    for family in families:
        model_dir = model_dirs[family]
        cfg = RolloutConfig(tp=world_size, **SMALL)
        engine = make_engine(cfg, model_dir, group=group, device="cpu")
        greedy = [(c[0].token_ids, c[0].logprobs, c[0].finish_reason) for c in engine.generate(PROMPTS, GREEDY)]
        # this rank's tensors are exactly vLLM's layout built from the full HF tensors
        hf = dict(iter_safetensors(model_dir))
        layouts = vllm_param_layouts(engine.shape, world_size, rank)
        params = engine.named_parameters()
        assert list(params) == [p.name for p in layouts]
        for layout in layouts:
            assert tuple(params[layout.name].shape) == layout.local_shape, layout.name
            assert torch.equal(params[layout.name], assemble_local(layout, hf)), layout.name
        # sampled: every rank continues with the same tokens
        sampled = engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3))
        # sleep everything, wake weights only, reload, wake the KV cache, generate again
        engine.sleep(["weights", "kv_cache"])
        asleep = engine.memory()
        engine.wake_up(["weights"])
        engine.load_weights(iter_safetensors(model_dir))
        engine.wake_up(["kv_cache"])
        again = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)]
        results[family] = dict(
            greedy=greedy,
            sampled=[[c.token_ids for c in r] for r in sampled],
            asleep=asleep,
            again=again,
            kv_heads=engine.tps.num_kv_heads,
        )
    return results


def _check_tp(results, model_dirs, families):
    for family in families:
        reference = hf_greedy(model_dirs[family])
        for rank_result in results:
            r = rank_result[family]
            for (tokens, lps, _), (hf_tokens, hf_lps) in zip(r["greedy"], reference):
                assert tokens == hf_tokens, family
                assert max_abs_diff(lps, hf_lps) < 1e-4, family
            assert r["asleep"] == {"weights": 0, "kv_cache": 0}
            assert r["again"] == [g[0] for g in r["greedy"]]
            assert r["sampled"] == results[0][family]["sampled"]


def test_greedy_matches_transformers_tp2(tiny_model_dirs):
    results = run_ranks(_tp_ranks, 2, tiny_model_dirs, FAMILIES)
    _check_tp(results, tiny_model_dirs, FAMILIES)


def test_tp4_replicates_kv_heads(tiny_model_dirs):
    # llama: 2 KV heads at TP=4 -> one replicated KV head per rank; tied embeddings; vocab 99 -> 128 / 4
    results = run_ranks(_tp_ranks, 4, tiny_model_dirs, ("llama",))
    assert [r["llama"]["kv_heads"] for r in results] == [1, 1, 1, 1]
    _check_tp(results, tiny_model_dirs, ("llama",))


def test_continuous_batching_reuses_freed_blocks(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    prompts = PROMPTS + [[1, 9, 9, 9, 9, 9, 9], [1, 60]]
    big = _engine(model_dir).generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=20))
    # room for 3 sequences of <= 32 tokens at a time (2 blocks of 16 each), 12 sequences in all
    engine = _engine(model_dir, max_model_len=32, max_num_seqs=3)
    assert engine.kv_cache.num_blocks == 6
    small = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=20))
    assert 1 < engine.scheduler.max_running_seen <= 3
    assert sorted(engine.kv_cache.free_blocks) == list(range(6))  # every block came back
    for a, b in zip(big, small):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert max(max_abs_diff(x.logprobs, y.logprobs) for x, y in zip(a, b)) < 1e-4


def test_max_num_batched_tokens_caps_prefill_batches(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    prompts = PROMPTS + [[1, 9, 9, 9, 9, 9, 9], [1, 60]]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    free = _engine(model_dir)
    uncapped = free.generate(prompts, params)
    longest = max(len(p) for p in prompts)
    capped = _engine(model_dir, max_num_seqs=4, max_num_batched_tokens=2 * longest)
    out = capped.generate(prompts, params)
    assert free.scheduler.max_prefill_tokens_seen > 2 * longest  # every sample prefilled together
    assert capped.scheduler.max_prefill_tokens_seen <= 2 * longest  # two prompts per prefill at most
    for a, b in zip(uncapped, out):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
    with pytest.raises(ValueError, match="rollout.max_num_batched_tokens"):
        RolloutConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_sampling_controls(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs["qwen3"]
    engine = _engine(model_dir)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # top_k=1 and a tiny top_p are greedy whatever the temperature
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True, seed=1),
    ):
        assert [c[0].token_ids for c in engine.generate(PROMPTS, params)] == [c[0].token_ids for c in greedy]
    # seeded sampling is reproducible; n samples per prompt differ
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    first, second = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [[c.token_ids for c in r] for r in first] == [[c.token_ids for c in r] for r in second]
    assert all(len({tuple(c.token_ids) for c in r}) > 1 for r in first)
    assert [[(c.prompt_index, c.sample_index) for c in r] for r in first] == [
        [(i, j) for j in range(4)] for i in range(len(PROMPTS))
    ]
    # top_k=3: every sampled token is among the 3 likeliest; returned log-probs are the model's raw ones
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, samples in zip(
        PROMPTS, engine.generate(PROMPTS, SamplingParams(n=2, temperature=2.0, top_k=3, seed=0))
    ):
        for c in samples:
            full = hf_logprobs(model, prompt, c.token_ids, full=True)  # [len, V]
            chosen = full.gather(1, torch.tensor(c.token_ids)[:, None])
            assert bool(((full > chosen).sum(dim=1) < 3).all())
            assert max_abs_diff(c.logprobs, chosen.squeeze(1).tolist()) < 1e-4
    # stop tokens end a sample with "stop" (the stop token is kept); max_tokens with "length"
    stop_id = greedy[0][0].token_ids[3]
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id], ignore_eos=True)
    c = engine.generate(PROMPTS[:1], params)[0][0]
    assert c.token_ids == greedy[0][0].token_ids[: c.token_ids.index(stop_id) + 1] and c.finish_reason == "stop"
    assert greedy[1][0].finish_reason == "length" and len(greedy[1][0].token_ids) == 8


def test_kv_cache_sized_from_utilization(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["qwen2"], cpu_capacity_gb=0.5, gpu_memory_utilization=0.25, max_num_seqs=4096)
    budget = int(0.25 * 0.5 * 2**30) - engine.weights.num_bytes - 16 * 2**20
    assert engine.kv_cache.budget_bytes == budget
    assert engine.kv_cache.num_blocks == budget // engine.kv_cache.block_bytes
    assert engine.memory()["kv_cache"] == engine.kv_cache.num_blocks * engine.kv_cache.block_bytes
    with pytest.raises(ValueError, match="raise rollout.gpu_memory_utilization"):
        _engine(tiny_model_dirs["qwen2"], cpu_capacity_gb=0.02)


def _rss() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def test_sleep_releases_memory_and_rss(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    # ~300 MiB of KV cache: utilization x capacity - weights - reserve, uncapped by max_num_seqs
    engine = _engine(model_dir, cpu_capacity_gb=0.6, gpu_memory_utilization=0.55, max_num_seqs=100_000)
    before = engine.generate(PROMPTS, GREEDY)
    resident = engine.memory()
    assert resident["kv_cache"] >= 256 * 2**20 and resident["weights"] == engine.weights.num_bytes
    rss_awake = _rss()
    engine.sleep(["weights", "kv_cache"])
    released = resident["weights"] + resident["kv_cache"]
    drop = rss_awake - _rss()
    print(f"released {released / 2**20:.1f} MiB, RSS dropped {drop / 2**20:.1f} MiB ({drop / released:.1%})")
    assert engine.memory() == {"weights": 0, "kv_cache": 0}
    assert drop >= 0.9 * released
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(["weights"])
    assert engine.memory() == {"weights": resident["weights"], "kv_cache": 0}
    assert _rss() < rss_awake - 0.9 * resident["kv_cache"]  # the KV cache stays released
    engine.load_weights(iter_safetensors(model_dir))
    engine.wake_up(["kv_cache"])
    assert engine.memory() == resident
    after = engine.generate(PROMPTS, GREEDY)
    assert [(c[0].token_ids, c[0].logprobs) for c in after] == [(c[0].token_ids, c[0].logprobs) for c in before]


def test_generate_refuses_dropped_weights(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["qwen2"])
    engine.sleep(["weights"])
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.load_weights(iter_safetensors(tiny_model_dirs["qwen2"]))
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(KeyError, match="not a Hugging Face tensor"):
        engine.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(1))])


def test_unsupported_rope_fails_before_loading(tiny_model_dirs, tmp_path):
    """Llama 3.1 RoPE scaling is part of the model contract but not of the native forward: say so at once."""
    import json
    from pathlib import Path

    config = json.loads((Path(tiny_model_dirs["llama"]) / "config.json").read_text())
    llama3 = {  # Llama 3.1's own (transformers rejects it without the frequency factors)
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500_000.0,
    }
    config["rope_parameters" if "rope_parameters" in config else "rope_scaling"] = llama3  # transformers v5 / v4
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights: the check comes first
    with pytest.raises(ValueError, match="rope_type='llama3'.*rollout.engine=vllm"):
        _engine(str(tmp_path))


def test_weight_update_writes_in_place_between_begin_and_finish(tiny_model_dirs):
    """A planned sync writes each rank's slices straight into the tensors begin_weight_update() returns
    (rollout.layout tells where); finish_weight_update() makes them the weights generate uses."""
    model_dir = tiny_model_dirs["qwen3"]  # q/k norms: the engine must not keep stale copies of them
    engine = _engine(model_dir)
    before = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)]
    engine.sleep(["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.begin_weight_update()
    engine.wake_up(["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="finish_weight_update.. without begin_weight_update"):
        engine.finish_weight_update()
    hf = dict(iter_safetensors(model_dir))
    dst = engine.begin_weight_update()
    assert list(dst) == [p.name for p in engine.layouts]
    for layout in engine.layouts:
        dst[layout.name].copy_(assemble_local(layout, hf))
    with pytest.raises(RuntimeError, match="call finish_weight_update"):  # not live before finish
        engine.generate(PROMPTS, GREEDY)
    engine.finish_weight_update()  # marks the dropped weights as written
    assert [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)] == before
    dst = engine.begin_weight_update()
    dst["model.layers.0.self_attn.q_norm.weight"].mul_(3.0)  # a change the next generate must see
    engine.finish_weight_update()
    assert [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)] != before
    # the old hack (an empty load marking in-place writes as loaded) is gone
    with pytest.raises(ValueError, match="begin_weight_update"):
        engine.load_weights([])
    # a sleep that drops the weights cancels an update in progress: its writes are gone
    engine.begin_weight_update()
    engine.sleep(["weights"])
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="without begin_weight_update"):
        engine.finish_weight_update()


def test_rollout_ignore_eos_reaches_the_sampling_params():
    """rollout.ignore_eos=true (the planner's validation runs reach the planned response length) is what every
    generate call of the step gets (run/loop.py builds its params with SamplingParams.from_config)."""
    assert SamplingParams.from_config(RolloutConfig(ignore_eos=True)).ignore_eos is True
    assert SamplingParams.from_config(RolloutConfig()).ignore_eos is False


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_forward_holds_one_layer_at_a_time(tmp_path, family):
    """Between a layer's blocks only the hidden state [N, h] is alive, so a prefill's live tensors peak as high
    with one layer as with four (a loop body's locals once kept the previous layer's qkv and gate_up through the
    next layer's blocks: the tiny qwen2's prefill peaked 1.39 MB instead of 0.94)."""
    from modelspec.tiny import write_tiny_model
    from telemetry.live_tensors import LiveTensorBytes

    prompts = [[(7 * i + j) % 50 + 3 for j in range(12)] for i in range(16)]
    peaks = {}
    for layers in (1, 4):
        engine = _engine(str(write_tiny_model(family, tmp_path / f"{family}{layers}", num_hidden_layers=layers)))
        engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1))  # first use: lazy caches
        with LiveTensorBytes() as live:
            engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1))  # one prefill of 192 tokens
        peaks[layers] = live.peak
    assert peaks[4] == peaks[1] > 0, peaks
