"""Reference results from transformers for the rollout tests (module level: importable by spawned ranks)."""

from __future__ import annotations

import torch

PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41], [1, 20, 30, 40, 50, 60, 70, 80, 90], [1, 77]]
MAX_NEW_TOKENS = 12


def hf_greedy(model_dir: str, prompts=PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS):
    """Per prompt: (transformers greedy generate tokens, their log-probs under transformers), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
            )
            tokens = tokens[0, len(prompt) :].tolist()
            out.append((tokens, hf_logprobs(model, prompt, tokens)))
    return out


def hf_logprobs(model, prompt, tokens, full: bool = False):
    """log p(tokens[k] | prompt + tokens[:k]) under the transformers model (or all log-probs if ``full``)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    if full:
        return logprobs
    return logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def max_abs_diff(a, b) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
