"""The planner's count of what megatron's local (CPU) decoder layer keeps for backward per token
(planner/sizes.py::local_layer_activation_elements_per_token) against autograd's saved tensors of a real layer,
counted with ``torch.autograd.graph.saved_tensors_hooks`` (parameters and the unfused scores and mask apart)."""

from __future__ import annotations

import pytest

from tests.dist import run_ranks

TOKENS = 64


def _saved_bytes_of_first_layer(rank: int, world_size: int, head_dim: int, intermediate: int) -> int:
    import dataclasses

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    dims = initialize_model_parallel(tp=world_size, pp=1, vpp=None)
    shape = dataclasses.replace(
        ModelShape.from_pretrained("tiny:qwen2"), head_dim=head_dim, intermediate_size=intermediate
    )
    [model] = build_gpt_chunks(shape, dims)
    layer = next(m for m in model.modules() if type(m).__name__ == "TransformerLayer")
    inside, storages = [False], {}
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        if inside[0] and not (t.is_leaf and t.requires_grad):  # parameters apart
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cu = torch.tensor([0, TOKENS], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=TOKENS, max_seqlen_kv=TOKENS
    )
    ids = torch.randint(0, shape.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, torch.arange(TOKENS).unsqueeze(0), attention_mask=None, packed_seq_params=params)
    return sum(storages.values())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("head_dim", "intermediate"), [(32, 256), (48, 384)])
def test_the_local_layer_count_is_what_autograd_keeps(tp, head_dim, intermediate):
    import dataclasses

    from modelspec import ModelShape
    from planner.sizes import layer_activation_bytes_per_token, unfused_attention_bytes

    shape = dataclasses.replace(
        ModelShape.from_pretrained("tiny:qwen2"), head_dim=head_dim, intermediate_size=intermediate
    )
    saved = run_ranks(_saved_bytes_of_first_layer, tp, head_dim, intermediate)[0]
    scores = unfused_attention_bytes(shape, tp, 4, 1, TOKENS, kept=True)  # fp32 tiny model
    assert saved - scores == TOKENS * layer_activation_bytes_per_token(shape, tp, 4, "unfused")
