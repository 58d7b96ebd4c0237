"""HF -> megatron shards -> HF bit-exact, and log-prob parity with transformers, at every layout.

One 4-rank launch re-initializes megatron's parallel state for each (TP, PP, VPP) layout and each of
every tiny family (a layout using fewer than 4 ranks runs with DP > 1).
"""

from __future__ import annotations

import os

import torch

from modelspec import TokenBatch
from tests.dist import run_ranks

LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2), (2, 2, 2)]
NUM_SEQS, SEQ_LEN = 4, 24


def _convert_all(rank, world_size, model_dirs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel

    report = []
    for family, hf_dir in sorted(model_dirs.items()):
        reference_state = load_file(os.path.join(hf_dir, "model.safetensors")) if rank == 0 else None
        checkpoint_bytes = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
        input_ids, reference_logprobs = None, None
        for tp, pp, vpp in LAYOUTS:
            dims = initialize_model_parallel(tp=tp, pp=pp, vpp=vpp)
            config = ActorConfig(tp=tp, pp=pp, vpp=vpp, micro_batch_size=1 if vpp else 2)
            actor = Actor(hf_dir, config, dims, train=False)
            if input_ids is None:
                gen = torch.Generator().manual_seed(1)
                input_ids = torch.randint(0, actor.shape.vocab_size, (NUM_SEQS, SEQ_LEN), generator=gen)
            exported = actor.export_hf(dst=0)
            logprobs = actor.compute_logprobs(TokenBatch(input_ids=input_ids))
            bytes_loaded = torch.tensor([actor.num_bytes_loaded])
            torch.distributed.all_reduce(bytes_loaded, op=torch.distributed.ReduceOp.MAX)
            if rank != 0:
                continue
            if reference_logprobs is None:
                hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
                with torch.no_grad():
                    logits = hf_model(input_ids=input_ids).logits.float()
                reference_logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
            mismatched = sorted(
                n for n in reference_state if n not in exported or not torch.equal(exported[n], reference_state[n])
            )
            report.append(
                dict(
                    family=family,
                    layout=(tp, pp, vpp),
                    mismatched=mismatched,
                    extra=sorted(set(exported) - set(reference_state)),
                    max_abs_logprob_diff=float((logprobs - reference_logprobs).abs().max()),
                    max_rank_bytes_fraction=float(bytes_loaded) / checkpoint_bytes,
                )
            )
    return report


def test_roundtrip_bit_exact_and_logprob_parity_all_layouts(dense_model_dirs):
    report = run_ranks(_convert_all, 4, dense_model_dirs, timeout_s=600)[0]
    assert len(report) == len(LAYOUTS) * len(dense_model_dirs)  # every layout of every tiny family
    for row in report:
        assert not row["mismatched"] and not row["extra"], row
        assert row["max_abs_logprob_diff"] <= 1e-4, row
        tp, pp, _ = row["layout"]
        # streaming: a rank reads its slices only (embeddings/lm_head dominate the tiny models)
        if tp * pp == 4:
            assert row["max_rank_bytes_fraction"] < 0.45, row
    print("\n".join(f"{r['family']:6s} tp,pp,vpp={r['layout']} diff={r['max_abs_logprob_diff']:.2e}" for r in report))
