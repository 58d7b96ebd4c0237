"""The planner's count of what megatron's local (CPU) decoder layer keeps for backward per token
(planner/sizes.py::local_layer_activation_elements_per_token) against autograd's saved tensors of a real layer,
counted with ``torch.autograd.graph.saved_tensors_hooks`` (parameters apart), packed sequences through
megatron_backend/model.py's attention (torch's flash kernel: no [s, s] scores)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist import run_ranks

TOKENS = 64


def _saved_bytes_of_first_layer(
    rank: int, world_size: int, head_dim: int, intermediate: int, family: str = "qwen2"
) -> int:
    import dataclasses

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    dims = initialize_model_parallel(tp=world_size, pp=1, vpp=None)
    shape = dataclasses.replace(
        ModelShape.from_pretrained(f"tiny:{family}"), head_dim=head_dim, intermediate_size=intermediate
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
    from planner.sizes import layer_activation_bytes_per_token, local_packed_attention_padding_bytes_per_token

    shape = dataclasses.replace(
        ModelShape.from_pretrained("tiny:qwen2"), head_dim=head_dim, intermediate_size=intermediate
    )
    saved = run_ranks(_saved_bytes_of_first_layer, tp, head_dim, intermediate)[0]
    per_token = layer_activation_bytes_per_token(shape, tp, 4, "unfused", packed=True)
    assert saved == TOKENS * (per_token + local_packed_attention_padding_bytes_per_token(shape, tp))  # fp32 tiny


@pytest.mark.parametrize("tp", [1, 2])  # 2 and 1 KV heads per rank: the query regrouped by a copy, or a view
def test_qwen3s_q_and_k_norms_are_counted(tp):
    """Qwen3's per-head q and k RMSNorms keep their x * rsqrt, rsqrt and inputs (the fused qkv output, and the query's
    copy when it is regrouped): planner/sizes.py::local_layer_activation_elements_per_token, on tiny:qwen3."""
    from modelspec import ModelShape
    from planner.sizes import layer_activation_bytes_per_token, local_packed_attention_padding_bytes_per_token

    shape = ModelShape.from_pretrained("tiny:qwen3")
    assert shape.qk_norm
    saved = run_ranks(_saved_bytes_of_first_layer, tp, shape.head_dim, shape.intermediate_size, "qwen3")[0]
    per_token = layer_activation_bytes_per_token(shape, tp, 4, "unfused", packed=True)
    assert saved == TOKENS * (per_token + local_packed_attention_padding_bytes_per_token(shape, tp))


def _saved_bytes_outside_the_layers(rank: int, world_size: int) -> int:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    shape = ModelShape.from_pretrained("tiny:qwen2")
    [model] = build_gpt_chunks(shape, initialize_model_parallel(tp=world_size, pp=1, vpp=None))
    depth, storages = [0], {}
    for layer in (m for m in model.modules() if type(m).__name__ == "TransformerLayer"):
        layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
        layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    inside = set()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if depth[0]:
            inside.add(key)
        elif not (t.is_leaf and t.requires_grad) and key not in inside:  # parameters apart
            storages[key] = t.untyped_storage().nbytes()
        return t

    length = TOKENS // 2  # two packed sequences
    cu = torch.tensor([0, length, TOKENS], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length
    )
    ids = torch.randint(0, shape.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, torch.arange(length).repeat(2).unsqueeze(0), attention_mask=None, packed_seq_params=params)
    return sum(storages.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_the_ends_of_the_model_are_counted(tp):
    """Outside the decoder layers a train forward keeps the embedding's ids (and at TP > 1 its vocab-slice mask) and
    the final norm's tensors: planner/sizes.py::stage_ends_activation_bytes_per_token (logits apart: the model's
    output here is not kept by anything)."""
    from modelspec import ModelShape
    from planner.sizes import stage_ends_activation_bytes_per_token

    shape = ModelShape.from_pretrained("tiny:qwen2")
    saved = run_ranks(_saved_bytes_outside_the_layers, tp)[0]
    per_token = stage_ends_activation_bytes_per_token(shape, tp, 4, True, first=True, last=True, split=1)
    assert saved == TOKENS * per_token


def _forward_peak_of_first_layer(
    rank: int, world_size: int, dims: dict, lengths: list[int], dtype: str = "float32"
) -> int:
    import dataclasses

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape
    from telemetry.live_tensors import LiveTensorBytes

    shape = dataclasses.replace(ModelShape.from_pretrained("tiny:qwen2"), **dims)
    [model] = build_gpt_chunks(shape, initialize_model_parallel(tp=world_size, pp=1, vpp=None), dtype)
    layer = next(m for m in model.modules() if type(m).__name__ == "TransformerLayer")
    live = LiveTensorBytes()
    layer.register_forward_pre_hook(lambda *_: [live.__enter__(), None][1])  # a hook's result replaces the args
    layer.register_forward_hook(lambda *_: live.__exit__(None, None, None))
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    ids = torch.randint(0, shape.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        model(ids, positions, attention_mask=None, packed_seq_params=params)
    return live.peak


FORWARD_TOKENS = 384


@pytest.mark.parametrize(
    ("dims", "lengths", "dtype"),
    [
        ({"head_dim": 32, "intermediate_size": 64}, [FORWARD_TOKENS], "float32"),  # the attention's widest moment
        ({"head_dim": 48, "intermediate_size": 384}, [192, 192], "float32"),  # the MLP's
        ({"head_dim": 32, "intermediate_size": 256, "num_heads": 8, "num_kv_heads": 2}, [128] * 3, "float32"),
        ({"head_dim": 64, "intermediate_size": 64, "num_heads": 8, "num_kv_heads": 2}, [96] * 4, "float32"),
        ({"head_dim": 32, "intermediate_size": 64}, [200, 100, 50, 34], "float32"),  # 800 padded rows, 384 tokens
        ({"head_dim": 32, "intermediate_size": 512}, [48] * 8, "float32"),  # the MLP's (short sequences)
        # 16 bits: the kernel in fp32; at 8 query heads a KV head the gathered output is the wider moment
        ({"head_dim": 32, "intermediate_size": 64}, [200, 100, 50, 34], "bfloat16"),
        ({"head_dim": 32, "intermediate_size": 64, "num_heads": 8, "num_kv_heads": 1}, [96] * 4, "bfloat16"),
    ],
)
def test_the_local_layer_forward_count_is_its_live_peak(dims, lengths, dtype):
    """old/ref_logprob's layer over packed sequences (planner/sizes.py::local_packed_layer_forward_bytes): the live
    tensors' peak of one layer's forward under torch.no_grad, counted per aten op, at the attention's and the MLP's
    moments, with sequences of one length and of four (padded to the longest)."""
    import dataclasses

    from modelspec import ModelShape
    from planner.sizes import local_packed_layer_forward_bytes

    shape = dataclasses.replace(ModelShape.from_pretrained("tiny:qwen2"), **dims)
    peak = run_ranks(_forward_peak_of_first_layer, 1, dims, lengths, dtype)[0]
    padded, element_bytes = len(lengths) * max(lengths), 4 if dtype == "float32" else 2
    assert peak == local_packed_layer_forward_bytes(shape, 1, element_bytes, sum(lengths), padded, len(lengths))


def _release_collectives_on_this_thread() -> None:
    """Megatron's dispatcher's gloo collectives (its all-to-alls of tokens and probs, its all-gather of the
    per-expert counts) made to return only once gloo's worker thread has let go of their tensors, as the native
    engine's own collectives do (rollout/native/model.py::_collective, which says why): otherwise a tensor whose
    last Python reference goes first is freed from gloo's thread at a moment nobody chose, and the live peak
    counts it or not by luck (seen under load: +2048 bytes, the [tokens x top-k] fp32 probs at 256 tokens)."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from rollout.native.model import _collective

    def released(collective):
        def run(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            _collective(lambda: collective(*args, **kwargs), *tensors)

        return run

    dist.all_reduce = released(dist.all_reduce)
    dist.all_to_all_single = released(dist.all_to_all_single)
    dist.all_gather = released(dist.all_gather)
    mappings.dist_all_gather_func = released(mappings.dist_all_gather_func)


def _moe_block_bytes(rank: int, world_size: int, tokens: int, train: bool) -> tuple[int, int]:
    """One MoE block of the tiny Qwen3-MoE at EP ``world_size`` (the router's aux and z losses on, as tiny_cpu_moe
    runs): what autograd keeps (``train``; the block's input apart: the norm's output, the layer's count) or the
    live peak without grad, and the routed copies this rank's experts received."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks, moe_kwargs
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    shape = ModelShape.from_pretrained("tiny:qwen3_moe")
    dims = initialize_model_parallel(tp=1, pp=1, vpp=None, ep=world_size)
    [model] = build_gpt_chunks(shape, dims, moe=moe_kwargs(shape, dims, aux_loss_coef=1e-3, z_loss_coef=1e-4))
    block = next(m.mlp for m in model.modules() if type(m).__name__ == "TransformerLayer")
    received = []
    block.experts.register_forward_pre_hook(lambda _, args: received.append(args[0].shape[0]))
    length = tokens // 4
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length
    )
    ids = torch.randint(0, shape.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(rank))
    args = (ids, torch.arange(length).repeat(4).unsqueeze(0))
    if not train:
        from telemetry.live_tensors import LiveTensorBytes

        _release_collectives_on_this_thread()
        live = LiveTensorBytes()
        block.register_forward_pre_hook(lambda *_: [live.__enter__(), None][1])
        block.register_forward_hook(lambda *_: live.__exit__(None, None, None))
        with torch.no_grad():
            model(*args, attention_mask=None, packed_seq_params=params)
        return live.peak, received[0]
    inside, before, storages, held = [False], set(), {}, []  # held: no address reused within the count

    def enter(_, block_args):
        inside[0] = True
        before.add(block_args[0].untyped_storage().data_ptr())

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if inside[0] and not (t.is_leaf and t.requires_grad) and key not in before:
            storages[key] = t.untyped_storage().nbytes()
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args, attention_mask=None, packed_seq_params=params)
    return sum(storages.values()), received[0]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("tokens", [256, 512])
def test_the_local_moe_block_count_is_what_it_keeps_and_holds(tokens, train):
    """An MoE layer on the local spec (SequentialMLP, alltoall dispatcher, EP 2): the kept count
    (planner/sizes.py::moe_activation_bytes_per_token) against autograd's saved tensors, the no-grad count
    (moe_forward_bytes_per_token) against the live peak, at the copies each rank received (balanced routing is
    the plan's: k per token). Beyond the count: per-call [E] and [ep, E/ep] int64 counts and the scalar losses."""
    from modelspec import ModelShape
    from planner.sizes import moe_activation_bytes_per_token, moe_forward_bytes_per_token

    shape = ModelShape.from_pretrained("tiny:qwen3_moe")
    count = moe_activation_bytes_per_token if train else moe_forward_bytes_per_token
    for measured, received in sorted(run_ranks(_moe_block_bytes, 2, tokens, train), reverse=True):
        counted = tokens * count(shape, 1, 4, local=True, received_per_token=received / tokens)
        # kept: exact but for the per-token rounding and the small per-call tensors; without grad the widest moment
        # moves a little with how the received copies split over the local experts (measured: within 0.03%)
        allowance = tokens // 2 + 256 if train else measured // 1000
        assert abs(measured - counted) < allowance, (measured, counted, received)


# (hidden, q heads, KV heads, head_dim, intermediate): KV heads 2 of 4 (the query regrouped by a copy), one KV head,
# as many as the q heads
WRITTEN_SHAPES = ((128, 4, 2, 32, 256), (256, 8, 1, 16, 384), (96, 6, 6, 16, 320))


# and MoE layers: (..., experts, top-k, expert intermediate)
WRITTEN_MOE_SHAPES = ((128, 4, 2, 32, 256, 4, 2, 64), (192, 4, 2, 32, 256, 8, 3, 32), (160, 4, 2, 32, 256, 6, 1, 80))


def _written_shape(family: str, dims: tuple[int, ...], num_layers: int = 4):
    """tiny:<family> with one of WRITTEN_SHAPES' (hidden, q heads, KV heads, head_dim, intermediate), or
    WRITTEN_MOE_SHAPES' (every layer an MoE layer)."""
    from modelspec import ModelShape

    hidden, heads, kv_heads, head_dim, intermediate, *moe = dims
    shape = dataclasses.replace(
        ModelShape.from_pretrained(f"tiny:{family}"),
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
    )
    if moe:
        experts, top_k, expert_intermediate = moe
        shape = dataclasses.replace(
            shape,
            num_experts=experts,
            moe_top_k=top_k,
            moe_intermediate_size=expert_intermediate,
            moe_layers=tuple(range(num_layers)),
        )
    return shape


def _fresh_bytes_counter(counting=lambda: True):
    """A dispatch mode that adds up, while ``counting()`` is true, the bytes of every op's outputs that alias none of
    its inputs (the new tensors the op writes), in its ``written_bytes``. Built in the rank: torch is imported there."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class FreshBytes(TorchDispatchMode):
        written_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if counting():
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
                for t in tree_flatten(out)[0]:
                    if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                        self.written_bytes += t.untyped_storage().nbytes()
            return out

    return FreshBytes()


def _written_bytes_per_layer(
    rank: int, world_size: int, family: str, dtype: str, lengths=(256,) * 4, shapes=WRITTEN_SHAPES
) -> list[tuple[float, float, int]]:
    """Per WRITTEN_SHAPES: (forward, backward) bytes per token of the new tensors one decoder layer makes (its 2-layer
    model's less its 1-layer model's: every op's outputs that alias no input), and the layer's parameter bytes."""
    import itertools

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks, moe_kwargs
    from megatron_backend.parallel import initialize_model_parallel

    dims = initialize_model_parallel(tp=world_size, pp=1, vpp=None)
    tokens = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    longest = max(lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    results = []
    for dims_ in shapes:
        per_model = {}
        for layers in (1, 2):
            shape = _written_shape(family, dims_, layers)
            [model] = build_gpt_chunks(shape, dims, dtype=dtype, moe=moe_kwargs(shape, dims))
            ids = torch.randint(0, shape.vocab_size, (1, tokens))
            positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            with _fresh_bytes_counter() as forward:
                y = model(ids, positions, attention_mask=None, packed_seq_params=params)
            with _fresh_bytes_counter() as backward:
                y.float().sum().backward()
            layer = sum(p.numel() * p.element_size() for p in model.decoder.layers[0].parameters())
            per_model[layers] = (forward.written_bytes, backward.written_bytes, layer)
        (f1, b1, layer), (f2, b2, _) = per_model[1], per_model[2]
        results.append(((f2 - f1) / tokens, (b2 - b1) / tokens, layer))
    return results


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "float32"), ("qwen3", "float32"), ("qwen2", "bfloat16")])
def test_the_local_layer_written_count_is_what_its_ops_make(family, dtype):
    """planner/sizes.py::local_layer_written_bytes_per_token (the step-time model's fresh writes on CPU) against the
    dispatcher: every new tensor of a real layer's forward and backward, per token, on three shapes; backward's
    weight gradients (per micro-batch) apart. Within a byte of ~20-50 KB per token (the sequences' bounds arrays),
    where one term wrong by its smallest coefficient is 64 bytes off."""

    from planner.sizes import local_layer_written_bytes_per_token

    measured = run_ranks(_written_bytes_per_layer, 1, family, dtype)[0]
    e = 4 if dtype == "float32" else 2
    tokens = 1024
    for dims, (forward, backward, layer) in zip(WRITTEN_SHAPES, measured):
        shape, hidden = _written_shape(family, dims), dims[0]
        assert abs(forward - local_layer_written_bytes_per_token(shape, 1, e, backward=False)) < 1, (shape, forward)
        # the weight gradients: one per parameter in the dtype, and in 16 bits the two norms' in fp32 first
        grads = layer + (2 * hidden * 4 if e == 2 else 0)
        counted = local_layer_written_bytes_per_token(shape, 1, e, backward=True) + grads / tokens
        assert abs(backward - counted) < 1, (shape, backward, counted)


def test_the_padded_attention_rows_are_written_per_padded_row():
    """Unequal sequences: the padded q, k, v, output and their gradients are per padded row (sequences x the
    longest), the rest per real token, as planner/step_time.py counts them."""
    from planner.sizes import (
        local_layer_written_bytes_per_token,
        local_packed_attention_backward_padding_bytes_per_token,
        local_packed_attention_padding_bytes_per_token,
    )

    lengths = (200, 100, 50, 10)
    [(forward, backward, layer)] = run_ranks(
        _written_bytes_per_layer, 1, "qwen2", "float32", lengths, WRITTEN_SHAPES[:1]
    )[0]
    shape = _written_shape("qwen2", WRITTEN_SHAPES[0])
    tokens, rows = sum(lengths), len(lengths) * max(lengths)
    pad = local_packed_attention_padding_bytes_per_token(shape, 1)
    pad_backward = local_packed_attention_backward_padding_bytes_per_token(shape, 1)
    for measured, counted, per_pad, extra in (
        (forward, local_layer_written_bytes_per_token(shape, 1, 4, backward=False), pad, 0),
        (backward, local_layer_written_bytes_per_token(shape, 1, 4, backward=True), pad_backward, layer),
    ):
        expected = ((counted - per_pad) * tokens + per_pad * rows + extra) / tokens
        assert abs(measured - expected) < 1, (measured, expected)


def test_the_local_moe_layer_written_count_is_what_its_ops_make():
    """The same count for megatron's local MoE layer (router, alltoall dispatcher, SequentialMLP) on three shapes of
    experts, top-k and expert intermediate: the attention's part as the dense layer's, the block's in bytes."""
    from planner.sizes import local_layer_written_bytes_per_token

    measured = run_ranks(_written_bytes_per_layer, 1, "qwen3_moe", "float32", (256,) * 4, WRITTEN_MOE_SHAPES)[0]
    for dims, (forward, backward, layer) in zip(WRITTEN_MOE_SHAPES, measured):
        shape = _written_shape("qwen3_moe", dims)
        assert abs(forward - local_layer_written_bytes_per_token(shape, 1, 4, False, sparse=True)) < 1, dims
        counted = local_layer_written_bytes_per_token(shape, 1, 4, True, sparse=True) + layer / 1024
        assert abs(backward - counted) < 1, (dims, backward, counted)


def _moe_block_written(rank: int, world_size: int, tokens: int, dims: tuple[int, ...]) -> tuple[int, int, int]:
    """One MoE block (router, alltoall dispatcher, SequentialMLP) of a WRITTEN_MOE_SHAPES shape at EP ``world_size``:
    the bytes of the new tensors its forward and its backward make (every op's outputs that alias no input), and the
    routed copies this rank's experts received."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_backend.model import build_gpt_chunks, moe_kwargs
    from megatron_backend.parallel import initialize_model_parallel

    shape = _written_shape("qwen3_moe", dims, 1)
    dims_ = initialize_model_parallel(tp=1, pp=1, vpp=None, ep=world_size)
    [model] = build_gpt_chunks(shape, dims_, moe=moe_kwargs(shape, dims_))
    block = next(m.mlp for m in model.modules() if type(m).__name__ == "TransformerLayer")
    received, inside = [], [False]
    block.experts.register_forward_pre_hook(lambda _, args: received.append(args[0].shape[0]))
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    block.register_full_backward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_full_backward_hook(lambda *_: inside.__setitem__(0, False))

    length = tokens // 4
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length
    )
    ids = torch.randint(0, shape.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(7 * rank + 1))
    with _fresh_bytes_counter(lambda: inside[0]) as forward:  # the block's ops only
        out = model(ids, torch.arange(length).repeat(4).unsqueeze(0), attention_mask=None, packed_seq_params=params)
    with _fresh_bytes_counter(lambda: inside[0]) as backward:
        out.float().sum().backward()
    return forward.written_bytes, backward.written_bytes, received[0]


def test_the_local_moe_layer_writes_per_routed_copy_it_received():
    """Uneven routing (EP 2): the rank whose experts received more routed copies writes more, by the count's
    per-received-copy terms (planner/sizes.py::local_layer_written_bytes_per_token at each rank's
    routed_copies_ratio; the step-time model's MoE rank at the step's recorded ratio). The two ranks pass as many
    tokens, so their difference is the received copies' alone; two shapes tell the h and m terms apart."""
    from planner.sizes import local_layer_written_bytes_per_token

    tokens = 1024
    for dims in WRITTEN_MOE_SHAPES[1:]:
        shape = _written_shape("qwen3_moe", dims, 1)
        (f0, b0, r0), (f1, b1, r1) = run_ranks(_moe_block_written, 2, tokens, dims)
        assert r0 != r1, "balanced routing tells nothing: another seed"
        for backward, measured in ((False, f0 - f1), (True, b0 - b1)):
            # the count per received copy: a token's k copies more between ratios 1 and 2 (whole bytes, no rounding)
            per_copy = (
                local_layer_written_bytes_per_token(shape, 1, 4, backward, sparse=True, routed_copies_ratio=2.0)
                - local_layer_written_bytes_per_token(shape, 1, 4, backward, sparse=True, routed_copies_ratio=1.0)
            ) / shape.moe_top_k
            assert measured == per_copy * (r0 - r1), (dims, backward, measured / (r0 - r1), per_copy)
