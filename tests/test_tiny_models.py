"""The tiny checkpoints are normal HF directories that transformers loads and generates from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from modelspec.families import FAMILIES
from modelspec.tiny import TOKENIZER_VOCAB_SIZE, resolve_model_path, write_tiny_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_checkpoint_loads_and_generates(tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = "12+34="
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] == len(prompt)  # one token per character
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 6
    assert tokenizer.decode(ids[0]) == prompt  # decodes without inserted spaces


def test_family_features(tiny_model_dirs):
    def config(family):
        return json.loads((Path(tiny_model_dirs[family]) / "config.json").read_text())

    def tensor_names(family):
        with safe_open(str(Path(tiny_model_dirs[family]) / "model.safetensors"), "pt") as f:
            return set(f.keys())

    qwen2, llama, qwen3 = config("qwen2"), config("llama"), config("qwen3")
    assert qwen2["model_type"] == "qwen2" and not qwen2["tie_word_embeddings"]
    assert qwen2["num_key_value_heads"] < qwen2["num_attention_heads"]  # GQA
    assert "model.layers.0.self_attn.q_proj.bias" in tensor_names("qwen2")
    assert "lm_head.weight" in tensor_names("qwen2")
    assert llama["model_type"] == "llama" and llama["tie_word_embeddings"]
    assert llama["vocab_size"] == TOKENIZER_VOCAB_SIZE and llama["vocab_size"] % 64 != 0
    assert not any(name.endswith(".bias") for name in tensor_names("llama"))
    assert "lm_head.weight" not in tensor_names("llama")
    assert qwen3["model_type"] == "qwen3"
    assert "model.layers.0.self_attn.q_norm.weight" in tensor_names("qwen3")


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # vLLM's CPU attention kernels


@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_dim_runs_in_vllm_cpu_attention(tiny_model_dirs, family):
    c = json.loads((Path(tiny_model_dirs[family]) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    assert head_dim in VLLM_CPU_HEAD_SIZES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_norms_and_biases_are_random(tiny_model_dirs, family):
    """A norm left at 1 or a bias at 0 would hide a tensor written to the wrong place (or never)."""
    with safe_open(str(Path(tiny_model_dirs[family]) / "model.safetensors"), "pt") as f:
        checked = [n for n in f.keys() if "norm" in n or n.endswith("bias")]
        assert checked
        for name in checked:
            t = f.get_tensor(name)
            assert t.unique().numel() == t.numel(), name  # every element distinct: no constant fill
        if family == "qwen2":
            assert not torch.equal(
                f.get_tensor("model.layers.0.self_attn.q_proj.bias"),
                f.get_tensor("model.layers.1.self_attn.q_proj.bias"),
            )


def test_tiny_checkpoints_are_deterministic(tmp_path):
    a = write_tiny_model("llama", tmp_path / "a")
    b = write_tiny_model("llama", tmp_path / "b")
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for name in fa.keys():
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name)), name


def test_resolve_model_path_builds_on_demand(tmp_path):
    path = resolve_model_path("tiny:qwen3", tiny_dir=tmp_path)
    assert (Path(path) / "model.safetensors").is_file()
    assert resolve_model_path("/some/hf/dir", tiny_dir=tmp_path) == "/some/hf/dir"
    with pytest.raises(ValueError, match="unknown tiny model family"):
        resolve_model_path("tiny:gpt5", tiny_dir=tmp_path)


def test_resolve_model_path_rebuilds_a_checkpoint_of_older_sizes(tmp_path):
    write_tiny_model("qwen3", tmp_path / "qwen3", hidden_size=64, head_dim=16)  # what an older version wrote
    path = resolve_model_path("tiny:qwen3", tiny_dir=tmp_path)
    config = json.loads((Path(path) / "config.json").read_text())
    assert (config["hidden_size"], config["head_dim"]) == (128, 32)
