"""Everything that touches megatron-core and ``parallel_state`` lives in this package.

- ``layout``: pure HF <-> megatron TP/PP/VPP weight layout (slice pieces per rank; no megatron import).
- ``checkpoint``: streaming HF safetensors -> shards loader, shards -> HF exporter (uses ``layout``).
- ``model`` / ``parallel`` / ``cpu_compat``: GPTModel from a HF config, process groups, CPU shims.
- ``logprobs``: log-probs and chunked entropy from vocab-parallel logits (no full-vocab gather).
- ``memory``: the per-tag byte ledger (actor_params, actor_grads, optimizer) and the offloader.
- ``actor``: the :class:`~megatron_backend.actor.Actor` the RL loop holds, a composition of ``actor_model``
  (building, forward passes, log-probs), ``actor_train`` (optimizer, train step and its guard) and
  ``actor_offload`` (the states moved to host and back).
- ``hf_export`` / ``dist_checkpoint``: the actor's weights as a HF directory, megatron's distributed checkpoint.
- ``packing``: sequence packing into micro-batches.

``make parity`` and ``make bench-entropy`` are ``tools/parity.py`` and ``tools/bench_entropy.py``.
"""
