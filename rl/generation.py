"""The rollout phase across engine replicas: replica i generates prompts i, i + R, ...; every rank
then holds every sample (the TP ranks of one replica hold identical ones), ordered by prompt so that
the samples of one prompt are adjacent (GRPO groups)."""

from __future__ import annotations

import torch.distributed as dist

from modelspec import ColocatedMesh
from rl.batching import Sample
from rl.data import Problem
from rollout import RolloutEngine, SamplingParams


def sampling_seed(base_seed: int, step: int, replica: int) -> int:
    """Different every step and on every replica, the same on the TP ranks of one replica (they must
    sample identical tokens), and a pure function of (seed, step, replica) so a resumed run repeats it."""
    return (base_seed * 1_000_003 + step * 10_007 + replica) % (2**31 - 1)


def generate_samples(
    engine: RolloutEngine,
    tokenizer,
    task,
    problems: list[Problem],
    params: SamplingParams,
    mesh: ColocatedMesh,
    rank: int,
) -> list[Sample]:
    """Generate this replica's prompts, score them, and gather every replica's samples on every rank."""
    replica = mesh.replica(rank)
    mine = mesh.prompts_of_replica(replica, len(problems))
    prompt_ids = [tokenizer(problems[i].prompt).input_ids for i in mine]
    # every rank calls generate, with no prompts when its replica has none: vLLM's data-parallel replicas
    # synchronise at every engine step, so a replica left out would hang the others
    completions = engine.generate(prompt_ids, params)
    local = []
    for index, prompt, per_prompt in zip(mine, prompt_ids, completions):
        for c in per_prompt:
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            reward = task.reward(text, problems[index].answer)
            sample = Sample(index, prompt, list(c.token_ids), list(c.logprobs), c.finish_reason, reward, c.routed_experts)
            local.append(sample)
    gathered: list = [None] * mesh.world_size
    dist.all_gather_object(gathered, (replica, local))
    by_replica = dict(gathered)  # TP ranks of one replica hold identical samples
    samples = [s for r in sorted(by_replica) for s in by_replica[r]]
    samples.sort(key=lambda s: s.problem_index)
    return samples
