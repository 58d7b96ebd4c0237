"""``make eval``: evaluate a Hugging Face checkpoint or a run's checkpoint; one JSON line.

    python -m tools.eval (--hf DIR | --run RUN_DIR [--step N]) [--exp EXP] [key=value ...]

The config (task, eval problems, sampling, layout, engine) comes from one place in both modes: the run's
``config.yaml`` (``--run``), the run config an export carries beside its weights (``--hf`` with
``run_config.yaml`` in it), else ``--exp`` (default tiny_cpu) with ``model.path`` set to ``--hf``;
the overrides apply on top (e.g. ``rollout.engine=vllm``, ``eval.max_problems=10``). Every rank then runs
what the run does, at the config's layout: the actor built from ``model.path`` (``--run``: the run's HF
checkpoint, then the megatron-core checkpoint ``checkpoints/step_<n>/actor`` loaded over it, resharded to
this layout), its weights synced into the engine by the planned reshard, the eval problems through the
engine (rl/evaluation.py, the loop's eval phase). So the two modes differ only in where the weights come from.

Printed (rank 0): ``accuracy`` (fraction of samples with the full reward), ``reward_mean``,
``response_length``, ``pass@<n>`` (eval.n_samples > 1), ``num_problems``, ``num_samples``, and
``reference_logprob_mean``: the actor's mean log-prob of the reference answers (prompt + answer + EOS,
teacher-forced, over the answer tokens; ``reference_tokens`` of them), a continuous figure any wrong
weight moves. Bad input fails in one line (exit 2) before any rank starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch.distributed as dist

from checkpointing.checkpoint import ACTOR_DIR, CHECKPOINT_DIR, RLState, complete_checkpoints, model_sizes
from checkpointing.checkpoint import RUN_CONFIG_COPY as RUN_CONFIG_FILE  # an export's copy of its run's config.yaml
from modelspec.tiny import resolve_model_path
from rl.evaluation import eval_problems, evaluate, reference_logprob_mean
from run.compose import ConfigError, compose, compose_from_file, resolve_path
from run.launch import missing_devices, spawn_local
from run.memory_plan import plan_launch
from run.preflight import check_engine_installed
from run.shared_device import sync_actor_into_engine


class BadInput(ValueError):
    """One line naming what is wrong and the fix."""


def _run_config_and_checkpoint(run: str, step: int | None, overrides: list[str]):
    """``--run``: the run's config (+ overrides) and the checkpoint directory to evaluate."""

    run_dir = Path(run)
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.exists() else "has no config.yaml"
        raise BadInput(f"RUN={run} {what}; give a run directory runs/<exp>/<time> (or HF=<HF checkpoint dir>)")
    found = complete_checkpoints(run_dir / CHECKPOINT_DIR)
    if not found:
        raise BadInput(
            f"RUN={run} has no complete checkpoint under {CHECKPOINT_DIR}/; a run saves one every "
            "trainer.save_every steps and after its last: evaluate a run that saved, or HF=<HF checkpoint dir>"
        )
    steps = {RLState.read(path).completed_steps: path for path in found}
    if step is None:
        step = max(steps)
    if step not in steps:
        raise BadInput(f"RUN={run} has no checkpoint of step {step}; it has steps {sorted(steps)}: STEP=<one of them>")
    try:
        cfg = compose_from_file(run_dir / "config.yaml", overrides)
    except ConfigError as exc:
        raise BadInput(f"RUN={run}: {exc}") from None
    saved = RLState.read(steps[step]).model
    expected = model_sizes(cfg.model.shape())
    if saved != expected:
        differ = [k for k in expected if saved.get(k) != expected[k]]
        raise BadInput(
            f"RUN={run} step {step} holds a model with {', '.join(f'{k}={saved.get(k)}' for k in differ)} but the "
            f"config's model.path={cfg.model.path} has {', '.join(f'{k}={expected[k]}' for k in differ)}; evaluate "
            "it with the run's own model (drop model.* from ARGS)"
        )
    return cfg, steps[step], step


def _hf_config(hf: str, exp: str | None, overrides: list[str]):
    """``--hf``: the export's run config (+ overrides), else the experiment's, with model.path = the checkpoint."""

    path = Path(hf)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise BadInput(f"HF={hf} {what}; point HF at a Hugging Face checkpoint directory (config.json + weights)")
    if not list(path.glob("*.safetensors")):
        raise BadInput(f"HF={hf} has no *.safetensors weights; only safetensors checkpoints are supported")
    model = [f"model.path={path.resolve()}"]
    try:
        if (path / RUN_CONFIG_FILE).is_file():
            if exp is not None:
                raise BadInput(f"EXP={exp}: HF={hf} carries its run's config ({RUN_CONFIG_FILE}); drop EXP")
            return compose_from_file(path / RUN_CONFIG_FILE, [*overrides, *model])
        return compose(exp or "tiny_cpu", [*overrides, *model])
    except ConfigError as exc:
        raise BadInput(f"HF={hf}: {exc}") from None


def check_input(args: argparse.Namespace):
    """(config, checkpoint dir or None, step or None), or BadInput."""

    if (args.hf is None) == (args.run is None):
        raise BadInput("make eval needs exactly one of HF=<HF checkpoint dir> or RUN=<run dir> [STEP=<n>]")
    if args.step is not None and args.run is None:
        raise BadInput(f"STEP={args.step} picks a checkpoint of RUN=<run dir>; drop it with HF")
    if args.run is not None:
        if args.exp is not None:
            raise BadInput(f"EXP={args.exp}: RUN={args.run} names its experiment in its config.yaml; drop EXP")
        cfg, checkpoint, step = _run_config_and_checkpoint(args.run, args.step, args.overrides)
    else:
        cfg, checkpoint, step = _hf_config(args.hf, args.exp, args.overrides), None, None
    cfg.model.path = resolve_model_path(resolve_path(cfg.model.path))
    problem = missing_devices(cfg.cluster, False)
    if problem is not None:
        raise BadInput(f"the config needs {cfg.cluster.world_size} x {cfg.cluster.device} and {problem}")
    try:
        check_engine_installed(cfg)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    return cfg, checkpoint, step


def _rank_main(cfg, checkpoint: Path | None, step: int | None) -> None:
    # the rank's imports: the launcher's input check never loads megatron or an engine
    from transformers import AutoTokenizer

    from run.setup import build_engine, build_rank

    # reading a checkpoint: torch's deprecation notices for what megatron-core 0.16 calls, once per rank
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron\.core|torch\.distributed\.checkpoint)")
    start, rank0 = time.monotonic(), int(os.environ.get("RANK", "0")) == 0

    def progress(what: str) -> None:  # long work: say what runs now, on rank 0
        if rank0:
            print(f"eval: {what} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    weights = str(checkpoint / ACTOR_DIR) if checkpoint is not None else cfg.model.path
    progress(f"the actor (TP {cfg.actor.tp} x PP {cfg.actor.pp}) from {weights}")
    parts = build_rank(cfg.model, cfg.actor, cfg.rollout, cfg.weight_sync, train=False, timeout_s=cfg.cluster.timeout_s)
    dims, mesh, actor = parts.dims, parts.mesh, parts.actor
    if checkpoint is not None:
        actor.load_checkpoint(checkpoint / ACTOR_DIR)  # any saved layout: dist checkpointing reshards
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    problems = eval_problems(cfg)
    progress(f"reference log-probs of {len(problems)} problems")
    reference_mean, reference_tokens = reference_logprob_mean(
        actor, tokenizer, problems, dims, cfg.actor.micro_batch_size
    )
    # the engine as the run starts it: sized with the actor's params where the run keeps them, then the sync
    offload = cfg.actor.offload.params
    if offload:
        actor.offload("params")
    progress(f"the {cfg.rollout.engine} engine (rollout TP {cfg.rollout.tp})")
    engine, _ = build_engine(cfg, parts, plan_launch(cfg))
    if offload:
        actor.onload("params")
    sync_actor_into_engine(parts.weight_sync, actor, engine)
    if offload:
        actor.offload("params")
    ev = cfg.eval
    sampling = "greedy" if ev.temperature == 0 else f"temperature {ev.temperature}"
    progress(f"generating {len(problems)} problems x {ev.n_samples} ({sampling})")
    figures = evaluate(engine, tokenizer, cfg.data.build(seed=cfg.trainer.seed), problems, cfg, mesh, dims.rank)
    if dims.rank == 0:
        line = {
            **{k: int(v) if k.startswith("num_") else v for k, v in figures.items()},
            "reference_logprob_mean": reference_mean,
            "reference_tokens": reference_tokens,
            "weights": weights,
            "step": step,
            "task": cfg.data.task,
            "engine": cfg.rollout.engine,
            "actor_tp": cfg.actor.tp,
            "actor_pp": cfg.actor.pp,
            "rollout_tp": cfg.rollout.tp,
            "world_size": mesh.world_size,
            "seconds": round(time.monotonic() - start, 1),
        }
        print(json.dumps(line), flush=True)
    dist.barrier()


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default=None, help="a Hugging Face checkpoint directory")
    parser.add_argument("--run", default=None, help="a run directory runs/<exp>/<time>")
    parser.add_argument("--step", type=int, default=None, help="the run's checkpoint of this step (default: latest)")
    parser.add_argument("--exp", default=None, help="with --hf and no run config beside it: the experiment (tiny_cpu)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rollout.engine=vllm eval.max_problems=10")
    args = parser.parse_args(argv)
    try:
        cfg, checkpoint, step = check_input(args)
    except BadInput as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    source = f"{checkpoint} over {cfg.model.path}" if checkpoint is not None else cfg.model.path
    print(f"eval: {cfg.cluster.world_size} ranks, {source}", file=sys.stderr, flush=True)
    return spawn_local(_rank_main, cfg.cluster.world_size, (cfg, checkpoint, step))


if __name__ == "__main__":
    sys.exit(main())
