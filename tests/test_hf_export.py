"""The HF export of the actor's distributed checkpoint (megatron_backend/hf_export.py, `make export`).

One 4-rank launch trains every tiny family one step at TP2 x PP2 (tiny_cpu_pp's layout), TP2 (x DP2) and
PP2 x VPP2, gathers the live actor's HF tensors in-test and saves its checkpoint; the tests then export each
checkpoint in this process and compare: the same names and shapes as the source checkpoint, every tensor
bit-equal (fp32) to the live actor's, transformers loads it with nothing missing or extra, its log-probs
equal the actor's; and vLLM's CPU build loads it (marker ``vllm``). The bad-input tests build a run
directory around one of these checkpoints.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from modelspec import ModelShape, TokenBatch
from tests.dist import run_ranks

LAYOUTS = [(2, 2, None), (2, 1, None), (1, 2, 2)]  # (tp, pp, vpp) on 4 ranks: DP 1, 2, 2
NUM_SEQS, SEQ_LEN, PROMPT_LEN = 4, 16, 6
SMALL_SHARD_BYTES = 400_000  # the tiny models are ~2.4 MB in fp32: several files


def _train_save_all(rank, world_size, model_dirs, root):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.advantages import grpo_advantages
    from rl.losses import PolicyLoss, PolicyLossConfig

    loss_fn = PolicyLoss(PolicyLossConfig(clip_eps_low=0.5, clip_eps_high=0.5, loss_agg="token-mean"))
    rows = []
    for family, hf_dir in sorted(model_dirs.items()):
        for tp, pp, vpp in LAYOUTS:
            dims = initialize_model_parallel(tp=tp, pp=pp, vpp=vpp)
            actor = Actor(hf_dir, ActorConfig(tp=tp, pp=pp, vpp=vpp, micro_batch_size=1 if vpp else 2, lr=1e-2), dims)
            gen = torch.Generator().manual_seed(0)
            input_ids = torch.randint(0, actor.shape.vocab_size, (NUM_SEQS, SEQ_LEN), generator=gen)
            loss_mask = torch.zeros(NUM_SEQS, SEQ_LEN - 1)
            loss_mask[:, PROMPT_LEN - 1 :] = 1.0
            batch = TokenBatch(input_ids=input_ids, loss_mask=loss_mask)
            batch.old_logprobs = actor.compute_logprobs(batch)
            batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
            actor.train_step(batch, loss_fn)
            live = actor.export_hf(dst=0)  # the live actor's weights, gathered in-test (the reference)
            ckpt = Path(root) / f"{family}-tp{tp}-pp{pp}-vpp{vpp}" / "checkpoints" / "step_00000001"
            actor.save_checkpoint(ckpt / "actor")
            logprobs = actor.compute_logprobs(TokenBatch(input_ids=input_ids))
            if rank == 0:
                rows.append(
                    dict(
                        family=family,
                        layout=(tp, pp, vpp),
                        checkpoint=str(ckpt),
                        live=live,
                        logprobs=logprobs,
                        input_ids=input_ids,
                        hf_dir=hf_dir,
                    )
                )
            del actor
    return rows


@pytest.fixture(scope="module")
def trained(dense_model_dirs, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("export_ckpts")
    return run_ranks(_train_save_all, 4, dense_model_dirs, str(root), timeout_s=900)[0]


def _source_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from megatron_backend.checkpoint import safetensors_index

    out = {}
    for name, file in safetensors_index(hf_dir).items():
        with safe_open(str(file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _export(row: dict, out: Path, max_shard_bytes: int, dtype=torch.float32) -> Path:
    from megatron_backend.hf_export import plan_export, source_tensor_names, write_hf_dir

    shape = ModelShape.from_pretrained(row["hf_dir"])
    plan = plan_export(shape, dtype, max_shard_bytes, source_tensor_names(row["hf_dir"]))
    return write_hf_dir(Path(row["checkpoint"]) / "actor", shape, row["hf_dir"], out, plan)


def _logprobs(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert all(not v for v in info.values()), info  # nothing missing, unexpected, mismatched
    with torch.no_grad():
        logits = model.eval()(input_ids=input_ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def test_export_equals_live_actor_bit_for_bit_and_its_logprobs(trained, tmp_path):
    assert len(trained) == len(LAYOUTS) * 4  # every layout of every tiny family
    for row in trained:
        source = _source_tensors(row["hf_dir"])
        assert any(not torch.equal(row["live"][n], source[n]) for n in row["live"]), "the step trained nothing"
        out = _export(row, tmp_path / f"{row['family']}-{row['layout']}", SMALL_SHARD_BYTES)
        exported = _source_tensors(str(out))
        label = (row["family"], row["layout"])
        # exactly the source's tensor names and shapes (tied embeddings as the source stores them)
        assert {n: t.shape for n, t in exported.items()} == {n: t.shape for n, t in source.items()}, label
        for name, tensor in exported.items():
            reference = row["live"].get(name, row["live"].get(name.replace("lm_head", "model.embed_tokens")))
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference), (label, name)
        assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
        assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
        assert (out / "tokenizer.json").is_file()
        diff = (_logprobs(out, row["input_ids"]) - row["logprobs"]).abs().max().item()
        assert diff <= 1e-5, (label, diff)


def test_single_file_and_bfloat16(trained, tmp_path):
    from safetensors import safe_open

    row = next(r for r in trained if r["family"] == "phi3" and r["layout"] == (2, 2, None))
    out = _export(row, tmp_path / "bf16", 1 << 30, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        fused = f.get_tensor("model.layers.3.self_attn.qkv_proj.weight")  # Phi-3's fused layouts stay fused
        assert torch.equal(fused, row["live"]["model.layers.3.self_attn.qkv_proj.weight"].to(torch.bfloat16))
        assert "model.layers.0.mlp.gate_up_proj.weight" in f.keys()


def test_tied_lm_head_stored_by_the_source_is_written_again():
    from megatron_backend.hf_export import plan_export
    from modelspec.family import hf_tensor_shapes

    shape = ModelShape.from_pretrained("tiny:llama")
    assert shape.tie_word_embeddings
    names = set(hf_tensor_shapes(shape))
    plain = plan_export(shape, torch.float32, 1 << 30, names)
    assert "lm_head.weight" not in plain.shapes
    stored = plan_export(shape, torch.float32, 1 << 30, names | {"lm_head.weight"})
    assert stored.tied_copies == {"lm_head.weight": "model.embed_tokens.weight"}
    with pytest.raises(ValueError, match="extra there"):
        plan_export(shape, torch.float32, 1 << 30, names | {"model.rotary.inv_freq"})


# ------------------------------------------------------------------------------------------------ bad input
def _run_dir(row: dict, tmp_path: Path, model: dict | None = None) -> Path:
    """A run directory (config.yaml, checkpoints/step_00000001 with rl_state.json) around ``row``'s checkpoint."""
    import yaml

    from checkpointing.checkpoint import RLState, model_sizes

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "actor").symlink_to(Path(row["checkpoint"]) / "actor")
    state = RLState(
        completed_steps=1,
        sampling_seed=0,
        next_sampling_seeds=[0],
        data_num_prompts_drawn=0,
        wandb_run_id=None,
        wandb_step=1,
        world_size=4,
        layout={},
        exp="test",
        model=model or model_sizes(ModelShape.from_pretrained(row["hf_dir"])),
    )
    (ckpt / "rl_state.json").write_text(json.dumps(state.__dict__))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": row["hf_dir"], "dtype": "float32"}}))
    return run


def _main(capsys, *args) -> tuple[int, str, str]:
    from tools.export import main

    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_writes_the_default_out_and_prints_one_json_line(trained, tmp_path, capsys):
    run = _run_dir(trained[0], tmp_path)
    code, out, err = _main(capsys, run)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["out"] == str(run / "hf" / "step_00000001") and summary["step"] == 1
    assert set(summary["files"]) >= {"config.json", "model.safetensors", "run_config.yaml"}
    assert summary["peak_rss_bytes"] > 0 and "[export] model.safetensors" in err
    # a non-empty OUT is refused, FORCE replaces it
    code, _, err = _main(capsys, run)
    assert code == 2 and "exists and is not empty" in err and "FORCE=1" in err
    code, _, err = _main(capsys, run, "--force")
    assert code == 0, err


def test_bad_input_one_line_before_any_write(trained, tmp_path, capsys):
    row = trained[0]
    code, _, err = _main(capsys, tmp_path)
    assert code == 2 and "not a run directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text("model: {path: x}\n")
    code, _, err = _main(capsys, empty)
    assert code == 2 and "no complete checkpoint" in err and "save_every" in err
    run = _run_dir(row, tmp_path)
    code, _, err = _main(capsys, run, "--step", 7)
    assert code == 2 and "STEP=7" in err and "[1]" in err
    assert not (run / "hf").exists()
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    bad = _run_dir(row, wrong, model=dict(num_layers=99, hidden_size=1, num_heads=1, num_kv_heads=1, vocab_size=1))
    code, _, err = _main(capsys, bad)
    assert code == 2 and "holds a model of" in err and len(err.strip().splitlines()) == 1
    assert not (bad / "hf").exists()


def test_full_disk_leaves_nothing_under_out(trained, tmp_path, capsys, monkeypatch):
    import shutil as shutil_module

    from megatron_backend import hf_export

    run = _run_dir(trained[0], tmp_path)
    out = tmp_path / "out"
    calls = []

    def full(tensor):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return hf_export.__dict__["_real_tensor_bytes"](tensor)

    monkeypatch.setitem(hf_export.__dict__, "_real_tensor_bytes", hf_export._tensor_bytes)
    monkeypatch.setattr(hf_export, "_tensor_bytes", full)
    code, _, err = _main(capsys, run, "--out", out)
    assert code == 2 and "disk filled up" in err
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    # too little free space: refused before writing
    monkeypatch.setattr(hf_export, "_tensor_bytes", hf_export.__dict__["_real_tensor_bytes"])
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: usage._replace(free=1000))
    code, _, err = _main(capsys, run, "--out", out)
    assert code == 2 and "MiB free" in err and not out.exists()


# ------------------------------------------------------------------------------------------------ vLLM
def _vllm_greedy(rank, world_size, path):
    """vLLM's greedy answers to PROMPTS (tokens, log-probs), and its prompt log-probs of each prompt followed by
    its answer (every token after the first: log p(token | the tokens before it))."""
    from vllm import SamplingParams as VllmSamplingParams

    from configs.rollout import RolloutConfig
    from modelspec.mesh import ColocatedMesh
    from rollout.engine import SamplingParams
    from rollout.vllm_engine import VllmEngine
    from tests.rollout_helpers import MAX_NEW_TOKENS, PROMPTS

    cfg = RolloutConfig(engine="vllm", tp=1, kv_cache_bytes=32 << 20, max_model_len=128)
    engine = VllmEngine(cfg, path, ColocatedMesh(world_size=1, rollout_tp=1), rank, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    answers = [[(c.token_ids, c.logprobs) for c in samples] for samples in engine.generate(PROMPTS, greedy)]
    sequences = [list(prompt) + list(samples[0][0]) for prompt, samples in zip(PROMPTS, answers)]
    # prompt_logprobs=0: each prompt position's dict holds the prompt's own token; position 0 has none (None)
    scoring = VllmSamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = engine.llm.generate([{"prompt_token_ids": s} for s in sequences], scoring, use_tqdm=False)
    prompt_logprobs = [
        [float(step[t].logprob) for t, step in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
        for seq, out in zip(sequences, outputs, strict=True)
    ]
    return answers, sequences, prompt_logprobs


@pytest.mark.vllm
def test_vllm_loads_the_export_and_matches_transformers(trained, tmp_path):
    """vLLM's CPU build loads the export: its greedy answers and their log-probs, and its prompt log-probs of
    each prompt with its answer, equal transformers' on the same files (<= 1e-4)."""
    from transformers import AutoModelForCausalLM

    from tests.rollout_helpers import hf_greedy, hf_logprobs, max_abs_diff

    for family in ("llama", "phi3"):  # tied + TP2 x PP2; fused qkv / gate_up
        row = next(r for r in trained if r["family"] == family and r["layout"] == (2, 2, None))
        out = _export(row, tmp_path / family, SMALL_SHARD_BYTES)
        answers, sequences, prompt_logprobs = run_ranks(_vllm_greedy, 1, str(out), timeout_s=600)[0]
        for (hf_tokens, hf_lps), ((tokens, lps),) in zip(hf_greedy(str(out)), answers, strict=True):
            assert tokens == hf_tokens, family
            assert max_abs_diff(lps, hf_lps) <= 1e-4, family
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        for seq, lps in zip(sequences, prompt_logprobs, strict=True):
            assert len(lps) == len(seq) - 1 > 1, family
            assert max_abs_diff(lps, hf_logprobs(model, seq[:1], seq[1:])) <= 1e-4, family


# ------------------------------------------------------------------------------------------------ in the loop
def test_loop_exports_by_the_same_code_as_make_export(tmp_path, capsys):
    """trainer.export_every=1 on tiny_cpu_pp (TP2 x PP2, 4 ranks, every rank writing its files): an export_hf
    phase per step on the timeline; the last step's directory equals `make export` of its checkpoint."""
    from telemetry.memory_timeline import EXPORT_PHASE, read_timeline_csv
    from tests.test_run import run_loop

    summary = run_loop(
        tmp_path,
        "trainer.steps=2",
        "trainer.save_every=2",
        "trainer.export_every=1",
        "wandb.mode=disabled",
        exp="tiny_cpu_pp",
    )
    run = Path(summary["run_dir"])
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_00000001", "step_00000002"]
    assert (run / "hf" / "step_00000002" / "run_config.yaml").is_file()
    rows = read_timeline_csv(run / "memory_timeline.csv")
    assert {(r["step"], r["rank"]) for r in rows if r["phase"] == EXPORT_PHASE} == {
        (s, k) for s in (0, 1) for k in range(4)
    }
    code, _, err = _main(capsys, run, "--out", tmp_path / "cli")
    assert code == 0, err
    in_loop, cli = _source_tensors(str(run / "hf" / "step_00000002")), _source_tensors(str(tmp_path / "cli"))
    assert in_loop.keys() == cli.keys() and all(torch.equal(in_loop[n], cli[n]) for n in cli)


def test_cli_with_two_processes_writes_the_same_files(trained, tmp_path, capsys):
    row = next(r for r in trained if r["family"] == "qwen2" and r["layout"] == (2, 2, None))
    run = _run_dir(row, tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    assert _main(capsys, run, "--out", one, "--max-shard-mb", 0.4)[0] == 0
    code, out, err = _main(capsys, run, "--out", two, "--max-shard-mb", 0.4, "--procs", 2)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["num_procs"] == 2
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir()) and len([f for f in files if f.startswith("model-")]) > 1
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
