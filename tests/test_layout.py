"""The pure layout module against explicit reference constructions (no process groups)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_backend.layout import (
    RankLayout,
    layer_offset,
    local_param_shapes,
    padded_vocab_size,
    rank_pieces,
)
from modelspec import ModelShape
from modelspec.family import GATE, O_PROJ, UP, K, Q, V, hf_tensor_shapes
from tests.family_helpers import DENSE_FAMILIES as FAMILIES
from tests.family_helpers import hf_part

LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2), (2, 2, 2)]


def _build_local(pieces, local_shapes, hf):
    """Apply the pieces to full HF tensors: what the loader does, in memory."""
    local = {key: torch.zeros(shape) for key, shape in local_shapes.items()}
    for p in pieces:
        local[(p.vp_stage, p.megatron_name)].narrow(p.dim, p.local_start, p.length).copy_(
            hf[p.hf_name].narrow(p.dim, p.hf_start, p.length)
        )
    return local


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pieces_match_reference_layouts_and_cover_every_tensor(family, tiny_model_dirs):
    shape = ModelShape.from_pretrained(f"tiny:{family}")
    hf = load_file(f"{tiny_model_dirs[family]}/model.safetensors")
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_tensor_shapes(shape)
    d, h, ng = shape.head_dim, shape.hidden_size, shape.num_kv_heads
    qpg = shape.num_heads // ng
    for tp, pp, vpp in LAYOUTS:
        rebuilt = {name: torch.full_like(t, float("nan")) for name, t in hf.items()}
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                layout = RankLayout(tp, pp, vpp, tp_rank, pp_rank)
                pieces = rank_pieces(shape, layout)
                local = _build_local(pieces, local_param_shapes(shape, layout), hf)
                # grouped-interleaved QKV and [gate; up] fc1 against an explicit construction
                for vp in range(vpp or 1):
                    first_layer = layer_offset(shape.num_layers, pp, vpp, pp_rank, vp)
                    q = hf_part(hf, shape, Q, first_layer).view(ng, qpg * d, h)
                    k, v = (
                        hf_part(hf, shape, K, first_layer).view(ng, d, h),
                        hf_part(hf, shape, V, first_layer).view(ng, d, h),
                    )
                    qkv = torch.cat([q, k, v], dim=1).reshape(-1, h).chunk(tp)[tp_rank]
                    assert torch.equal(local[(vp, "decoder.layers.0.self_attention.linear_qkv.weight")], qkv)
                    gate, up = hf_part(hf, shape, GATE, first_layer), hf_part(hf, shape, UP, first_layer)
                    fc1 = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
                    assert torch.equal(local[(vp, "decoder.layers.0.mlp.linear_fc1.weight")], fc1)
                    o = hf_part(hf, shape, O_PROJ, first_layer).chunk(tp, dim=1)[tp_rank]
                    assert torch.equal(local[(vp, "decoder.layers.0.self_attention.linear_proj.weight")], o)
                for piece in pieces:  # inverse direction: exporter semantics
                    if piece.primary:
                        block = local[(piece.vp_stage, piece.megatron_name)].narrow(
                            piece.dim, piece.local_start, piece.length
                        )
                        rebuilt[piece.hf_name].narrow(piece.dim, piece.hf_start, piece.length).copy_(block)
                if shape.tie_word_embeddings and pp > 1 and pp_rank == pp - 1:
                    copy = local[((vpp or 1) - 1, "output_layer.weight")]
                    vocab_rows = padded_vocab_size(shape.vocab_size, tp) // tp
                    start = tp_rank * vocab_rows
                    real = hf["model.embed_tokens.weight"][start : start + vocab_rows]
                    assert torch.equal(copy[: len(real)], real) and not copy[len(real) :].any()
        for name, tensor in hf.items():
            assert torch.equal(rebuilt[name], tensor), (family, tp, pp, vpp, name)


def test_layer_offset_matches_megatron():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for pp, vpp in [(2, None), (2, 2), (4, 2), (2, 4)]:
        config = TransformerConfig(
            num_layers=16,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
        )
        for pp_rank in range(pp):
            for vp in range(vpp or 1):
                expected = get_transformer_layer_offset(config, vp_stage=vp if vpp else None, pp_rank=pp_rank)
                assert layer_offset(16, pp, vpp, pp_rank, vp) == expected, (pp, vpp, pp_rank, vp)


def test_every_rank_s_pieces_tile_every_hf_tensor_once():
    shape = ModelShape.from_pretrained("tiny:llama")
    covered: dict[str, int] = {}
    seen = set()
    grid = [RankLayout(2, 2, 2, tp_rank, pp_rank) for pp_rank in range(2) for tp_rank in range(2)]
    for pieces in (rank_pieces(shape, layout) for layout in grid):
        for p in pieces:
            key = (p.hf_name, p.dim, p.hf_start, p.length)
            if p.primary and key not in seen:  # replicated norms appear on both TP ranks
                seen.add(key)
                other = (
                    torch.Size(hf_tensor_shapes(shape)[p.hf_name]).numel() // hf_tensor_shapes(shape)[p.hf_name][p.dim]
                )
                covered[p.hf_name] = covered.get(p.hf_name, 0) + p.length * other
    assert covered == {n: torch.Size(s).numel() for n, s in hf_tensor_shapes(shape).items()}


def test_te_spec_names_and_divisibility_errors():
    shape = ModelShape.from_pretrained("tiny:qwen2")
    names = {p.megatron_name for p in rank_pieces(shape, RankLayout(1, 1, None, 0, 0, te_norms=True))}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    with pytest.raises(ValueError, match="actor.tp=4 must divide"):
        rank_pieces(shape, RankLayout(4, 1, None, 0, 0))
    with pytest.raises(ValueError, match="actor.pp x actor.vpp = 2x4"):
        rank_pieces(shape, RankLayout(1, 2, 4, 0, 0))
    with pytest.raises(ValueError, match="not supported"):
        ModelShape.from_hf_config({"model_type": "gpt2"})


def test_parity_cli_rejects_bad_input_before_launching(tmp_path, tiny_model_dirs, capsys):
    import json

    from tools.parity import main

    assert main(["--hf", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")
    assert main(["--hf", str(tmp_path / "gpt2")]) == 2
    assert "model_type 'gpt2' is not supported" in capsys.readouterr().err
    assert main(["--hf", tiny_model_dirs["qwen2"], "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "actor.tp=4 must divide" in err and len(err.strip().splitlines()) == 1


def test_te_norm_names_follow_megatrons_te_spec_in_dense_and_moe_layers(monkeypatch):
    """Under TE, megatron-core 0.16.1's TE layer spec (models/gpt/gpt_layer_specs.py, lines 265/291:
    ``pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp``) fuses the pre-MLP norm into
    ``linear_fc1`` only in a dense layer; an MoE layer keeps ``pre_mlp_layernorm``. TE is not installed here, so the
    spec is built on the local provider with TESpecProvider's two fusing answers (transformer_engine_spec_provider.py)."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    from modelspec.tiny import tiny_hf_config

    class LayerNormLinear:  # stands for TELayerNormColumnParallelLinear: its norm is ``layer_norm_weight``
        pass

    class TEFusing(backends.LocalSpecProvider):
        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return LayerNormLinear

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", TEFusing, raising=False)

    def library_names(num_experts) -> set[str]:
        sub = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts).submodules
        names = set()
        if sub.input_layernorm is IdentityOp:
            assert sub.self_attention.submodules.linear_qkv is LayerNormLinear
            names.add("self_attention.linear_qkv.layer_norm_weight")
        if sub.pre_mlp_layernorm is IdentityOp:
            assert sub.mlp.submodules.linear_fc1 is LayerNormLinear
            names.add("mlp.linear_fc1.layer_norm_weight")
        else:
            names.add("pre_mlp_layernorm.weight")
        return names

    shape = ModelShape.from_hf_config(tiny_hf_config("qwen3_moe"))
    assert shape.moe_layers == (0, 1, 3)  # layer 2 is dense (mlp_only_layers)
    layout = RankLayout(1, 1, None, 0, 0, te_norms=True, grouped_experts=True)
    names = {p.megatron_name for p in rank_pieces(shape, layout)}
    assert names == {name for _, name in local_param_shapes(shape, layout)}
    for layer in range(shape.num_layers):
        norms = {n.removeprefix(f"decoder.layers.{layer}.") for n in names if n.startswith(f"decoder.layers.{layer}.")}
        norms = {n for n in norms if "norm" in n and "q_layernorm" not in n and "k_layernorm" not in n}
        assert norms == library_names(8 if shape.is_moe_layer(layer) else None), layer
