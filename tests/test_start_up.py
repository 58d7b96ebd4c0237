"""What a process pays to start: a run's launcher never imports megatron-core, and importing megatron-core through
``megatron_backend`` does not import torch's compiler (megatron's ``jit_fuser`` compiles at a fused function's
first call instead of at its decoration). Each check runs in a fresh interpreter: ``sys.modules`` of this one has
everything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _fresh(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_core_imports_without_torchs_compiler_and_its_fused_functions_still_compile():
    seen = _fresh(
        """
import json, sys
import megatron_backend, megatron.core
from megatron.core import jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
before = [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]
import torch
double = megatron_backend._compile_at_first_call(backend="eager")(lambda x: 2 * x)
not_yet = "torch._dynamo" in sys.modules
out = double(torch.arange(3.0)).tolist()
print(json.dumps(dict(before=before, not_yet=not_yet, after="torch._dynamo" in sys.modules, out=out,
                      fuser=jit.jit_fuser.__name__, wrapped=bias_gelu.__wrapped__.__name__)))
"""
    )
    assert seen["before"] == [] and seen["fuser"] == "_compile_at_first_call"
    assert seen["wrapped"] == "bias_gelu"  # the decorated function is megatron's own, unchanged
    # the compile happens at the first call, through torch.compile itself
    assert not seen["not_yet"] and seen["after"] and seen["out"] == [0.0, 2.0, 4.0]


def test_the_launcher_hands_its_ranks_the_run_without_importing_megatron_core(tmp_path):
    seen = _fresh(
        f"""
import json, sys
import run.main
calls = []
def spawn_local(fn, world_size, args=(), environ=None):
    calls.append(dict(fn=fn.__name__, world_size=world_size, megatron="megatron.core" in sys.modules,
                      loop="run.loop" in sys.modules))
    return 0
run.main.spawn_local = spawn_local
code = run.main.main(["--exp", "tiny_cpu", "--run-dir", {str(tmp_path / "run")!r}, "trainer.steps=1"])
print(json.dumps(dict(code=code, calls=calls)))
"""
    )
    assert seen["code"] == 0
    assert seen["calls"] == [dict(fn="local_rank", world_size=2, megatron=False, loop=False)]
