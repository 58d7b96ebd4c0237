"""The native rollout engine: plain torch, CPU or CUDA, tensor parallel with exactly vLLM's weight layout.

Its parts, each readable on its own:

- :mod:`~rollout.native.weights`: the parameters (vLLM's names and shapes, region ``weights``), HF loading;
- :mod:`~rollout.native.kv_cache`: the paged KV cache (region ``kv_cache``), its sizing and block allocator;
- :mod:`~rollout.native.model`: the forward (RoPE, RMSNorm, TP collectives), prefill and decode;
- :mod:`~rollout.native.decode_tp1`: the TP=1 fp32 decode layer loop under TorchScript;
- :mod:`~rollout.native.sampling`: greedy / temperature / top-k / top-p sampling, raw log-probs;
- :mod:`~rollout.native.scheduler`: continuous batching (admit, prefill, decode, retire);
- :mod:`~rollout.native.engine`: :class:`NativeEngine`, the rollout protocol over the parts.
"""

from rollout.native.engine import NativeEngine
from rollout.native.weights import iter_safetensors

__all__ = ["NativeEngine", "iter_safetensors"]
