"""The planner's count of the native engine's rollout working set (planner/sizes.py ``native_prefill_bytes``,
``native_decode_bytes``) against the tensors its forward really holds, byte for byte: every prefill and decode
call of a generate measured with telemetry.live_tensors.LiveTensorBytes, at TP 1 (TorchScript decode in fp32,
eager in bf16, Qwen3's q / k norms) and TP 2 (eager, all-reduces and the vocab all-gather)."""

from __future__ import annotations

import pytest

from tests.dist import run_ranks


def _measured_peaks(
    model_dir: str, dtype: str, seqs: int, prompt_tokens: int, max_tokens: int, tp: int = 1, group=None
):
    """(prefill peak, decode peak, shape, block size): the most live-tensor bytes of any prefill / decode call of
    one generate of ``seqs`` prompts of ``prompt_tokens`` tokens, ``max_tokens`` each (after a first generate)."""
    from configs.rollout import RolloutConfig
    from rollout import make_engine
    from rollout.engine import SamplingParams
    from telemetry.live_tensors import LiveTensorBytes

    cfg = RolloutConfig(tp=tp, cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=seqs)
    engine = make_engine(cfg, model_dir, group=group, device="cpu", dtype=dtype)
    prompts = [[(7 * i + j) % 50 + 3 for j in range(prompt_tokens)] for i in range(seqs)]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # first use: TorchScript's specialisation, lazy caches
    model, peaks = engine.model, {"prefill": 0, "decode": 0}

    def measured(kind, call):
        def wrapper(*args):
            with LiveTensorBytes() as live:
                out = call(*args)
            peaks[kind] = max(peaks[kind], live.peak)
            return out

        return wrapper

    model.prefill, model.decode = measured("prefill", model.prefill), measured("decode", model.decode)
    engine.generate(prompts, params)
    return peaks["prefill"], peaks["decode"], engine.shape, engine.kv_cache.block_size


def _counted(shape, tp: int, dtype: str, seqs: int, prompt_tokens: int, max_tokens: int, block_size: int):
    from planner.sizes import native_decode_bytes, native_prefill_bytes

    e = 4 if dtype == "float32" else 2
    scripted = tp == 1 and e == 4 and not shape.is_moe
    prefill = native_prefill_bytes(shape, tp, e, seqs=seqs, prompt_tokens=prompt_tokens, moe_bytes_per_token=0)
    decode = native_decode_bytes(
        shape,
        tp,
        e,
        seqs=seqs,
        context_tokens=prompt_tokens + max_tokens - 2,
        block_size=block_size,
        scripted=scripted,
        moe_bytes_per_token=0,
    )
    return prefill, decode


@pytest.mark.parametrize(
    "family,dtype,seqs,prompt_tokens,max_tokens",
    [
        ("qwen2", "float32", 8, 12, 30),  # TorchScript decode; the prefill's MLP moment binds
        ("llama", "float32", 4, 40, 100),  # longer prompts (the [B, L, L] mask) and contexts
        ("qwen3", "bfloat16", 16, 5, 20),  # eager decode; the q / k norm's fp32 copies bind the prefill
        ("phi3", "bfloat16", 6, 20, 40),
    ],
)
def test_the_native_engine_forward_is_counted_byte_for_byte(
    tiny_model_dirs, family, dtype, seqs, prompt_tokens, max_tokens
):
    prefill, decode, shape, block_size = _measured_peaks(
        tiny_model_dirs[family], dtype, seqs, prompt_tokens, max_tokens
    )
    assert (prefill, decode) == _counted(shape, 1, dtype, seqs, prompt_tokens, max_tokens, block_size)


def _tp_rank(rank: int, world_size: int, model_dir: str, case: tuple):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    return _measured_peaks(model_dir, *case, tp=world_size, group=group)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_the_native_engine_forward_is_counted_at_tp2(tiny_model_dirs, family):
    """At TP 2 the plan counts the previous block's all-reduced [N, h] as held (NCCL's watchdog keeps it:
    sizes.native_retained_all_reduce_bytes); on CPU the engine waits for gloo's thread to let go of it
    (model._collective), so each peak is the count less that tensor, every time."""
    from planner.sizes import native_retained_all_reduce_bytes

    case = ("float32", 8, 12, 30)
    seqs, prompt_tokens = case[1], case[2]
    for prefill, decode, shape, block_size in run_ranks(_tp_rank, 2, tiny_model_dirs[family], case):
        counted_prefill, counted_decode = _counted(shape, 2, *case, block_size)
        per_token = native_retained_all_reduce_bytes(shape, 2, 4)
        assert per_token > 0
        assert (prefill, decode) == (
            counted_prefill - seqs * prompt_tokens * per_token,
            counted_decode - seqs * per_token,
        )


def _freed_late(rank: int, world_size: int, calls: int, wait: bool) -> int:
    """How many of ``calls`` all-reduced tensors outlive this thread's last reference to them."""
    import weakref
    from functools import partial

    import torch
    import torch.distributed as dist

    from rollout.native.model import _collective

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    late = 0
    for _ in range(calls):
        x, freed = torch.ones(256), []
        weakref.finalize(x, freed.append, True)
        if wait:
            _collective(partial(dist.all_reduce, x), x)
        else:
            dist.all_reduce(x)
        del x
        late += not freed
    return late


def test_a_collective_returns_once_gloo_has_let_go_of_its_tensors():
    """The precondition of the exact TP 2 count above: after ``_collective`` the engine's own reference is the
    last, so a tensor is freed when the engine drops it, on the engine's thread. Without the wait gloo's worker
    thread holds a tensor past the call's return on a good share of calls (about 30% measured on 2 ranks); a
    wait on the use count alone misses the tensor's strong reference to its Python object, which that thread
    drops a step later (0.3-2% of calls measured)."""
    assert run_ranks(_freed_late, 2, 2000, True) == [0, 0]
    assert min(run_ranks(_freed_late, 2, 2000, False)) > 0  # the race this guards against is real here
