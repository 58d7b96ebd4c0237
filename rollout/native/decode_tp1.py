"""The decoder layers of one TP=1 fp32 decode step as one TorchScript function.

On 2 CPU cores the per-kernel Python overhead is about half of a tiny model's decode step, so the layer
loop of :meth:`rollout.native.model.NativeModel.decode` is written once more here, argument by argument,
for TorchScript to run without Python between kernels. Same math as the eager path, op for op.
"""

from __future__ import annotations

import torch


def decode_layers_tp1(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm1: list[torch.Tensor],
    qkv_w: list[torch.Tensor],
    qkv_b: list[torch.Tensor],
    qk_norm: list[torch.Tensor],
    o_w_t: list[torch.Tensor],
    norm2: list[torch.Tensor],
    gate_up_w: list[torch.Tensor],
    down_w_t: list[torch.Tensor],
    token_rows: list[torch.Tensor],
    block_rows: list[torch.Tensor],
    new_rows: torch.Tensor,
    ctx_block_rows: torch.Tensor,
    mask: torch.Tensor,
    eps_hidden: torch.Tensor,
    eps_head: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    span: int,
    scale: float,
) -> torch.Tensor:
    """The decoder layers of one decode step at TP=1 in fp32: the same math as ``NativeModel.forward`` with
    the decode ``attend``, written once more so TorchScript can run it without Python between kernels (on
    2 CPU cores the per-kernel Python overhead is about half of a tiny model's step). x [B, h] -> [B, h].
    Empty ``qkv_b`` / ``qk_norm`` lists mean no bias / no q-k norms; norm weights are pre-scaled (see ``rms_norm``).
    """
    num, d, kv = x.shape[0], head_dim, num_kv_heads
    group = num_heads // kv
    for i in range(len(norm1)):
        h = x.div(torch.hypot(torch.linalg.vector_norm(x, 2, [-1], True), eps_hidden)).mul_(norm1[i])
        if len(qkv_b) > 0:
            qkv = torch.addmm(qkv_b[i], h, qkv_w[i].t())
        else:
            qkv = torch.mm(h, qkv_w[i].t())
        qk, v = qkv.view(num, num_heads + 2 * kv, d).split_with_sizes([num_heads + kv, kv], 1)
        if len(qk_norm) > 0:
            qk = qk.div(torch.hypot(torch.linalg.vector_norm(qk, 2, [-1], True), eps_head)).mul_(qk_norm[i])
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        q, k = qk.split_with_sizes([num_heads, kv], 1)
        token_rows[i].index_copy_(0, new_rows, torch.stack((k, v)).view(2 * num * kv, d))
        ctx = block_rows[i].index_select(0, ctx_block_rows).view(2, num * kv, span, d)
        probs = torch.baddbmm(mask, q.reshape(num * kv, group, d), ctx[0].transpose(1, 2), beta=1.0, alpha=scale)
        x = torch.addmm(x, torch.bmm(probs.softmax(-1), ctx[1]).view(num, -1), o_w_t[i])
        h = x.div(torch.hypot(torch.linalg.vector_norm(x, 2, [-1], True), eps_hidden)).mul_(norm2[i])
        gate, up = torch.mm(h, gate_up_w[i].t()).chunk(2, -1)
        x = torch.addmm(x, torch.nn.functional.silu(gate) * up, down_w_t[i])
    return x


_SCRIPTED: dict[str, object] = {}


def scripted_decode_layers():
    """``decode_layers_tp1`` under TorchScript (compiled once per process), or the plain function if that fails."""
    if "fn" not in _SCRIPTED:
        try:
            _SCRIPTED["fn"] = torch.jit.script(decode_layers_tp1)
        except Exception:  # noqa: BLE001 - TorchScript is optional: the eager function is the same math
            _SCRIPTED["fn"] = decode_layers_tp1
    return _SCRIPTED["fn"]


def first_use(
    hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, num_seqs: int
) -> None:
    """Compile :func:`scripted_decode_layers` and run it as a decode does (TorchScript's profiling executor
    specializes on the first call and optimizes on the next ones), on one throw-away fp32 layer at the
    model's sizes over ``num_seqs`` sequences, so what TorchScript keeps per process (the compiled and
    optimized graphs, their executor state) is paid before the run's launch measurement (run/setup.py), not
    in the first rollout."""
    h, d, kv, ffn = hidden_size, head_dim, num_kv_heads, intermediate_size
    fn = scripted_decode_layers()
    for span in (4, 8, 12):  # a decode's context grows: more than one shape, as the executor sees in a rollout
        rows = 2 * num_seqs * kv
        token_rows = torch.zeros(rows * span, d)  # [slots, d]: one block of ``span`` slots per (seq, kv head, k/v)
        fn(
            torch.zeros(num_seqs, h),  # x [B, h]
            torch.ones(num_seqs, 1, d),  # cos [B, 1, d]
            torch.zeros(num_seqs, 1, d),  # sin [B, 1, d]
            [torch.ones(h)],
            [torch.zeros((num_heads + 2 * kv) * d, h)],
            [],
            [],
            [torch.zeros(num_heads * d, h)],
            [torch.ones(h)],
            [torch.zeros(2 * ffn, h)],
            [torch.zeros(ffn, h)],
            [token_rows],
            [token_rows.view(rows, span * d)],  # [blocks, span * d]
            torch.arange(rows) * span,  # new_rows [2*B*kv]
            torch.arange(rows),  # ctx_block_rows [2*B*kv]
            torch.zeros(num_seqs * kv, 1, span),  # additive mask [B*kv, 1, span]
            torch.tensor(1e-3),
            torch.tensor(1e-3),
            num_heads,
            kv,
            d,
            span,
            1.0 / d**0.5,
        )
