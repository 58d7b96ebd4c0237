"""`python -m tools.parity` (what `make parity` runs) launches its own ranks: one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_parity_cli_tp2_pp2_llama_tied_odd_vocab(tiny_model_dirs):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.parity", "--hf", tiny_model_dirs["llama"], "--tp", "2", "--pp", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert (result["tp"], result["pp"], result["model_type"]) == (2, 2, "llama")
    assert result["num_tokens"] > 0 and result["max_abs_logprob_diff"] <= 1e-4
