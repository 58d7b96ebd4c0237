"""What a run's launcher pays to start: it never imports megatron-core (its ranks do, at once), nor
torch.distributed.checkpoint (only a resume's dtype check reads one). The check runs in a fresh interpreter:
``sys.modules`` of this one has everything."""

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


def test_the_launcher_hands_its_ranks_the_run_without_importing_megatron_core(tmp_path):
    seen = _fresh(
        f"""
import json, sys
import run.main
calls = []
def spawn_local(fn, world_size, args=(), environ=None):
    calls.append(dict(fn=fn.__name__, world_size=world_size, megatron="megatron.core" in sys.modules,
                      loop="run.loop" in sys.modules, dcp="torch.distributed.checkpoint" in sys.modules))
    return 0
run.main.spawn_local = spawn_local
code = run.main.main(["--exp", "tiny_cpu", "--run-dir", {str(tmp_path / "run")!r}, "trainer.steps=1"])
print(json.dumps(dict(code=code, calls=calls)))
"""
    )
    assert seen["code"] == 0
    assert seen["calls"] == [dict(fn="local_rank", world_size=2, megatron=False, loop=False, dcp=False)]
