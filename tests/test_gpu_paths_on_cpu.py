"""CUDA-only fixes exercised on CPU where they can be: exact-size pinned host copies (cudaHostRegister
instead of the caching host allocator) and megatron's loss scaling wired to the optimizer."""

from __future__ import annotations

import pytest
import torch

from megatron_backend.memory import pinned_empty, unpin
from modelspec import TokenBatch
from tests.dist import run_ranks


class StubCudart:
    """torch.cuda.cudart()'s two calls as torch/cuda/_pin_memory_utils.py makes them:
    cudaHostRegister(data_ptr: int, size: int, flags: int) and cudaHostUnregister(data_ptr: int), each
    returning a cudaError (0: success).

    The checks are the runtime's own (cuda_runtime_api.h): flags are cudaHostRegister{Default=0, Portable=1,
    Mapped=2, IoMemory=4, ReadOnly=8} OR'ed; registering a range that overlaps a registered one fails with
    cudaErrorHostMemoryAlreadyRegistered (712); unregistering an unregistered pointer with
    cudaErrorHostMemoryNotRegistered (713). Calls are counted."""

    def __init__(self, fail: bool = False):
        self.registered: dict[int, int] = {}
        self.fail = fail
        self.num_register = self.num_unregister = 0

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        assert all(type(x) is int for x in (ptr, size, flags)), (ptr, size, flags)
        assert ptr > 0 and size > 0 and flags & ~0xF == 0, (ptr, size, flags)
        self.num_register += 1
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        if any(ptr < p + n and p < ptr + size for p, n in self.registered.items()):
            return 712
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        assert type(ptr) is int, ptr
        self.num_unregister += 1
        if ptr not in self.registered:
            return 713
        del self.registered[ptr]
        return 0


def test_pinned_host_copies_are_exactly_the_bytes_moved():
    cudart = StubCudart()
    sizes = [3 * 2**20 + 1, 5 * 2**20]  # not powers of two: the caching allocator would round to 4 and 8 MiB
    hosts = [pinned_empty(n, cudart=cudart) for n in sizes]
    assert [h.numel() for h in hosts] == sizes and all(h.device.type == "cpu" for h in hosts)
    assert sorted(cudart.registered.values()) == sorted(sizes)  # registered exactly, each its own buffer
    assert {h.data_ptr() for h in hosts} == set(cudart.registered)
    for h in hosts:
        unpin(h, cudart=cudart)
    assert cudart.registered == {}
    with pytest.raises(RuntimeError, match="cudaHostRegister of 100 bytes failed with cudaError 2"):
        pinned_empty(100, cudart=StubCudart(fail=True))


def test_offload_registers_each_host_buffer_once_per_run():
    """The CUDA offload path (pinned host copies) on CPU tensors: three offload/onload cycles of two tensors
    (one a view, sharing a storage) register each storage's host buffer once, bit-exact every time; the
    ledger keeps the pinned bytes while onloaded; release_host unregisters them all."""
    from megatron_backend.memory import MemoryLedger, StorageOffloader

    cudart = StubCudart()
    ledger = MemoryLedger()
    big = torch.randn(3 * 2**18 + 1)  # 3 MiB + 4 bytes
    small = torch.randn(1000)
    tensors = [big, big[10:20], small]  # two storages
    nbytes = big.numel() * 4 + small.numel() * 4
    expected = [t.clone() for t in tensors]
    offloader = StorageOffloader("actor_params", ledger, pin=True, cudart=cudart)
    ledger.set("actor_params", resident_bytes=nbytes)
    for step in range(3):
        assert offloader.offload(tensors) == nbytes
        assert big.untyped_storage().nbytes() == 0 and ledger.host_bytes["actor_params"] == nbytes
        assert offloader.onload() == nbytes
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected)), step
        assert ledger.host_bytes["actor_params"] == nbytes  # the pinned buffers stay for the next offload
        big.mul_(2.0)  # the next offload must copy the new values into the same buffers
        expected = [t.clone() for t in tensors]
    assert cudart.num_register == 2 and cudart.num_unregister == 0
    assert sorted(cudart.registered.values()) == sorted([big.numel() * 4, small.numel() * 4])
    offloader.offload(tensors)
    with pytest.raises(RuntimeError, match="onload it before releasing"):
        offloader.release_host()
    offloader.onload()
    offloader.release_host()
    assert cudart.registered == {} and cudart.num_unregister == 2 and ledger.host_bytes["actor_params"] == 0


def _grads_with_and_without_loss_scaling(rank, world_size, tiny_dir):
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.actor_train import use_loss_scaling
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    class ScaledOptimizer:
        """The loss-scale part of megatron's optimizer: its real scale_loss over a fixed scale."""

        scale_loss = MegatronOptimizer.scale_loss

        def get_loss_scale(self):
            return torch.tensor([1024.0])

    dims = initialize_model_parallel(tp=1, pp=1)
    loss_fn = PolicyLoss(PolicyLossConfig())
    grads = []
    for scaled in (False, True):
        actor = Actor(tiny_dir, ActorConfig(micro_batch_size=2), dims)
        if scaled:
            use_loss_scaling(actor.chunks, ScaledOptimizer())
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, actor.shape.vocab_size, (4, 12), generator=gen)
        loss_mask = torch.zeros(4, 11)
        loss_mask[:, 6:] = 1.0
        batch = TokenBatch(input_ids=input_ids, loss_mask=loss_mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.old_logprobs = actor.compute_logprobs(batch)
        actor.compute_grads(batch, loss_fn)
        grads.append([t.clone() for t in actor.states.tensors("grads")])
    return grads


def test_megatron_scales_the_loss_by_the_optimizers_scale(tiny_model_dirs):
    plain, scaled = run_ranks(_grads_with_and_without_loss_scaling, 1, tiny_model_dirs["qwen2"])[0]
    assert any(bool(g.any()) for g in plain)
    # megatron's backward_step multiplied the loss by 1024 through config.grad_scale_func (a power of two:
    # exact in floating point); the megatron optimizer divides it back out in step()
    assert all(torch.allclose(s, 1024 * p, rtol=1e-5, atol=0) for p, s in zip(plain, scaled))


def _on_cuda_without_te_or_apex(rank: int, world_size: int) -> dict:
    """A fresh process that answers torch.cuda.is_available() True (a plain PyTorch CUDA image: no TE, no apex)."""
    from types import SimpleNamespace

    torch.cuda.is_available = lambda: True
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.utils import attention_mask_func

    from megatron_backend import cpu_compat
    from megatron_backend.model import transformer_config
    from modelspec import ModelShape

    cpu_compat.apply()
    dims = SimpleNamespace(device=torch.device("cuda"), tp=2, pp=1, vpp=None)
    config = transformer_config(ModelShape.from_pretrained("tiny:qwen2"), dims, "bfloat16", sequence_parallel=True)
    norm = WrappedTorchNorm(config, config.hidden_size)  # the local spec's norm (MoE at TP > 1: SP is on)
    softmax = FusedScaleMaskSoftmax(  # as megatron's DotProductAttention builds it from the config
        input_in_fp16=False,
        input_in_bf16=True,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=config.masked_softmax_fusion,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    mask = torch.ones(32, 32, dtype=torch.bool).triu(1)[None, None]  # megatron's causal mask (True: masked)
    probs = softmax(torch.randn(1, 4, 32, 32, dtype=torch.bfloat16), mask)  # a shape the fused kernel takes
    return dict(
        te_general_gemm=hasattr(moe_utils, "te_general_gemm") and moe_utils.te_general_gemm is None,
        norm_marked=all(getattr(p, "sequence_parallel", False) for p in norm.parameters()),
        softmax_sums_to_one=bool(torch.allclose(probs.float().sum(-1), torch.ones(1, 4, 32), atol=1e-2)),
        cpu_patches=cpu_compat._applied,
    )


def test_a_cuda_node_without_te_or_apex_gets_the_compat_for_the_absent_libraries():
    """cpu_compat is scoped to the library that is absent, not to "no CUDA": megatron-core 0.16.1's moe_utils
    reads ``te_general_gemm`` (defined only in its TE import), the local spec's WrappedTorchNorm asserts
    ``not config.sequence_parallel`` (torch_norm.py) and FusedScaleMaskSoftmax imports apex's
    ``scaled_masked_softmax_cuda`` when ``masked_softmax_fusion`` is on (fused_softmax.py, get_batch_per_block).
    Its CPU-only patches (the torch proxy, CUDA type names) stay off on CUDA."""
    result = run_ranks(_on_cuda_without_te_or_apex, 1)[0]
    assert result == dict(te_general_gemm=True, norm_marked=True, softmax_sums_to_one=True, cpu_patches=False)
