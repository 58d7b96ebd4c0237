"""The bytes of tensors a stretch of code created and still references, at their widest moment.

On CPU a phase's RSS rise mixes two things: the tensors it allocates, which the plan counts, and what glibc's
heap does around them (small allocations faulting back pages a trim released, freed blocks that stay
resident until the next trim), which no library reports. CUDA's caching allocator separates them
(``max_memory_allocated`` against the device's use); on CPU nothing does. This count does, by construction:
every aten op's new storages are counted once, from the op that made them until their last tensor is
collected (views share their base's storage; storages made before the count, or handed in, are not counted).
It sees the ops of the thread that entered it, and tensors made outside the dispatcher (a C++ extension's
own buffers) are not counted.

It is slow (a weak reference per tensor an op returns): ``trainer.count_tensors`` turns it on for every phase
of a run (telemetry/memory_timeline.py, the ``tensor_peak`` column); tests/test_local_layer_count.py uses it
for the planner's per-op counts.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as live: ...``; then ``live.peak``: the most bytes of storages made inside and
    referenced at once; ``live.now``: those still referenced."""

    def __init__(self):
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors referencing it]

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for tensor in (o for o in tree_flatten(out)[0] if torch.is_tensor(o)):
            key = tensor.untyped_storage().data_ptr()
            if key == 0 or (key not in self._live and key in inputs):
                continue  # empty, or an in-place result or view of a storage from before the count
            entry = self._live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self.now += entry[0]
            entry[1] += 1
            weakref.finalize(tensor, self._release, key)
        self.peak = max(self.peak, self.now)
        return out
