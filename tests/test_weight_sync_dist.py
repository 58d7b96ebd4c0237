"""The executor, verification and baseline on 4 real gloo ranks, bit-exact against hand-written vLLM slicing."""

from __future__ import annotations

import torch

from tests.dist import run_ranks
from tests.test_weight_sync_plan import hf_weights, megatron_shards, mesh, model_config, reference_vllm_shard

WORLD = 4
CASES = [((2, 2, None), 4), ((1, 2, None), 2), ((2, 2, 2), 1), ((4, 1, None), 2), ((1, 4, None), 4)]


def _sync_all_layouts(rank: int, world_size: int, family: str):
    import torch.distributed as dist

    from tests.test_weight_sync_reference import swap_gate_up
    from weight_sync import TorchP2PTransport, execute_sync, plan_sync
    from weight_sync.baseline import baseline_sync, make_peer_export
    from weight_sync.layouts import actor_sources, engine_destinations
    from weight_sync.reference import ReferenceCheck, WeightLayoutError, sample_names
    from weight_sync.verify import WeightSyncMismatch, verify_sync

    dist.init_process_group("gloo")
    cfg = model_config(family)
    hf = hf_weights(family)
    report = []
    for case, ((tp, pp, vpp), rtp) in enumerate(CASES):
        layout = mesh(tp, pp, vpp, rtp)
        export = make_peer_export(rank, cfg, layout)
        sources = actor_sources(cfg, layout)
        destinations = engine_destinations(cfg, layout)
        src = megatron_shards(hf, family, tp, pp, vpp, rank)
        plan = plan_sync(sources, destinations, bucket_bytes=8 << 10, element_bytes=4)
        dst = {p.name: torch.zeros(p.local_shape) for p in destinations[rank]}
        # odd cases send row slices straight from shard to engine parameter (no staging)
        stats = execute_sync(
            plan, rank, src, dst, transport=TorchP2PTransport(), direct_min_bytes=0 if case % 2 else 1 << 20
        )
        checked = verify_sync(plan, rank, src, dst)
        # the reference check (actor's full tensors gathered over TP/PP, cut by the engine's layout) passes
        reference = ReferenceCheck(cfg, layout)
        reference_checked = sum(reference(rank, src, dst, sample_names(cfg, i)) for i in range(cfg.num_layers))
        for name, got in dst.items():
            assert torch.equal(got, reference_vllm_shard(hf, cfg, name, rtp, rank % rtp)), (tp, pp, vpp, rtp, name)
        base_dst = {p.name: torch.zeros(p.local_shape) for p in destinations[rank]}
        base = baseline_sync(export, cfg, src, base_dst, torch.device("cpu"))
        for name, got in base_dst.items():
            assert torch.equal(got, dst[name]), ("baseline", tp, pp, vpp, rtp, name)
        report.append(
            dict(
                layout=(tp, pp, vpp, rtp),
                planned=stats.__dict__,
                baseline=base.__dict__,
                checked=checked,
                reference_checked=reference_checked,
                plan_bytes=plan.bytes_moved,
                # one full model as megatron holds it (vocab padded): the shards of one DP replica, without
                # the tied embedding's copy on the last stage (not exported)
                model_bytes=4
                * sum(
                    torch.Size(s).numel()
                    for r in layout.actor_ranks(dp_rank=0)
                    for (_, name), s in export.shard_shapes[r].items()
                    if not (cfg.tie_word_embeddings and name == "output_layer.weight")
                ),
            )
        )
    # a corrupted engine slice is caught, on every rank, naming tensor and ranks
    if rank == 1:
        dst["model.layers.2.mlp.down_proj.weight"][0, 0] += 1.0
    try:
        verify_sync(plan, rank, src, dst)
        report.append("not caught")
    except WeightSyncMismatch as exc:
        report.append(str(exc))
    # a wrong engine layout in the plan (gate and up exchanged, actor TP 2 -> rollout TP 2): the plan's
    # checksums agree, the reference check stops every rank with the same line
    layout = mesh(2, 1, None, 2)
    plan = plan_sync(actor_sources(cfg, layout), swap_gate_up(engine_destinations(cfg, layout)), 8 << 10, 4)
    src = megatron_shards(hf, "llama_kv4", 2, 1, None, rank)
    dst = {p.name: torch.zeros(p.local_shape) for p in engine_destinations(cfg, layout)[rank]}
    execute_sync(plan, rank, src, dst, transport=TorchP2PTransport())
    verify_sync(plan, rank, src, dst)
    try:
        ReferenceCheck(cfg, layout)(rank, src, dst, sample_names(cfg, 0))
        report.append("wrong layout not caught")
    except WeightLayoutError as exc:
        report.append(str(exc))
    return report


def test_executor_verify_and_baseline_on_four_ranks():
    reports = run_ranks(_sync_all_layouts, WORLD, "llama_kv4")
    for case in range(len(CASES)):
        per_rank = [r[case] for r in reports]
        assert all(r["checked"] > 0 for r in per_rank)
        # what ranks received is exactly the planned traffic, and within one bucket of staging each
        assert sum(r["planned"]["bytes_received"] for r in per_rank) == per_rank[0]["plan_bytes"]
        assert all(r["planned"]["peak_extra_bytes"] <= 8 << 10 for r in per_rank)
        # the peers' export moves, per rank, (PP-1)/PP of the model / TP (pipeline broadcast of shards)
        # + (TP-1)/TP of it (TP all-gather of TP-split tensors; the norms, replicated, are not gathered:
        # a few % less)
        (tp, pp, _, _), model_bytes = per_rank[0]["layout"], per_rank[0]["model_bytes"]
        expected = WORLD * model_bytes * ((pp - 1) / pp / tp + (tp - 1) / tp)
        received = sum(r["baseline"]["bytes_received"] for r in per_rank)
        assert expected * 0.95 <= received <= expected, (per_rank[0]["layout"], received, expected)
        assert all(r["reference_checked"] > 0 for r in per_rank)
    for r in reports:
        assert "engine rank 1 model.layers.2.mlp.down_proj.weight" in r[-2], r[-2]
        assert r[-1] == reports[0][-1]
    assert reports[0][-1].startswith("weight sync check failed: engine rank 0 model.layers.0.mlp.gate_up_proj.weight")


def test_verify_sync_cli_end_to_end(tiny_model_dirs):
    """HF -> actor (PP=2) -> planned reshard -> engine (TP=2): engine log-probs equal transformers'."""
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "tools.verify_sync",
        "--hf",
        tiny_model_dirs["qwen3"],
        "--train-pp",
        "2",
        "--rollout-tp",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["max_abs_logprob_diff"] <= 1e-4 and out["num_tokens"] > 0
    assert out["bytes_moved"] > 0 and out["verified"] is True

    bad = subprocess.run(
        [sys.executable, "-m", "tools.verify_sync", "--hf", tiny_model_dirs["qwen3"], "--rollout-tp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "ROLLOUT_TP=3" in bad.stderr


def test_bench_sync_native_one_layout(tiny_model_dirs):
    """`make bench-sync LAYOUT=tp2-tp1` on a tiny model: one JSON line with the fields the README promises,
    the same engine outputs after every sync of either method (the tool fails otherwise), planned bytes =
    the least any sync moves; a layout that is not one of the three fails at once in one line."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tools.bench_sync", "--hf", tiny_model_dirs["qwen2"], "--layout", "tp2-tp1"]
    proc = subprocess.run([*cmd, "--repeats", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    out = json.loads(lines[0])
    for field in ("planned_s", "baseline_s", "planned_peak_extra_bytes", "baseline_peak_extra_bytes"):
        assert out[field] >= 0, field
    assert out["layout"] == "tp2->tp1" and out["engine"] == "native" and out["same_outputs"]
    assert 0 < out["planned_bytes"] == out["min_bytes"] <= out["baseline_bytes"]
    assert out["memcpy_gbps"] > 0 and out["planned_memcpy_fraction"] == out["planned_gbps"] / out["memcpy_gbps"]
    assert "repeat 2/2: planned" in proc.stderr and "warm-up: baseline" in proc.stderr

    bad = subprocess.run(
        [sys.executable, "-m", "tools.bench_sync", "--layout", "tp3-tp1"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "LAYOUT='tp3-tp1' is not one of tp4->tp2, tp2pp2->tp2, tp2->tp1" in bad.stderr
