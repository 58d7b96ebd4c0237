"""Phi-3, the family whose checkpoint fuses qkv_proj [q; k; v] and gate_up_proj [gate; up]: its data, its
refused quirks, and end to end (parity against transformers, weight sync into both engines)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_backend.layout import RankLayout, rank_pieces
from modelspec import ModelShape
from modelspec.tiny import tiny_hf_config
from rollout.layout import vllm_param_layouts

# tiny:phi3: hidden 128, 4 q heads / 2 KV heads of head_dim 32, intermediate 256
QKV = (
    "model.layers.1.self_attn.qkv_proj.weight"  # [(4 + 2 + 2) * 32 = 256, 128]: q [0, 128), k [128, 192), v [192, 256)
)
GATE_UP = "model.layers.1.mlp.gate_up_proj.weight"  # [512, 128]: gate [0, 256), up [256, 512)


def test_tiny_phi3_checkpoint_is_fused(tiny_model_dirs):
    from safetensors import safe_open

    with safe_open(f"{tiny_model_dirs['phi3']}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice(QKV).get_shape() == [256, 128] and f.get_slice(GATE_UP).get_shape() == [512, 128]
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    shape = ModelShape.from_pretrained(tiny_model_dirs["phi3"])
    assert (shape.model_type, shape.qkv_bias, shape.qk_norm, shape.head_dim) == ("phi3", False, False, 32)


def test_vllm_rank_reads_its_rows_of_the_fused_tensors():
    """TP=2 rank 1: q heads 2-3, KV head 1, the second half of gate and of up, written by hand."""
    layouts = {p.name: p for p in vllm_param_layouts(ModelShape.from_pretrained("tiny:phi3"), tp=2, tp_rank=1)}
    qkv = layouts[QKV]
    assert qkv.local_shape == (128, 128)
    assert [(s.hf_name, s.hf_start, s.hf_stop, s.local_start) for s in qkv.slices] == [
        (QKV, 64, 128, 0),
        (QKV, 160, 192, 64),
        (QKV, 224, 256, 96),
    ]
    gate_up = layouts[GATE_UP]
    assert [(s.hf_name, s.hf_start, s.hf_stop, s.local_start) for s in gate_up.slices] == [
        (GATE_UP, 128, 256, 0),
        (GATE_UP, 384, 512, 128),
    ]


def test_megatron_rank_interleaves_its_group_from_the_fused_tensor():
    """Actor TP=2 rank 1 holds KV group 1: linear_qkv = [q heads 2-3; k_1; v_1], fc1 = [gate half 2; up half 2]."""
    pieces = rank_pieces(ModelShape.from_pretrained("tiny:phi3"), RankLayout(2, 1, None, 1, 0))
    by_param = {}
    for p in pieces:
        if p.hf_name in (QKV, GATE_UP):
            by_param.setdefault(p.megatron_name, []).append((p.hf_start, p.local_start, p.length))
    assert sorted(by_param["decoder.layers.1.self_attention.linear_qkv.weight"]) == [
        (64, 0, 64),
        (160, 64, 32),
        (224, 96, 32),
    ]
    assert sorted(by_param["decoder.layers.1.mlp.linear_fc1.weight"]) == [(128, 0, 128), (384, 128, 128)]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(partial_rotary_factor=0.75), "partial_rotary_factor=0.75"),  # Phi-4-mini's
        (dict(sliding_window=64), "sliding_window=64 < max_position_embeddings=256"),
        (
            dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 16, long_factor=[1.0] * 16)),
            "RoPE type 'longrope'",
        ),
    ],
)
def test_quirks_nothing_here_implements_are_refused(overrides, field):
    """A v4-style config.json (RoPE keys at the top; transformers folds them into rope_parameters)."""
    config = tiny_hf_config("phi3").to_dict()
    config.pop("rope_parameters")
    config |= dict(rope_theta=10_000.0, **overrides)
    with pytest.raises(ValueError, match=field):
        ModelShape.from_hf_config(config, source="phi3-test")


def _one_json_line(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def test_parity_with_transformers_tp2_pp2(tiny_model_dirs):
    out = _one_json_line(
        [sys.executable, "-m", "tools.parity", "--hf", tiny_model_dirs["phi3"], "--tp", "2", "--pp", "2"]
    )
    assert out["model_type"] == "phi3" and out["num_tokens"] > 0 and out["max_abs_logprob_diff"] <= 1e-4


@pytest.mark.parametrize("engine", ["native", pytest.param("vllm", marks=pytest.mark.vllm)])
@pytest.mark.parametrize("train_tp, train_pp, rollout_tp", [(2, 2, 2), (2, 1, 1)])
def test_verify_sync_into_the_engine(tiny_model_dirs, engine, train_tp, train_pp, rollout_tp):
    """HF (fused) -> actor shards -> planned reshard -> engine: its log-probs equal transformers'."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "tools.verify_sync", "--hf", tiny_model_dirs["phi3"], "--engine", engine]
    cmd += ["--train-tp", str(train_tp), "--train-pp", str(train_pp), "--rollout-tp", str(rollout_tp)]
    out = _one_json_line(cmd)
    assert out["verified"] is True and out["bytes_moved"] > 0 and out["num_tokens"] > 0
    assert out["max_abs_logprob_diff"] <= 1e-4
    if engine == "vllm":  # a fresh vLLM built from the actor's export (fused tensors written back) agrees
        assert out["max_abs_logprob_diff_fresh"] <= 1e-4
