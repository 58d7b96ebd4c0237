"""The tiny checkpoints are normal HF directories that transformers loads and generates from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from modelspec.families import FAMILIES
from modelspec.tiny import SEED, TOKENIZER_VOCAB_SIZE, resolve_model_path, write_tiny_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_checkpoint_loads_and_generates(tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = "12+34="
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] == len(prompt)  # one token per character
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 6
    assert tokenizer.decode(ids[0]) == prompt  # decodes without inserted spaces


def test_family_features(tiny_model_dirs):
    def config(family):
        return json.loads((Path(tiny_model_dirs[family]) / "config.json").read_text())

    def tensor_names(family):
        with safe_open(str(Path(tiny_model_dirs[family]) / "model.safetensors"), "pt") as f:
            return set(f.keys())

    qwen2, llama, qwen3 = config("qwen2"), config("llama"), config("qwen3")
    assert qwen2["model_type"] == "qwen2" and not qwen2["tie_word_embeddings"]
    assert qwen2["num_key_value_heads"] < qwen2["num_attention_heads"]  # GQA
    assert "model.layers.0.self_attn.q_proj.bias" in tensor_names("qwen2")
    assert "lm_head.weight" in tensor_names("qwen2")
    assert llama["model_type"] == "llama" and llama["tie_word_embeddings"]
    assert llama["vocab_size"] == TOKENIZER_VOCAB_SIZE and llama["vocab_size"] % 64 != 0
    assert not any(name.endswith(".bias") for name in tensor_names("llama"))
    assert "lm_head.weight" not in tensor_names("llama")
    assert qwen3["model_type"] == "qwen3"
    assert "model.layers.0.self_attn.q_norm.weight" in tensor_names("qwen3")


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # vLLM's CPU attention kernels


@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_dim_runs_in_vllm_cpu_attention(tiny_model_dirs, family):
    c = json.loads((Path(tiny_model_dirs[family]) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    assert head_dim in VLLM_CPU_HEAD_SIZES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_norms_and_biases_are_random(tiny_model_dirs, family):
    """A norm left at 1 or a bias at 0 would hide a tensor written to the wrong place (or never)."""
    with safe_open(str(Path(tiny_model_dirs[family]) / "model.safetensors"), "pt") as f:
        checked = [n for n in f.keys() if "norm" in n or n.endswith("bias")]
        assert checked
        for name in checked:
            t = f.get_tensor(name)
            assert t.unique().numel() == t.numel(), name  # every element distinct: no constant fill
        if family == "qwen2":
            assert not torch.equal(
                f.get_tensor("model.layers.0.self_attn.q_proj.bias"),
                f.get_tensor("model.layers.1.self_attn.q_proj.bias"),
            )


def test_tiny_checkpoints_are_deterministic(tmp_path):
    a = write_tiny_model("llama", tmp_path / "a")
    b = write_tiny_model("llama", tmp_path / "b")
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for name in fa.keys():
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name)), name


def test_resolve_model_path_builds_on_demand(tmp_path):
    path = resolve_model_path("tiny:qwen3", tiny_dir=tmp_path)
    assert (Path(path) / "model.safetensors").is_file()
    assert resolve_model_path("/some/hf/dir", tiny_dir=tmp_path) == "/some/hf/dir"
    with pytest.raises(ValueError, match="unknown tiny model family"):
        resolve_model_path("tiny:gpt5", tiny_dir=tmp_path)


def test_resolve_model_path_rebuilds_a_checkpoint_of_older_sizes(tmp_path):
    write_tiny_model("qwen3", tmp_path / "qwen3", hidden_size=64, head_dim=16)  # what an older version wrote
    path = resolve_model_path("tiny:qwen3", tiny_dir=tmp_path)
    config = json.loads((Path(path) / "config.json").read_text())
    assert (config["hidden_size"], config["head_dim"]) == (128, 32)


NUM_CONCURRENT = 4  # as many ranks as `make bench-sync`'s 4-rank layouts


def _wait_for(counter, target: int, deadline_s: float = 300.0) -> None:
    import time

    end = time.monotonic() + deadline_s
    while counter.value < target and time.monotonic() < end:
        time.sleep(0.01)


def _checkpoint_problem(path: Path, family: str = "qwen2") -> str | None:
    """What is missing or unreadable in the tiny checkpoint at ``path``, or None when it is complete."""
    try:
        config = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 (any failure to read is the finding)
        return f"{type(exc).__name__}: {exc}"
    if config.get("model_type") != family or "model.norm.weight" not in names:
        return f"incomplete: model_type={config.get('model_type')}, {len(names)} tensors"
    return None


def _resolve_in_child(tiny_dir, start, arrived, saves, finished, results) -> None:
    """One process of the concurrency test: resolve tiny:qwen2 at the same moment as the others.

    To make the race certain rather than likely, no process may write a checkpoint file before every process
    has either reached the point of writing (``save_pretrained``) or is waiting for the lock (``flock``):
    without a lock all of them build and replace the directory; with one, exactly one builds."""
    import fcntl
    import os

    import transformers

    real_save, real_flock = transformers.PreTrainedModel.save_pretrained, fcntl.flock
    counted = []

    def arrive() -> None:
        if not counted:
            counted.append(True)
            with arrived.get_lock():
                arrived.value += 1

    def save_pretrained(self, *args, **kwargs):
        with saves.get_lock():
            saves.value += 1
        arrive()
        _wait_for(arrived, NUM_CONCURRENT)
        return real_save(self, *args, **kwargs)

    def flock(fd, operation):
        if operation & fcntl.LOCK_EX:
            arrive()
        return real_flock(fd, operation)

    transformers.PreTrainedModel.save_pretrained = save_pretrained
    fcntl.flock = flock
    outcome = {"pid": os.getpid()}
    try:
        start.wait(timeout=300)
        path = Path(resolve_model_path("tiny:qwen2", tiny_dir=tiny_dir))
        outcome.update(path=str(path), inode=path.stat().st_ino, problem=_checkpoint_problem(path))
    except Exception as exc:  # noqa: BLE001
        outcome["problem"] = f"resolve_model_path raised {type(exc).__name__}: {exc}"
    with finished.get_lock():
        finished.value += 1
    _wait_for(finished, NUM_CONCURRENT)  # every process is done: what each one got must still be there
    if outcome.get("problem") is None:
        path = Path(outcome["path"])
        if not path.exists() or path.stat().st_ino != outcome["inode"]:
            outcome["problem"] = "the directory it returned was replaced by another process's copy"
        else:
            outcome["problem"] = _checkpoint_problem(path)
    results.put(outcome)


def test_resolve_model_path_is_safe_when_ranks_resolve_at_once(tmp_path):
    """`make bench-sync` on a fresh clone: 4 ranks resolved the same tiny checkpoint at once and one rank's
    rmtree met another's rename (FileNotFoundError: config.json). All succeed now, see a complete checkpoint
    that stays in place, and it is written once."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(NUM_CONCURRENT)
    arrived, saves, finished = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", 0)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_resolve_in_child, args=(str(tmp_path), start, arrived, saves, finished, results))
        for _ in range(NUM_CONCURRENT)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    problems = [f"pid {o['pid']}: {o['problem']}" for o in outcomes if o["problem"] is not None]
    assert not problems, "\n".join(problems)
    assert [p.exitcode for p in procs] == [0] * NUM_CONCURRENT
    assert len({o["path"] for o in outcomes}) == 1
    assert saves.value == 1, f"the checkpoint was written {saves.value} times, once per process"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]


def test_rewriting_the_same_checkpoint_leaves_the_directory_in_place(tmp_path):
    """`make tiny-models` beside a run that reads tiny_models/: identical bytes replace nothing; other bytes
    replace the directory whole; a temp directory a killed writer left is cleared."""
    first = write_tiny_model("llama", tmp_path / "llama")
    inode = first.stat().st_ino
    (tmp_path / ".llama-new-killed").mkdir()
    assert write_tiny_model("llama", tmp_path / "llama").stat().st_ino == inode
    other = write_tiny_model("llama", tmp_path / "llama", seed=SEED + 1)
    assert other.stat().st_ino != inode and not _checkpoint_problem(other, "llama")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".llama.lock", "llama"]
