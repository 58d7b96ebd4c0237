"""Continuous batching for the native engine: admit, prefill, decode, retire.

Each sample of each prompt is one sequence. Waiting sequences are admitted FIFO while ``max_num_seqs``,
``max_num_batched_tokens`` (the padded prompt tokens of one prefill batch: admitted x longest prompt)
and free KV blocks allow; a sequence reserves the blocks for prompt + max_tokens when admitted. A
prompt is never split (no chunked prefill): one longer than the budget is prefilled alone.
Admitted sequences are prefilled together, then every running sequence decodes one token per step in
one batched forward. A sequence finishes on a stop token, at max_tokens, or when its context is full;
it frees its blocks at once and waiting sequences take them at the next step.

With ``SamplingParams.return_routed_experts`` (MoE models) the model logs each forward's routing
(``NativeModel.routing_log``): a prefill's for each admitted prompt, a decode step's for each running row
(the token it feeds: the one sampled before), so a finished sequence's ``Completion.routed_experts`` covers
its prompt and every sampled token but the last, the tokens the actor's forward routes for the same targets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.engine import Completion, SamplingParams
from rollout.native.kv_cache import KVCache
from rollout.native.model import NativeModel
from rollout.native.sampling import Sampler


@dataclass
class SequenceState:
    """One running sample: whose it is and the KV blocks it holds."""

    prompt_index: int
    sample_index: int
    blocks: list[int]
    prompt_routing: torch.Tensor | None = None  # [num_moe_layers, prompt_len, top_k] (routed experts returned)


@dataclass
class FinishedSequence:
    seq: SequenceState
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    routed_experts: torch.Tensor | None = None  # [num_moe_layers, prompt_len + len(token_ids) - 1, top_k]


class RunningBatch:
    """The running sequences, one row each: their states and the device tensors a decode step reads and
    writes. :meth:`add`, :meth:`advance` and :meth:`retire` keep them all row-aligned."""

    ROW_TENSORS = (
        "block_table", "slot_table", "limits", "ctx_lens", "last", "out_tokens", "out_logprobs", "gen_lens",
        "out_experts",
    )  # fmt: skip

    def __init__(
        self,
        width: int,
        block_size: int,
        max_tokens: int,
        max_rows: int,
        device: torch.device,
        routing_shape: tuple[int, int] = (0, 0),
    ) -> None:
        """``routing_shape``: (MoE layers, top-k) of the routing recorded per decoded token ((0, 0): none)."""
        self.device, self.max_tokens, self.routing_shape = device, max_tokens, routing_shape
        self.seqs: list[SequenceState] = []
        long = dict(dtype=torch.long, device=device)
        self.block_table = torch.zeros((0, width), **long)  # [B, width]: each sequence's blocks
        self.slot_table = torch.zeros((0, width * block_size), **long)  # [B, width * bs]: slot of each position
        self.limits = torch.zeros(0, **long)  # [B]: most tokens it may generate
        self.ctx_lens = torch.zeros(0, **long)  # [B]: tokens in the cache
        self.last = torch.zeros(0, **long)  # [B]: newest token (not cached yet)
        self.out_tokens = torch.zeros((0, max_tokens), **long)  # [B, max_tokens]
        self.out_logprobs = torch.zeros((0, max_tokens), dtype=torch.float32, device=device)
        self.gen_lens = torch.zeros(0, **long)  # [B]: tokens generated so far
        # [B, max_tokens, num_moe_layers, top_k]: the experts out_tokens[:, t] was routed to when decoded
        self.out_experts = torch.zeros((0, max_tokens, *routing_shape), dtype=torch.int16, device=device)
        self._rows = torch.arange(max_rows, device=device)

    def add(
        self,
        seqs: list[SequenceState],
        block_table: torch.Tensor,
        slot_table: torch.Tensor,
        ctx_lens: list[int],
        limits: list[int],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
    ) -> None:
        """Freshly prefilled sequences with their first sampled token and its log-prob."""
        num_new = len(seqs)
        self.seqs += seqs
        self.block_table = torch.cat([self.block_table, block_table])
        self.slot_table = torch.cat([self.slot_table, slot_table])
        self.limits = torch.cat([self.limits, torch.tensor(limits, device=self.device)])
        self.ctx_lens = torch.cat([self.ctx_lens, torch.tensor(ctx_lens, device=self.device)])
        self.last = torch.cat([self.last, tokens])
        new_out = torch.zeros((num_new, self.max_tokens), dtype=torch.long, device=self.device)
        new_out[:, 0] = tokens
        new_lp = torch.zeros((num_new, self.max_tokens), dtype=torch.float32, device=self.device)
        new_lp[:, 0] = logprobs
        self.out_tokens = torch.cat([self.out_tokens, new_out])
        self.out_logprobs = torch.cat([self.out_logprobs, new_lp])
        self.gen_lens = torch.cat([self.gen_lens, torch.ones(num_new, dtype=torch.long, device=self.device)])
        new_experts = torch.zeros(
            (num_new, self.max_tokens, *self.routing_shape), dtype=torch.int16, device=self.device
        )
        self.out_experts = torch.cat([self.out_experts, new_experts])

    def advance(self, tokens: torch.Tensor, logprobs: torch.Tensor, routed: torch.Tensor | None = None) -> None:
        """Every row decoded one more token (its previous one is now cached); ``routed`` [B, num_moe_layers,
        top_k]: the experts that previous token (``last``) was routed to."""
        rows = self._rows[: len(self.seqs)]
        if routed is not None:
            self.out_experts[rows, self.gen_lens - 1] = routed.to(torch.int16)
        self.out_tokens[rows, self.gen_lens] = tokens
        self.out_logprobs[rows, self.gen_lens] = logprobs
        self.ctx_lens = self.ctx_lens + 1
        self.gen_lens = self.gen_lens + 1
        self.last = tokens

    def retire(self, stop: torch.Tensor) -> list[FinishedSequence]:
        """Remove and return the rows that sampled a stop token or reached their limit."""
        stopped = torch.isin(self.last, stop)
        done = stopped | (self.gen_lens >= self.limits)
        if not bool(done.any()):
            return []
        stopped_list, lens_list = stopped.tolist(), self.gen_lens.tolist()
        finished = [
            FinishedSequence(
                self.seqs[r],
                self.out_tokens[r, : lens_list[r]].tolist(),
                self.out_logprobs[r, : lens_list[r]].tolist(),
                "stop" if stopped_list[r] else "length",
                self._routed_experts(r, lens_list[r]),
            )
            for r in done.nonzero().squeeze(1).tolist()
        ]
        keep = (~done).nonzero().squeeze(1)
        self.seqs = [self.seqs[r] for r in keep.tolist()]
        for name in self.ROW_TENSORS:
            setattr(self, name, getattr(self, name)[keep])
        return finished

    def _routed_experts(self, row: int, num_generated: int) -> torch.Tensor | None:
        """[num_moe_layers, prompt_len + num_generated - 1, top_k]: the prompt's routing, then that of every
        generated token that was fed back (all but the last)."""
        prompt = self.seqs[row].prompt_routing
        if prompt is None:
            return None
        decoded = self.out_experts[row, : num_generated - 1].permute(1, 0, 2)  # [layers, generated - 1, k]
        return torch.cat([prompt.cpu(), decoded.cpu()], dim=1)  # the prompt's is on the host, decode's on the device


class Scheduler:
    """Runs one ``generate`` call's sequences through ``model`` within ``kv_cache`` (see the module doc)."""

    def __init__(
        self,
        model: NativeModel,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_id: int | None,
        device: torch.device,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id, self.device = eos_token_id, device
        self.max_running_seen = 0  # most sequences decoded together (continuous-batching stats)
        self.max_prefill_tokens_seen = 0  # largest prefill batch, padded tokens

    def _stop_tokens(self, params: SamplingParams) -> torch.Tensor:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        return torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)

    def _admit(
        self, waiting: deque, prompts: Sequence[Sequence[int]], params: SamplingParams, num_running: int
    ) -> list[SequenceState]:
        """Waiting (prompt, sample) pairs, FIFO, while max_num_seqs, max_num_batched_tokens and free blocks allow."""
        kv, admitted, longest = self.kv_cache, [], 0
        while waiting and num_running + len(admitted) < self.max_num_seqs:
            i, j = waiting[0]
            longest_with = max(longest, len(prompts[i]))
            budget = self.max_num_batched_tokens
            if budget is not None and admitted and (len(admitted) + 1) * longest_with > budget:
                break
            longest = longest_with
            need = kv.blocks_for(min(len(prompts[i]) + params.max_tokens, self.max_model_len))
            if need > kv.allocator.num_free:
                if not num_running and not admitted:
                    raise RuntimeError(f"KV cache of {kv.num_blocks} blocks cannot hold one sequence ({need})")
                break
            waiting.popleft()
            admitted.append(SequenceState(i, j, kv.allocator.allocate(need)))
        return admitted

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, sample: Sampler) -> list[list[Completion]]:
        """prompts (token ids) -> per prompt, ``params.n`` completions in sample order."""
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            if not 0 < len(prompt) < self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; it must have 1..{self.max_model_len - 1}")
        kv, stop = self.kv_cache, self._stop_tokens(params)
        results = [[Completion(i, j) for j in range(params.n)] for i in range(len(prompts))]
        waiting = deque((i, j) for i in range(len(prompts)) for j in range(params.n))
        width = kv.blocks_for(min(max(len(p) for p in prompts) + params.max_tokens, self.max_model_len))
        shape = self.model.shape
        record = params.return_routed_experts
        if record and not shape.is_moe:
            raise ValueError(f"return_routed_experts: {shape.source or 'this model'} has no MoE layers to route")
        routing_shape = (len(shape.moe_layers), shape.moe_top_k) if record else (0, 0)
        batch = RunningBatch(width, kv.block_size, params.max_tokens, self.max_num_seqs, self.device, routing_shape)
        while waiting or batch.seqs:
            admitted = self._admit(waiting, prompts, params, len(batch.seqs)) if waiting else []
            if admitted:
                table = torch.zeros((len(admitted), width), dtype=torch.long, device=self.device)
                for b, seq in enumerate(admitted):
                    table[b, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.long)
                prefill_prompts = [list(prompts[s.prompt_index]) for s in admitted]
                padded_tokens = len(prefill_prompts) * max(len(p) for p in prefill_prompts)
                self.max_prefill_tokens_seen = max(self.max_prefill_tokens_seen, padded_tokens)
                self.model.routing_log = [] if record else None
                logits = self.model.prefill(prefill_prompts, table)
                tokens, logprobs = sample(logits)
                prompt_lens = [len(prompts[s.prompt_index]) for s in admitted]
                if record:  # the log's rows: [B * longest prompt] (padded) per MoE layer
                    routed = self._take_routing_log()  # [layers, B * longest, k]
                    routed = routed.view(routed.shape[0], len(admitted), -1, routed.shape[-1])  # [layers, B, L, k]
                    for b, (seq, n) in enumerate(zip(admitted, prompt_lens)):
                        seq.prompt_routing = routed[:, b, :n].to(torch.int16).cpu()
                limits = [min(params.max_tokens, self.max_model_len - n) for n in prompt_lens]
                batch.add(admitted, table, kv.slot_table(table), prompt_lens, limits, tokens, logprobs)
            else:
                self.max_running_seen = max(self.max_running_seen, len(batch.seqs))
                self.model.routing_log = [] if record else None
                logits = self.model.decode(batch.last, batch.ctx_lens, batch.block_table, batch.slot_table)
                routed = self._take_routing_log().transpose(0, 1) if record else None  # [B, layers, k]
                batch.advance(*sample(logits), routed)
            for done in batch.retire(stop):
                c = results[done.seq.prompt_index][done.seq.sample_index]
                c.token_ids, c.logprobs, c.finish_reason = done.token_ids, done.logprobs, done.finish_reason
                c.routed_experts = done.routed_experts
                kv.allocator.free(done.seq.blocks)
        self.model.routing_log = None
        return results

    def _take_routing_log(self) -> torch.Tensor:
        """The last forward's routing [num_moe_layers, N, top_k] (layers in model order); empties the log."""
        log, self.model.routing_log = self.model.routing_log, []
        return torch.stack([top_ids for _, top_ids in sorted(log, key=lambda entry: entry[0])])
