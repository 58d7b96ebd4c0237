"""Every routing switch of the MoE families' configs (docs/DESIGN.md "MoE routing switches") runs as transformers
runs it, or is refused in one line before anything starts: top-k from 1 to E, normalised or not, Qwen3-MoE's
sparse-layer layouts; parity (``make parity``) and the weight sync into the engine (``make verify-sync``) at actor
TP2 x EP2, one spawned world for every variant."""

from __future__ import annotations

import json
import re

import pytest
import torch

from modelspec import ModelShape
from modelspec.tiny import tiny_hf_config, write_tiny_model
from tests.dist import run_ranks

# name -> (family, config overrides of its tiny checkpoint); E = 4 experts. Sparse layers of the Qwen3-MoE ones:
# (1, 3), (0, 1, 3), (1, 2), (1,)
VARIANTS = {
    "qwen3_moe_top1_norm_step2": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen3_moe_top1": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=False)),
    "qwen3_moe_top4_norm": ("qwen3_moe", dict(num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0, 3])),
    "qwen3_moe_top4_step2": (
        "qwen3_moe",
        dict(num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3]),
    ),
    "mixtral_top1": ("mixtral", dict(num_experts_per_tok=1)),
    "mixtral_top4": ("mixtral", dict(num_experts_per_tok=4)),
}
SPARSE = {
    "qwen3_moe_top1_norm_step2": (1, 3),
    "qwen3_moe_top1": (0, 1, 3),
    "qwen3_moe_top4_norm": (1, 2),
    "qwen3_moe_top4_step2": (1,),
}


def _shape(name: str) -> ModelShape:
    family, overrides = VARIANTS[name]
    return ModelShape.from_hf_config(tiny_hf_config(family, **overrides))


@pytest.mark.parametrize("name", ["qwen3_moe_top1_norm_step2", "qwen3_moe_top1", "mixtral_top1"])
def test_top1_maps_to_a_megatron_router(name):
    """Top-1 runs megatron's pre-softmax router (softmax over E, then top-1: megatron refuses a softmax over the one
    chosen logit); normalised, the actor renormalises the one weight to 1.0 (megatron_backend.model)."""
    from megatron_backend.model import moe_kwargs, transformer_config
    from megatron_backend.parallel import ParallelDims

    shape = _shape(name)
    dims = ParallelDims(0, 1, 1, 1, 1, None, 0, 0, 0, None, None, None, torch.device("cpu"))
    config = transformer_config(shape, dims, moe=moe_kwargs(shape, dims))
    assert (config.moe_router_topk, config.moe_router_pre_softmax) == (1, True)
    assert shape.norm_topk_prob == (name != "qwen3_moe_top1")


def test_renormalised_top1_weights_are_one():
    """The router hook: HF's ``w / w.sum()`` over the one chosen weight (1.0 exactly), a dropped token's 0 kept,
    and gradients (the aux loss's among them) still flow into the probabilities."""
    from megatron_backend.model import renormalised_top1

    probs = torch.tensor([[0.0, 0.37, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.91, 0.0, 0.0, 0.0]], requires_grad=True)
    routing_map = probs.detach() > 0
    weights, same_map = renormalised_top1(None, (), (probs, routing_map))
    assert torch.equal(weights, routing_map.float()) and same_map is routing_map  # dropped token 1: all zero
    weights.sum().backward()
    assert torch.isfinite(probs.grad).all()


def _config_dir(tmp_path, family: str, overrides: dict) -> str:
    """A checkpoint directory whose config.json is all that every check before launch reads (the weights file is
    only looked for)."""
    path = tmp_path / family
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**tiny_hf_config(family).to_dict(), **overrides}))
    (path / "model.safetensors").touch()
    return str(path)


REFUSED = [
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0 is not supported; set an integer >= 1"),
    ("qwen3_moe", dict(mlp_only_layers=[0, 1, 2, 3]), r"mlp_only_layers=\[0, 1, 2, 3\] with decoder_sparse_step=1"),
    ("qwen3_moe", dict(decoder_sparse_step=5, mlp_only_layers=[]), "decoder_sparse_step=5 leave no sparse layer"),
    ("qwen3_moe", dict(num_experts_per_tok=0), r"num_experts_per_tok=0 must be in \[1, num_local_experts=4\]"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size=64 .shared experts."),
    ("mixtral", dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, num_local_experts=4\]"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 .* supported: 0.0"),
]


@pytest.mark.parametrize("family, overrides, match", REFUSED, ids=[f"{f}-{next(iter(o))}" for f, o, _ in REFUSED])
def test_unsupported_routing_is_refused_in_one_line_before_launch(tmp_path, capsys, family, overrides, match):
    """The run's config check (RunConfig, composed: nothing started) and the CLIs' input checks (exit 2 before
    torchrun or any rank) name the key, its value and what is supported, on one line."""
    from run.compose import compose
    from tools import parity, verify_sync

    path = _config_dir(tmp_path, family, overrides)
    with pytest.raises(ValueError, match=match) as info:
        compose("tiny_cpu_moe", [f"model.path={path}"])
    assert "\n" not in str(info.value)
    assert parity.main(["--hf", path, "--tp", "2", "--ep", "2"]) == 2
    assert verify_sync.main(["--hf", path, "--train-tp", "2", "--train-ep", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.split(": ", 1)[0] in ("parity", "verify-sync") for line in lines), lines
    assert all(re.search(match, line) for line in lines), lines


def _variants_at_tp2_ep2(rank: int, world_size: int, dirs: dict) -> dict:
    """Per variant: tools.parity's check (actor TP2 x EP2 vs transformers) and tools.verify_sync's (the same actor
    -> planned sync -> the native engine at rollout TP 2 or EP 2 -> greedy tokens scored by transformers)."""
    from tools import parity, verify_sync

    out = {}
    for index, (name, path) in enumerate(dirs.items()):
        args = ["--hf", path, "--tp", "2", "--ep", "2"]
        out[name, "parity"] = parity.parity(parity.build_parser().parse_args(args))
        rollout = ["--rollout-tp", "2"] if index % 2 else ["--rollout-ep", "2"]  # both engine layouts
        args = ["--hf", path, "--train-tp", "2", "--train-ep", "2", *rollout, "--max-new-tokens", "8"]
        out[name, "sync"] = verify_sync.sync_and_score(verify_sync.build_parser().parse_args(args))
    return out


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_routing")
    return {name: str(write_tiny_model(family, root / name, **kw)) for name, (family, kw) in VARIANTS.items()}


@pytest.mark.numeric
def test_routing_variants_at_tp2_ep2_match_transformers(variant_dirs):
    for name, layers in SPARSE.items():
        assert ModelShape.from_pretrained(variant_dirs[name]).moe_layers == layers, name
    results = run_ranks(_variants_at_tp2_ep2, 4, variant_dirs, timeout_s=1500)[0]
    print(json.dumps({f"{name} {check}": r for (name, check), r in results.items()}))  # the figures, under -s
    for name in VARIANTS:
        check = results[name, "parity"]
        assert (check["tp"], check["ep"], check["world_size"]) == (2, 2, 4), check
        assert check["num_tokens"] > 0 and check["max_abs_logprob_diff"] <= 1e-5, (name, check)
        sync = results[name, "sync"]
        assert sync["verified"] and sync["num_tokens"] > 0, (name, sync)
        assert sync["max_abs_logprob_diff"] <= 1e-4, (name, sync)
