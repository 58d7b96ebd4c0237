"""GPU-only: the native engine on CUDA, and the vLLM engine (parity, vLLM's own layout, sleep / wake / reload).

Skipped without CUDA (tests/conftest.py); the vLLM tests also need `make install EXTRAS=dev,gpu`.
"""

from __future__ import annotations

import pytest
import torch

from configs.rollout import RolloutConfig
from rollout import make_engine
from rollout.engine import SamplingParams
from rollout.layout import assemble_local, vllm_param_layouts
from rollout.native import iter_safetensors
from tests.dist import free_port
from tests.rollout_helpers import MAX_NEW_TOKENS, PROMPTS, hf_greedy, max_abs_diff

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_native_engine_on_cuda_matches_transformers(tiny_model_dirs, family):
    engine = make_engine(RolloutConfig(gpu_memory_utilization=0.05), tiny_model_dirs[family], device="cuda")
    for (hf_tokens, hf_lps), (c,) in zip(hf_greedy(tiny_model_dirs[family]), engine.generate(PROMPTS, GREEDY)):
        assert c.token_ids == hf_tokens
        assert max_abs_diff(c.logprobs, hf_lps) < 1e-4
    free = torch.cuda.mem_get_info()[0]
    resident = engine.memory()
    engine.sleep(["weights", "kv_cache"])
    assert torch.cuda.mem_get_info()[0] - free >= 0.9 * resident["kv_cache"]
    engine.wake_up(["weights", "kv_cache"])
    engine.load_weights(iter_safetensors(tiny_model_dirs[family]))
    assert [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)] == [
        t for t, _ in hf_greedy(tiny_model_dirs[family])
    ]


@pytest.fixture
def torchrun_env(monkeypatch):
    """One rank of an external_launcher 'torchrun' world."""
    pytest.importorskip("vllm")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def test_vllm_engine_parity_layout_sleep_and_reload(tiny_model_dirs, torchrun_env):
    model_dir = tiny_model_dirs["qwen2"]
    cfg = RolloutConfig(engine="vllm", gpu_memory_utilization=0.3, max_model_len=128, sleep_level=2)
    engine = make_engine(cfg, model_dir, dtype="float32", enforce_eager=True)
    reference = hf_greedy(model_dir)
    out = engine.generate(PROMPTS, GREEDY)
    for (hf_tokens, hf_lps), (c,) in zip(reference, out):
        assert c.token_ids == hf_tokens
        assert max_abs_diff(c.logprobs, hf_lps) < 1e-3
    # vLLM's own parameters are exactly what rollout.layout says (the native engine's layout)
    hf = dict(iter_safetensors(model_dir))
    params = engine.named_parameters()
    from modelspec import ModelShape

    layouts = vllm_param_layouts(ModelShape.from_pretrained(model_dir), tp=1, tp_rank=0)
    assert sorted(params) == sorted(p.name for p in layouts)
    for layout in layouts:
        assert tuple(params[layout.name].shape) == layout.local_shape, layout.name
        assert torch.equal(params[layout.name].cpu(), assemble_local(layout, hf)), layout.name
    # sleep (level 2) releases both tags; wake weights, re-sync, wake the KV cache, same greedy output
    free_awake = torch.cuda.mem_get_info()[0]
    resident = engine.memory()
    assert resident["weights"] > 0 and resident["kv_cache"] > 0
    engine.sleep(["weights", "kv_cache"])
    assert engine.memory() == {"weights": 0, "kv_cache": 0}
    assert torch.cuda.mem_get_info()[0] - free_awake >= 0.9 * resident["kv_cache"]
    engine.wake_up(["weights"])
    engine.load_weights(iter_safetensors(model_dir))
    engine.wake_up(["kv_cache"])
    again = engine.generate(PROMPTS, GREEDY)
    assert [c[0].token_ids for c in again] == [c[0].token_ids for c in out]
    sampled = engine.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=0))
    assert all(len(r) == 3 and all(len(c.logprobs) == len(c.token_ids) for c in r) for r in sampled)
