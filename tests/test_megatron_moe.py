"""megatron-core's MoE layers on CPU gloo: expert parallel through the token dispatchers (real processes)."""

from __future__ import annotations

import math

import pytest

from tests.dist import run_ranks
from tests.test_megatron_cpu import MICRO_BATCH, SEQ_LEN, lm_forward_step, random_batches

NUM_MICROBATCHES = 2
NUM_EXPERTS, TOP_K = 4, 2


def _moe_shape():
    """tiny:qwen3 with MoE MLPs in layers 1..3 (layer 0 dense, as Qwen3-MoE's mlp_only_layers allows)."""
    from modelspec import ModelShape

    shape = ModelShape.from_pretrained("tiny:qwen3")
    moe = dict(num_experts=NUM_EXPERTS, moe_top_k=TOP_K, moe_intermediate_size=64, norm_topk_prob=True)
    moe["moe_layers"] = (1, 2, 3)
    for name, value in moe.items():  # a stand-in for the family contract's MoE fields
        object.__setattr__(shape, name, value)
    return shape


def _train_moe(rank: int, world_size: int, tp: int, ep: int, dispatcher: str):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_backend.model import (
        ROUTER_LOSSES,
        build_gpt_chunks,
        clear_router_losses,
        moe_kwargs,
        padded_vocab_size,
        router_losses,
    )
    from megatron_backend.parallel import initialize_model_parallel

    dims = initialize_model_parallel(tp=tp, pp=1, ep=ep)
    shape = _moe_shape()
    moe = moe_kwargs(shape, dims, aux_loss_coef=1e-2, z_loss_coef=1e-3, token_dispatcher=dispatcher)
    chunks = build_gpt_chunks(shape, dims, moe=moe)
    local_experts = {n for n, _ in chunks[0].named_parameters() if ".local_experts." in n}
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dims.dp > 1
    )
    model = DistributedDataParallel(config=chunks[0].config, ddp_config=ddp_config, module=chunks[0])
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=dims.dp > 1), [model]
    )
    batches = random_batches(shape.vocab_size, seed=100 + dims.dp_rank, num=NUM_MICROBATCHES)  # per DP rank

    def run(forward_only: bool) -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = get_forward_backward_func()(
            forward_step_func=lm_forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQ_LEN,
            micro_batch_size=MICRO_BATCH,
            forward_only=forward_only,
        )
        return sum(o["loss"].item() for o in outputs) / NUM_MICROBATCHES

    clear_router_losses()
    loss_before = run(forward_only=False)
    losses = router_losses(dims, list(ROUTER_LOSSES), num_moe_layers=3, num_micro_batches=NUM_MICROBATCHES)
    expert_grads = {
        n: float(p.main_grad.abs().sum()) for n, p in model.module.named_parameters() if ".local_experts." in n
    }
    update_successful, grad_norm, _ = optimizer.step()
    clear_router_losses()
    loss_after = run(forward_only=True)
    return dict(
        ep_rank=dims.ep_rank,
        tp_rank=dims.tp_rank,
        local_experts=sorted(local_experts),
        router_losses=losses,
        expert_grads=expert_grads,
        update_successful=update_successful,
        grad_norm=float(grad_norm),
        loss_before=loss_before,
        loss_after=loss_after,
        vocab=padded_vocab_size(shape.vocab_size, tp),
    )


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_gpt_model_expert_parallel_train_step(dispatcher):
    results = run_ranks(_train_moe, 2, 1, 2, dispatcher)
    assert sorted(r["ep_rank"] for r in results) == [0, 1]
    for r in results:
        # 3 MoE layers x 2 local experts (of 4) x fc1 / fc2, named 0..1 on each EP rank
        assert len(r["local_experts"]) == 3 * (NUM_EXPERTS // 2) * 2, r["local_experts"]
        assert all(g > 0 for g in r["expert_grads"].values()), r["expert_grads"]
        assert set(r["router_losses"]) == {"moe/load_balancing_loss", "moe/z_loss"}, r["router_losses"]
        assert all(v > 0 and math.isfinite(v) for v in r["router_losses"].values()), r["router_losses"]
        assert r["update_successful"] and r["grad_norm"] > 0
        assert abs(r["loss_before"] - math.log(r["vocab"])) < 0.5, r  # random init: about ln(padded V)
        assert r["loss_after"] < r["loss_before"] - 1e-3, r  # megatron's optimizer step went downhill
    # the losses are means over layers, micro-batches and DP ranks: every rank logs the same; the balance loss
    # is E x sum_e f_e p_e, 1 when the routing is uniform
    assert results[0]["router_losses"] == results[1]["router_losses"]
    assert 0.9 < results[0]["router_losses"]["moe/load_balancing_loss"] < 2.0
    # the two EP ranks hold different experts: their grads differ
    assert results[0]["expert_grads"] != results[1]["expert_grads"]


def test_expert_layout_bad_input_names_the_field():
    from megatron_backend.config import ActorConfig
    from modelspec.mesh import check_world, min_world_size

    for bad, field in [(dict(ep=0), "actor.ep"), (dict(etp=0), "actor.etp"), (dict(moe_aux_loss_coef=-1), "aux")]:
        with pytest.raises(ValueError, match=field):
            ActorConfig(**bad)
    with pytest.raises(ValueError, match="actor.moe_token_dispatcher"):
        ActorConfig(moe_token_dispatcher="flex")
    assert ActorConfig(tp=2).expert_tp == 2 and ActorConfig(tp=2, etp=1).expert_tp == 1
    # megatron's two grids: tp x dp x pp and etp x ep x expert-dp x pp over one world
    assert min_world_size(tp=2, pp=1, ep=2) == 4  # etp follows tp: 2 x 2
    assert min_world_size(tp=2, pp=1, ep=2, etp=1) == 2
    assert min_world_size(tp=1, pp=2, ep=2) == 4
    assert min_world_size(tp=2, pp=2, ep=1) == 4
    check_world(4, tp=2, pp=1, ep=2)
    with pytest.raises(ValueError, match="actor.etp x actor.ep x actor.pp"):
        check_world(2, tp=2, pp=1, ep=2)
