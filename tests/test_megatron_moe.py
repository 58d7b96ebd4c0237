"""megatron-core's MoE layers on CPU gloo: expert parallel through the token dispatchers (real processes)."""

from __future__ import annotations

import math

import pytest
import torch

from modelspec import ModelShape
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
    from configs.actor import ActorConfig
    from modelspec.mesh import check_world, min_world_size

    for bad, field in [(dict(ep=0), "actor.ep"), (dict(etp=0), "actor.etp"), (dict(moe_aux_loss_coef=-1), "aux")]:
        with pytest.raises(ValueError, match=field):
            ActorConfig(**bad)
    with pytest.raises(ValueError, match="actor.moe_token_dispatcher"):
        ActorConfig(moe_token_dispatcher="flex")
    with pytest.raises(ValueError, match="actor.sequence_parallel=true needs actor.tp > 1"):
        ActorConfig(sequence_parallel=True)
    # null: megatron's sequence parallelism where it requires it (an MoE model at TP > 1)
    assert ActorConfig(tp=2).sequence_parallel_for(is_moe=True) and not ActorConfig(tp=2).sequence_parallel_for(False)
    assert not ActorConfig(tp=2, sequence_parallel=False).sequence_parallel_for(True)
    assert not ActorConfig(tp=1).sequence_parallel_for(True)
    assert ActorConfig(tp=2).expert_tp == 2 and ActorConfig(tp=2, etp=1).expert_tp == 1
    # megatron's two grids: tp x dp x pp and etp x ep x expert-dp x pp over one world
    assert min_world_size(tp=2, pp=1, ep=2) == 4  # etp follows tp: 2 x 2
    assert min_world_size(tp=2, pp=1, ep=2, etp=1) == 2
    assert min_world_size(tp=1, pp=2, ep=2) == 4
    assert min_world_size(tp=2, pp=2, ep=1) == 4
    check_world(4, tp=2, pp=1, ep=2)
    with pytest.raises(ValueError, match="actor.etp x actor.ep x actor.pp"):
        check_world(2, tp=2, pp=1, ep=2)


def _actor_at_ep2(rank: int, world_size: int, model_dirs: dict, root: str):
    """Per MoE family: the HF checkpoint loaded at EP=2 (gathered back, log-probs), then one train step, the
    trained weights gathered and saved as the actor's distributed checkpoint (for the HF export)."""
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.advantages import grpo_advantages
    from rl.losses import PolicyLoss, PolicyLossConfig

    loss_fn = PolicyLoss(PolicyLossConfig(clip_eps_low=0.5, clip_eps_high=0.5, loss_agg="token-mean"))
    out = {}
    for family, hf_dir in sorted(model_dirs.items()):
        dims = initialize_model_parallel(tp=1, pp=1, ep=2)
        config = ActorConfig(ep=2, micro_batch_size=2, lr=1e-3, moe_aux_loss_coef=1e-2, moe_z_loss_coef=1e-3)
        actor = Actor(hf_dir, config, dims)
        local_experts = sorted(n for n, _ in actor.chunks[0].named_parameters() if ".local_experts." in n)
        loaded = actor.export_hf(dst=0)
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=gen)
        loss_mask = torch.zeros(4, 15)
        loss_mask[:, 5:] = 1.0
        batch = TokenBatch(input_ids=input_ids, loss_mask=loss_mask)
        logprobs = actor.compute_logprobs(batch)
        batch.old_logprobs = logprobs
        batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
        metrics = actor.train_step(batch, loss_fn)
        trained = actor.export_hf(dst=0)
        checkpoint = f"{root}/{family}/checkpoints/step_00000001"
        actor.save_checkpoint(f"{checkpoint}/actor")
        out[family] = dict(
            trained=trained,
            checkpoint=checkpoint,
            hf_dir=hf_dir,
            family=family,
            trained_logprobs=actor.compute_logprobs(TokenBatch(input_ids=input_ids)),
            local_experts=local_experts,
            loaded=loaded,
            logprobs=logprobs,
            input_ids=input_ids,
            metrics=metrics,
            optimizer=actor.optimizer_name,
        )
        del actor
    # megatron's capacity factor at 1.0: the same step with each expert keeping at most ceil(N k / E) of a rank's copies
    family, hf_dir = sorted(model_dirs.items())[0]
    dims = initialize_model_parallel(tp=1, pp=1, ep=2)
    config = ActorConfig(ep=2, micro_batch_size=2, lr=1e-3, moe_aux_loss_coef=1e-2, moe_expert_capacity_factor=1.0)
    actor = Actor(hf_dir, config, dims)
    batch = TokenBatch(input_ids=out[family]["input_ids"], loss_mask=loss_mask)
    batch.old_logprobs = actor.compute_logprobs(batch)
    batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
    out["capacity_factor_1"] = dict(family=family, metrics=actor.train_step(batch, loss_fn))
    return out


@pytest.mark.numeric
def test_actor_loads_hf_moe_at_ep2_matches_transformers_trains_and_exports(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.family_helpers import MOE_FAMILIES
    from tests.test_hf_export import SMALL_SHARD_BYTES, _export, _logprobs, _source_tensors

    dirs = {family: tiny_model_dirs[family] for family in MOE_FAMILIES}
    ranks = run_ranks(_actor_at_ep2, 2, dirs, str(tmp_path / "runs"), timeout_s=900)
    # at capacity factor 1.0 each rank's 32 tokens send at most ceil(32 k / E) copies to each expert, so a rank's
    # experts receive at most N k (planner.sizes.capacity_routed_copies_ratio), where the same step without the
    # factor gave one rank more (asserted below)
    capped = ranks[0]["capacity_factor_1"]
    free_ratio = ranks[0][capped["family"]]["metrics"]["moe/routed_copies_max_ratio"]
    assert capped["metrics"]["moe/routed_copies_max_ratio"] <= 1.0 < free_ratio, (capped["metrics"], free_ratio)
    assert math.isfinite(capped["metrics"]["grad_norm"]) and capped["metrics"]["grad_norm"] > 0, capped["metrics"]
    for family, hf_dir in dirs.items():
        first, second = ranks[0][family], ranks[1][family]
        # EP rank e holds experts 2e, 2e+1, numbered 0 and 1 locally; the two ranks' experts differ
        assert first["local_experts"] == second["local_experts"] and "local_experts.1." in str(first["local_experts"])
        assert "local_experts.2." not in str(first["local_experts"])
        # every HF tensor, per-expert names exactly, gathered from both EP ranks bit-equal to the checkpoint
        source = _source_tensors(hf_dir)
        assert set(first["loaded"]) == set(source), set(first["loaded"]) ^ set(source)
        assert all(torch.equal(first["loaded"][n], source[n]) for n in source), family
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        input_ids = first["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits.float()
        reference = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
        for rank in (first, second):
            assert (rank["logprobs"] - reference).abs().max().item() <= 1e-5, family
        metrics = first["metrics"]
        assert metrics["moe/load_balancing_loss"] == second["metrics"]["moe/load_balancing_loss"]
        assert 0.9 < metrics["moe/load_balancing_loss"] < 4.0 and metrics["moe/z_loss"] > 0, metrics
        # the most routed copies a rank's experts received over balanced routing's: the same on both ranks (a max
        # over them), above 1 (megatron routes unevenly; their weighted mean is 1) and at most the worst case,
        # every token's k copies on one rank's E / 2 experts: 2 min(k, E / 2) / k
        shape = ModelShape.from_pretrained(hf_dir)
        worst = 2 * min(shape.moe_top_k, shape.num_experts // 2) / shape.moe_top_k
        ratio = metrics["moe/routed_copies_max_ratio"]
        assert ratio == second["metrics"]["moe/routed_copies_max_ratio"] and 1.0 < ratio <= worst, (ratio, worst)
        assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0, metrics
        # megatron's ChainedOptimizer: one optimizer for the dense params (DP=2), one for the experts (expert DP=1)
        assert "DistributedOptimizer" in first["optimizer"], first["optimizer"]
        # the HF export of the EP=2 distributed checkpoint: HF's per-expert names exactly (the source's), every
        # tensor bit-equal to the trained actor's, and transformers loads it (nothing missing or extra) to the
        # actor's log-probs
        assert any(not torch.equal(first["trained"][n], source[n]) for n in source), "the step trained nothing"
        exported = _source_tensors(str(_export(first, tmp_path / f"export-{family}", SMALL_SHARD_BYTES)))
        assert {n: t.shape for n, t in exported.items()} == {n: t.shape for n, t in source.items()}, family
        assert all(torch.equal(exported[n], first["trained"][n]) for n in exported), family
        diff = (_logprobs(tmp_path / f"export-{family}", input_ids) - first["trained_logprobs"]).abs().max().item()
        assert diff <= 1e-5, (family, diff)


@pytest.mark.parametrize(
    "world,tp,pp,ep,etp", [(4, 2, 1, 2, None), (4, 1, 2, 2, None), (8, 2, 2, 2, 1), (8, 1, 1, 4, 2)]
)
def test_mesh_expert_coords_are_megatrons(world, tp, pp, ep, etp):
    """The mesh's expert coordinates (what the weight sync plans with) group the ranks as megatron's
    expert RankGenerator (order tp-ep-dp-pp) does."""
    from megatron.core.parallel_state import RankGenerator

    from modelspec.mesh import ColocatedMesh

    mesh = ColocatedMesh(world_size=world, actor_tp=tp, actor_pp=pp, actor_ep=ep, actor_etp=etp)
    expert_tp = etp or tp
    generator = RankGenerator(tp=expert_tp, ep=ep, dp=world // (expert_tp * ep * pp), pp=pp, cp=1, order="tp-ep-dp-pp")
    for group, field in (("tp", "etp_rank"), ("ep", "ep_rank"), ("dp", "expert_dp_rank")):
        for ranks in generator.get_ranks(group):
            # a megatron group: ranks differing only in this coordinate, which runs 0.. in group order
            assert [getattr(mesh.actor_coords(r), field) for r in ranks] == list(range(len(ranks))), (group, ranks)
            others = {
                tuple(
                    getattr(mesh.actor_coords(r), f)
                    for f in ("etp_rank", "ep_rank", "expert_dp_rank", "pp_rank")
                    if f != field
                )
                for r in ranks
            }
            assert len(others) == 1, (group, ranks)
    with pytest.raises(ValueError, match="actor.etp x actor.ep x actor.pp"):
        ColocatedMesh(world_size=2, actor_tp=2, actor_ep=2)


def _train_step_at(rank: int, world_size: int, hf_dir: str, layouts: list):
    """At each (tp, ep) layout on these 4 ranks, from the same HF weights: log-probs of 4 sequences of odd lengths,
    then one train step (router losses on) on 4 other sequences, each DP rank its share; the updated weights
    gathered on rank 0, the step's metrics, and whether megatron ran sequence parallelism."""
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.losses import PolicyLoss, PolicyLossConfig

    loss_fn = PolicyLoss(PolicyLossConfig(clip_eps_low=0.5, clip_eps_high=0.5, loss_agg="token-mean"))
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 64, (4, 16), generator=gen)
    # odd real lengths: under sequence parallelism the packed micro-batch is padded to a multiple of TP
    odd_lens = torch.tensor([13, 16, 11, 15])
    # training: even lengths (the pad tokens would join the router's load-balancing statistics) and the same 6
    # response targets per sequence, so a DP rank's token-mean over its share averages to the batch's
    seq_lens = torch.tensor([14, 16, 12, 10])
    loss_mask = torch.zeros(4, 15)
    for row, length in enumerate(seq_lens.tolist()):
        loss_mask[row, length - 7 : length - 1] = 1.0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = {}
    for tp, ep in layouts:
        dims = initialize_model_parallel(tp=tp, pp=1, ep=ep)
        config = ActorConfig(tp=tp, ep=ep, micro_batch_size=1, lr=1e-4, moe_aux_loss_coef=1e-2, moe_z_loss_coef=1e-3)
        actor = Actor(hf_dir, config, dims)
        share = torch.arange(4).chunk(dims.dp)[dims.dp_rank]
        odd_logprobs = actor.compute_logprobs(TokenBatch(input_ids=input_ids[share], seq_lens=odd_lens[share]))
        batch = TokenBatch(input_ids=input_ids[share], seq_lens=seq_lens[share], loss_mask=loss_mask[share])
        batch.old_logprobs = actor.compute_logprobs(batch)
        batch.advantages = advantages[share]
        metrics = actor.train_step(batch, loss_fn)
        out[(tp, ep)] = dict(
            share=share,
            odd_logprobs=odd_logprobs,
            weights=actor.export_hf(dst=0),
            metrics=metrics,
            sequence_parallel=actor.chunks[0].config.sequence_parallel,
        )
        del actor
    try:  # training an MoE model at TP 2 without sequence parallelism: one line before anything is built
        Actor(hf_dir, ActorConfig(tp=2, ep=2, sequence_parallel=False), dims)
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


@pytest.mark.numeric
def test_moe_train_step_at_tp2_with_sequence_parallelism_matches_tp1(tiny_model_dirs):
    """TP2 x EP2 x DP2 (megatron's sequence parallelism: the norms, router and residual stream on S / 2 tokens per TP
    rank, the dispatcher gathering unequal token counts over TP) gives TP1 x EP2 x DP4's log-probs, router losses, grad
    norm and, after Adam's first step (about lr x sign(grad) per element), weights."""
    from tests.test_hf_export import _source_tensors

    hf_dir = tiny_model_dirs["qwen3_moe"]
    ranks = run_ranks(_train_step_at, 4, hf_dir, [(1, 2), (2, 2)], timeout_s=900)
    tp1, tp2 = ranks[0][(1, 2)], ranks[0][(2, 2)]
    assert tp2["sequence_parallel"] and not tp1["sequence_parallel"]
    assert "set actor.sequence_parallel to null or true" in ranks[0]["refused"]

    def logprobs(layout):  # [4, 15]: each DP rank's share of the odd-length sequences
        full = torch.zeros(4, 15)
        for r in ranks:
            full[r[layout]["share"]] = r[layout]["odd_logprobs"]
        return full

    assert (logprobs((2, 2)) - logprobs((1, 2))).abs().max().item() <= 1e-5
    # the load-balancing loss per micro-batch (one sequence) over its TP ranks' shares: megatron's tracker value of
    # each TP rank is a partial sum, reduced over its reduce group
    for name in ("moe/load_balancing_loss", "grad_norm"):
        assert math.isfinite(tp1["metrics"][name]) and tp1["metrics"][name] > 0.5, (name, tp1["metrics"])
        assert abs(tp2["metrics"][name] - tp1["metrics"][name]) <= 1e-5 * tp1["metrics"][name], (
            name,
            tp1["metrics"][name],
            tp2["metrics"][name],
        )
    source = _source_tensors(hf_dir)
    assert set(tp2["weights"]) == set(tp1["weights"]) == set(source)
    moved = max((tp1["weights"][n] - source[n]).abs().max().item() for n in source)
    assert moved > 0.5e-4, moved  # lr 1e-4: Adam's first step moves every weight with a gradient by about lr
    diffs = {n: (tp2["weights"][n] - tp1["weights"][n]).abs().max().item() for n in source}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-6, (worst, diffs[worst])


def _router_losses_of_layouts(rank: int, world_size: int) -> dict:
    """The router losses of one forward of the same two sequences (7 and 4 tokens) in four layouts: packed, packed with
    a pad sequence (pad_to=8, as sequence parallelism pads), padded [2, 7], each pad-carrying one with and without
    the micro-batch's ``padding_mask``."""
    from megatron_backend.model import (
        ROUTER_LOSSES,
        RoutedCopies,
        build_gpt_chunks,
        clear_router_losses,
        moe_kwargs,
        router_losses,
    )
    from megatron_backend.packing import build_micro_batch
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec.contract import TokenBatch

    dims = initialize_model_parallel(tp=1, pp=1)
    shape = _moe_shape()
    torch.manual_seed(0)
    [model] = build_gpt_chunks(shape, dims, moe=moe_kwargs(shape, dims, aux_loss_coef=1e-2, z_loss_coef=1e-3))
    model.train()
    routed = RoutedCopies([model], shape.moe_top_k)
    ids = torch.randint(3, shape.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(2, 6), seq_lens=torch.tensor([7, 4]))

    def losses(packed: bool, pad_to: int, masked: bool) -> dict:
        mb = build_micro_batch(batch, [0, 1], batch.seq_lens, packed, torch.device("cpu"), False, pad_to)
        clear_router_losses()
        extra = {"padding_mask": mb.padding_mask} if masked else {}
        model(mb.input_ids, mb.position_ids, attention_mask=None, packed_seq_params=mb.packed_seq_params, **extra)
        return router_losses(dims, list(ROUTER_LOSSES), len(shape.moe_layers), 1)

    packed = losses(True, 1, True)
    return dict(
        routed_copies_ratio=routed.take(torch.device("cpu")),  # EP 1: every routed copy stays on the rank
        packed=packed,
        packed_pads=losses(True, 8, True),
        packed_pads_unmasked=losses(True, 8, False),
        padded=losses(False, 1, True),
        padded_unmasked=losses(False, 1, False),
        pad_counts=[
            int(build_micro_batch(batch, [0, 1], batch.seq_lens, p, torch.device("cpu"), False, t).padding_mask.sum())
            for p, t in ((True, 1), (True, 8), (False, 1))
        ],
    )


def test_pads_stay_out_of_the_router_losses():
    """Tokens of no sequence (a padded row's right padding, sequence parallelism's pad tokens) are routed but leave
    the load-balancing and z losses as they were without them: megatron's ``padding_mask`` from the micro-batch."""
    r = run_ranks(_router_losses_of_layouts, 1)[0]
    assert r["routed_copies_ratio"] == 1.0  # at EP 1 the experts receive exactly N k copies: balanced
    assert r["pad_counts"] == [0, 5, 3]  # 11 tokens: none, 5 to 16, and row 2's 3 right pads of [2, 7]
    for name, value in r["packed"].items():
        for layout in ("packed_pads", "padded"):
            assert r[layout][name] == pytest.approx(value, rel=1e-5), (layout, name)
        for layout in ("packed_pads_unmasked", "padded_unmasked"):  # the pads would move them
            assert r[layout][name] != pytest.approx(value, rel=1e-3), (layout, name)
