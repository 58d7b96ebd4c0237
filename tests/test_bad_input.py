"""Bad input never starts heavy work: each case below makes ``python -m run.main`` print one line that names
the key or file and the fix, and exit 2, before any rank process exists (spawning is made to fail here)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import run.main
from run.main import main

REPO = Path(__file__).resolve().parent.parent


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: Path, **changes) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def _missing_shard(tiny, tmp):
    (_copy(tiny["qwen2"], tmp / "m") / "model.safetensors").unlink()
    return [f"model.path={tmp / 'm'}"]


def _truncated_shard(tiny, tmp):
    shard = _copy(tiny["qwen2"], tmp / "m") / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return [f"model.path={tmp / 'm'}"]


def _missing_indexed_shard(tiny, tmp):
    """A sharded checkpoint whose index names a file that is not there."""
    model = _copy(tiny["qwen2"], tmp / "m")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(model / "model-00001-of-00002.safetensors"), framework="pt") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return [f"model.path={model}"]


def _unsupported_architecture(tiny, tmp):
    return [f"model.path={_edit_config(_copy(tiny['qwen2'], tmp / 'm'), model_type='gpt2')}"]


def _vocab_too_small_for_tokenizer(tiny, tmp):
    return [f"model.path={_edit_config(_copy(tiny['qwen2'], tmp / 'm'), vocab_size=64)}"]


def _weights_of_another_model(tiny, tmp):
    return [f"model.path={_edit_config(_copy(tiny['qwen2'], tmp / 'm'), intermediate_size=96)}"]


def _no_tokenizer(tiny, tmp):
    model = _copy(tiny["qwen2"], tmp / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    return [f"model.path={model}"]


def _rollout_tp_vs_kv_heads(tiny, tmp):
    # 12 heads, 8 KV heads: rollout.tp=6 divides the heads but neither divides nor is a multiple of the KV heads
    model = tmp / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            dict(
                model_type="qwen2",
                hidden_size=96,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=12,
                num_key_value_heads=8,
                vocab_size=128,
                max_position_embeddings=64,
            )
        )
    )
    return [f"model.path={model}", "rollout.tp=6", "actor.tp=2", "cluster.procs_per_node=6"]


def _not_a_checkpoint(tiny, tmp):
    (tmp / "ckpt").mkdir()
    return [f"resume={tmp / 'ckpt'}"]


def _never_over_checkpoints(tiny, tmp):
    checkpoint = tmp / "run" / "checkpoints" / "step_00000003"
    (checkpoint / "actor").mkdir(parents=True)
    (checkpoint / "actor" / "metadata.json").write_text("{}")
    (checkpoint / "rl_state.json").write_text("{}")
    return ["--run-dir", str(tmp / "run"), "resume=never"]


def _float32_checkpoint_into_bfloat16(tiny, tmp):
    """A float32 run's checkpoint resumed with model.dtype=bfloat16: megatron's load would fail late, on the
    16-bit optimizer's fp32 main params the checkpoint lacks. The actor's part written as megatron's torch_dist
    writes it (torch.distributed.checkpoint), one model tensor is enough for its metadata."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter, save

    from checkpointing.checkpoint import ACTOR_DIR, STATE_FILE, RLState, model_sizes
    from rl.generation import sampling_seed
    from run.compose import compose

    model = f"model.path={tiny['qwen2']}"
    checkpoint = tmp / "run" / "checkpoints" / "step_00000002"
    weight = {"embedding.word_embeddings.weight": torch.zeros(4, 4, dtype=torch.float32)}
    save(weight, storage_writer=FileSystemWriter(str(checkpoint / ACTOR_DIR)), no_dist=True)
    (checkpoint / ACTOR_DIR / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    state = RLState(
        completed_steps=2, sampling_seed=1, next_sampling_seeds=[sampling_seed(1, 2, 0)], data_num_prompts_drawn=0,
        wandb_run_id=None, wandb_step=0, world_size=2, layout={}, exp="tiny_cpu",
        model=model_sizes(compose("tiny_cpu", [model]).model.shape()),
    )  # fmt: skip
    (checkpoint / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state)))
    return ["--run-dir", str(tmp / "run"), model, "model.dtype=bfloat16", "resume=auto"]


GSM8K = ["data.task=gsm8k", "trainer.sft_warmup_steps=0"]
GOOD_LINE = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"}


def _jsonl_with_a_truncated_line(tiny, tmp):
    """An editor or a killed `head > file` left line 2 cut in the middle of a string."""
    line = json.dumps(GOOD_LINE)
    (tmp / "train.jsonl").write_text(f"{line}\n{line[: len(line) // 2]}\n{line}\n")
    return [*GSM8K, f"data.path={tmp / 'train.jsonl'}"]


def _jsonl_with_another_schema(tiny, tmp):
    """A file of another dataset (prompt/response, not question/answer) on line 3."""
    other = json.dumps({"prompt": "2+2=", "response": "4"})
    (tmp / "train.jsonl").write_text(f"{json.dumps(GOOD_LINE)}\n\n{other}\n")
    return [*GSM8K, f"data.path={tmp / 'train.jsonl'}"]


def _nan_in_a_weight(tiny, tmp):
    """A checkpoint saved after a diverged step: one NaN in one MLP weight."""
    from safetensors.torch import load_file, save_file

    model = _copy(tiny["qwen2"], tmp / "m")
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return [f"model.path={model}"]


def _yarn_added_to_a_transformers5_config(tiny, tmp):
    """Qwen2.5's model card: add rope_scaling yarn for long context, here to a config.json transformers 5
    wrote (it has rope_parameters): transformers applies YaRN, so the run must not train default RoPE."""
    model = _copy(tiny["qwen2"], tmp / "m")
    assert "rope_parameters" in json.loads((model / "config.json").read_text())
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    return [f"model.path={_edit_config(model, rope_scaling=yarn)}"]


_LIVE_RUNS = []  # the lock files the "other run" holds, open until the test session ends


def _run_dir_of_a_live_run(tiny, tmp):
    """`make run ARGS="--run-dir X"` typed again in a second terminal while the first run still writes to X
    (its launcher holds X/.lock as hold_run_dir gives it; a second open file description conflicts)."""
    from run.preflight import hold_run_dir

    _LIVE_RUNS.append(hold_run_dir(tmp / "run"))
    return ["--run-dir", str(tmp / "run")]


def _vllm_not_installed(tiny, tmp, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed (find_spec then fails)
    return ["rollout.engine=vllm"]


# (case, overrides or a function(tiny dirs, tmp path[, monkeypatch]) -> overrides, text the line must contain)
CASES = [
    ("tp does not divide world", ["actor.tp=3"], "actor.tp=3 x actor.pp=1 does not divide the world size 2"),
    ("world not a multiple of tp x pp", ["cluster.procs_per_node=3"], "does not divide the world size 3"),
    ("tp x pp x dp != world", ["actor.dp=2"], "set actor.dp=1 or actor.dp=null"),
    ("heads vs actor tp", ["actor.tp=4", "cluster.procs_per_node=4"], "actor.tp=4 must divide the attention heads"),
    (
        "layers vs pp",
        ["actor.pp=3", "actor.tp=1", "rollout.tp=1", "cluster.procs_per_node=3"],
        "must divide the 4 layers",
    ),
    ("rollout tp vs heads", ["rollout.tp=8", "cluster.procs_per_node=8", "actor.tp=2"], "rollout.tp=8 must divide"),
    (
        "rollout tp vs KV heads",
        _rollout_tp_vs_kv_heads,
        "rollout.tp=6 must divide the attention heads (12), and divide",
    ),
    ("batch vs micro-batch", ["trainer.prompts_per_step=4"], "not a multiple of actor.micro_batch_size=64"),
    ("batch vs DP", ["actor.tp=1", "trainer.prompts_per_step=3"], "trainer.prompts_per_step=3 must split evenly"),
    ("samples per prompt", ["rollout.n_samples_per_prompt=0"], "rollout.n_samples_per_prompt=0 must be >= 1"),
    ("utilization > 1", ["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization=1.5 is outside (0, 1]"),
    ("KV cache bytes", ["rollout.kv_cache_bytes=1000"], "rollout.kv_cache_bytes=1000 must be an integer >= 1048576"),
    ("KV budget", ["rollout.cpu_capacity_gb=0.05"], "for the KV cache after the engine's weights"),
    (
        "KV bytes < one sequence",
        ["--exp=memory_cpu", "rollout.kv_cache_bytes=1048576", "rollout.max_model_len=256"],
        "rollout.kv_cache_bytes=1048576 (1.0 MiB in whole blocks) is less than one max_model_len=256 sequence",
    ),
    ("bucket size", ["weight_sync.bucket_mb=0"], "weight_sync.bucket_mb=0 must be >= 1"),
    ("missing model.path", ["model.path=/no/such/checkpoint"], "model.path='/no/such/checkpoint' has no config.json"),
    ("missing shard", _missing_shard, "has neither model.safetensors nor model.safetensors.index.json"),
    ("missing indexed shard", _missing_indexed_shard, "model-00002-of-00002.safetensors is missing"),
    ("truncated shard", _truncated_shard, "model.safetensors is truncated or corrupt"),
    ("unsupported architecture", _unsupported_architecture, "model_type 'gpt2' is not supported"),
    ("weights of another model", _weights_of_another_model, "the weights and config.json are of different models"),
    ("tokenizer vocab > model vocab", _vocab_too_small_for_tokenizer, "but config.json's vocab_size is 64"),
    ("no tokenizer", _no_tokenizer, "has no tokenizer (none of tokenizer.json"),
    ("unknown experiment", "--exp=nope", "EXP='nope' is not an experiment"),
    ("unknown key", ["actor.foo=1"], "unknown config key 'actor.foo'"),
    ("resume path not a checkpoint", _not_a_checkpoint, "is not a checkpoint"),
    ("resume=never over checkpoints", _never_over_checkpoints, "resume=never but"),
    (
        "resume a float32 checkpoint in bfloat16",
        _float32_checkpoint_into_bfloat16,
        "step_00000002 holds float32 weights but model.dtype=bfloat16; resume it with model.dtype=float32",
    ),
    ("engine not installed", _vllm_not_installed, "rollout.engine=vllm needs the vllm package"),
    (
        "data file missing",
        ["data.task=gsm8k", "data.path=/no/such.jsonl", "trainer.sft_warmup_steps=0"],
        "data.path='/no/such.jsonl' does not exist",
    ),
    ("data line not JSON", _jsonl_with_a_truncated_line, "train.jsonl line 2: not valid JSON (Unterminated string starting at: line 1 column"),
    ("data line lacks fields", _jsonl_with_another_schema, "train.jsonl line 3: lacks 'question', 'answer'"),
    ("NaN weight", _nan_in_a_weight, "model.layers.0.mlp.up_proj.weight holds 1 non-finite value(s) (NaN/inf), the first at [3, 5]"),
    ("yarn on a v5 config", _yarn_added_to_a_transformers5_config, "RoPE type 'yarn' (config.json's rope_scaling"),
    ("run dir held by a live run", _run_dir_of_a_live_run, "run is in use by a live run (pid "),
    ("checkpoint cadence", ["trainer.save_every=-1"], "trainer.save_every=-1 must be >= 0"),
    ("collective timeout", ["cluster.timeout_s=1"], "cluster.timeout_s=1.0 must be >= 10"),
]


@pytest.fixture
def no_ranks(monkeypatch):
    def spawn_local(*args, **kwargs):
        raise AssertionError("a rank was started for bad input")

    monkeypatch.setattr(run.main, "spawn_local", spawn_local)


@pytest.mark.parametrize("name,case,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_before_any_rank(
    name, case, expected, tiny_model_dirs, tmp_path, monkeypatch, capsys, no_ranks
):
    if callable(case):
        args = (
            case(tiny_model_dirs, tmp_path, monkeypatch)
            if "monkeypatch" in case.__code__.co_varnames
            else case(tiny_model_dirs, tmp_path)
        )
    else:
        args = [case] if isinstance(case, str) else list(case)
    exp = [a for a in args if a.startswith("--exp=")]
    args = [a for a in args if not a.startswith("--exp=")]
    start = time.perf_counter()
    code = main([*(["--exp", exp[0].split("=", 1)[1]] if exp else []), *args])
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("config error: ") and err.count("\n") == 1, err
    assert expected in err, err
    print(f"\n| {name} | `{err.strip()}` | {seconds:.2f} |")


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_make_run_with_a_bad_tp_exits_nonzero_naming_actor_tp():
    """As a user runs it: a fresh interpreter, `make run ARGS="actor.tp=3"` (the timing goes in the issue note)."""
    proc = subprocess.run(
        [sys.executable, "-m", "run.main", "actor.tp=3"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "actor.tp=3" in proc.stderr, proc.stderr


def _te_version(monkeypatch, installed: str) -> None:
    """As if Transformer Engine ``installed`` were the version here (importlib.metadata's answer)."""
    import importlib.metadata

    real = importlib.metadata.version
    te = {"transformer_engine", "transformer-engine"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name in te else real(name))


@pytest.mark.parametrize(
    "installed,overrides,refused",
    [
        ("2.11.0", [], True),  # float32 + remove_padding (the defaults): no attention backend
        ("2.12.0", [], False),  # unfused attention takes THD from 2.12
        ("2.11.0", ["model.dtype=bfloat16"], False),
        ("2.11.0", ["actor.remove_padding=false"], False),
    ],
)
def test_te_float32_packed_attention_is_refused_before_launch(
    tiny_model_dirs, tmp_path, monkeypatch, installed, overrides, refused
):
    """TE before 2.12 has no attention backend for float32 THD (packed) sequences: flash and fused attention take
    fp16/bf16 only, and get_attention_backend disabled unfused attention for qkv_format="thd"
    (transformer_engine/pytorch/attention/dot_product_attention/utils.py, "Disabling UnfusedDotProductAttention
    for qkv_format = thd", removed by TE commit 93c5c65, first released in 2.12.0). A CUDA run there is refused
    by preflight in one line naming what to change; a CPU run (no TE) never is."""
    from run.compose import ConfigError, compose
    from run.main import check_launch
    from run.preflight import preflight

    _te_version(monkeypatch, installed)
    cfg = compose("tiny_cpu", ["cluster.device=H100-80GB", *overrides])
    launch = check_launch(cfg, None)
    cfg.model.path = tiny_model_dirs["qwen2"]
    if refused:
        with pytest.raises(ConfigError) as err:
            preflight(cfg, None, launch)
        assert str(err.value).count("\n") == 0 and "model.dtype=bfloat16" in str(err.value), err.value
        assert "actor.remove_padding=false" in str(err.value) and "transformer-engine>=2.12" in str(err.value)
    else:
        preflight(cfg, None, launch)
