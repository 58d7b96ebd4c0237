"""``make tune EXP=<name> [NODES=<n>] [GPUS_PER_NODE=<n>] [DEVICE=<preset>] [ARGS=...]``: search the layouts of an
experiment on a cluster, keep those whose device and host plans fit with headroom beyond the uncertainty, rank them
by the step-time model's predicted seconds, print the best ten and why the best rejected ones were rejected, and
write the winner as an experiment YAML that ``make run EXP=`` takes (plus a chart, and JSON with ``--json``).

Each layout is planned from the experiment's inputs (``run/memory_plan.py::plan_inputs``, once) with the layout's
actor/rollout configs swapped in and the run's checks (``RunConfig``, ``PlanInputs``) applied. The weight sync's
staging is planned at the bucket's bound and its reference check left out during the search (planning the exact sync
for each mesh takes seconds); the winner is planned again exactly, from the YAML it writes, before it is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from colocation.phases import WAKE_STRATEGIES
from planner import make_plan
from planner.devices import GIB
from planner.host import host_plan
from planner.report import headroom_beyond_uncertainty_bytes, recommend_optimizer_offload_fraction, verdict
from planner.speed import speed_preset
from planner.step_time import predict_step_time
from run.compose import ConfigError, compose, compose_from_file
from run.memory_plan import data_prompt_length, plan_inputs

REPO = Path(__file__).resolve().parent.parent
EXP_DIR = REPO / "experiments" / "conf" / "exp"
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
RECOMPUTE = ("none", "full")
MAX_PP = 8


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int | None
    ep: int
    etp: int | None
    rollout_tp: int
    offload: tuple[bool, bool, bool]  # params, grads, optimizer
    recompute: str
    micro_batch_size: int
    wake_strategy: str
    optimizer_offload_fraction: float = 0.0

    def label(self) -> str:
        moe = f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp else "") if self.ep > 1 or self.etp else ""
        vpp = f" VPP{self.vpp}" if self.vpp else ""
        off = "".join(c if on else "-" for c, on in zip("pgo", self.offload, strict=True))
        frac = f" oof{self.optimizer_offload_fraction:g}" if self.optimizer_offload_fraction else ""
        return (
            f"TP{self.tp} PP{self.pp}{vpp}{moe} eTP{self.rollout_tp} off:{off}{frac} rc:{self.recompute} "
            f"mb{self.micro_batch_size} wake:{self.wake_strategy}"
        )

    def overrides(self) -> dict:
        """The experiment's keys this layout sets."""
        params, grads, optimizer = self.offload
        return {
            "actor": {
                "tp": self.tp,
                "pp": self.pp,
                "vpp": self.vpp,
                "ep": self.ep,
                "etp": self.etp,
                "recompute": self.recompute,
                "micro_batch_size": self.micro_batch_size,
                "optimizer_offload_fraction": self.optimizer_offload_fraction,
                "offload": {"params": params, "grads": grads, "optimizer": optimizer},
            },
            "rollout": {"tp": self.rollout_tp, "wake_strategy": self.wake_strategy},
        }


@dataclass
class Judged:
    layout: Layout
    seconds: float
    bound: str
    peak_bytes: int
    budget_bytes: int
    feasible: bool
    reason: str | None  # why rejected
    plan: object = field(default=None, repr=False)

    def to_json(self) -> dict:
        return {
            "layout": dataclasses.asdict(self.layout),
            "label": self.layout.label(),
            "predicted_step_seconds": self.seconds,
            "bound": self.bound,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "feasible": self.feasible,
            "rejected_because": self.reason,
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(shape, world: int, per_node: int, on_cuda: bool) -> list[Layout]:
    """Every layout of the axes, divisibility honoured (the run's own checks come after, per layout)."""
    out = []
    tps = [t for t in divisors(world) if t <= per_node]
    pps = [p for p in divisors(shape.num_layers) if p <= MAX_PP and world % p == 0]
    experts = shape.num_experts or 0
    for tp, pp in itertools.product(tps, pps):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        vpps = [None] + ([2] if pp > 1 and shape.num_layers % (pp * 2) == 0 else [])
        if experts:
            moe = [
                (ep, etp)
                for ep in divisors(experts)
                for etp in (None, 1)
                if (tp * dp) % (ep * (etp or tp)) == 0 and not (etp == 1 and tp == 1)
            ]
        else:
            moe = [(1, None)]
        rtps = [t for t in divisors(world) if t <= per_node]
        for vpp, (ep, etp), rtp in itertools.product(vpps, moe, rtps):
            for off in itertools.product((True, False), repeat=3):
                for rc, mb, wake in itertools.product(RECOMPUTE, MICRO_BATCHES, WAKE_STRATEGIES):
                    out.append(Layout(tp, pp, vpp, ep, etp, rtp, off, rc, mb, wake))
    return out


def configure(cfg, layout: Layout):
    """The composed RunConfig with the layout's keys (ValueError: the run's checks reject it)."""
    params, grads, optimizer = layout.offload
    actor = dataclasses.replace(
        cfg.actor,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        ep=layout.ep,
        etp=layout.etp,
        dp=None,
        recompute=layout.recompute,
        micro_batch_size=layout.micro_batch_size,
        optimizer_offload_fraction=layout.optimizer_offload_fraction,
        offload=dataclasses.replace(cfg.actor.offload, params=params, grads=grads, optimizer=optimizer),
    )
    rollout = dataclasses.replace(cfg.rollout, tp=layout.rollout_tp, ep=1, wake_strategy=layout.wake_strategy)
    return dataclasses.replace(cfg, actor=actor, rollout=rollout)


def experiment_layout(cfg) -> Layout:
    """The layout the composed experiment runs."""
    a, off = cfg.actor, cfg.actor.offload
    return Layout(
        a.tp,
        a.pp,
        a.vpp,
        a.ep,
        a.etp,
        cfg.rollout.tp,
        (off.params, off.grads, off.optimizer),
        a.recompute,
        a.micro_batch_size,
        cfg.rollout.wake_strategy,
        a.optimizer_offload_fraction,
    )


def layout_inputs(base, cfg):
    """The experiment's plan inputs with ``cfg``'s layout (the sync at its bound, no reference check)."""
    actor = cfg.actor
    return dataclasses.replace(
        base,
        actor=actor,
        rollout=cfg.rollout,
        actor_dp=cfg.dp,
        distributed_optimizer=cfg.dp > 1 or actor.optimizer_offload_fraction > 0,
        sync_staged_bytes=None,
        sync_traffic=None,
        sync_peers=None,
        reference_check=None,
    )


def params_lower_bound(shape, layout: Layout, world: int, element_bytes: int) -> int:
    """Bytes one rank must hold at least: the engine's weights while it generates (every expert spread over the
    world at best), or the actor's in train; a cheap bound to skip layouts before planning."""
    total = shape.param_count() * element_bytes
    if shape.num_experts:
        per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size
        expert = len(shape.moe_layers) * shape.num_experts * per_expert * element_bytes
        dense = total - expert
        actor = dense / (layout.tp * layout.pp) + expert / (layout.ep * (layout.etp or layout.tp) * layout.pp)
        engine = dense / layout.rollout_tp + expert / world
    else:
        actor = total / (layout.tp * layout.pp)
        engine = total / layout.rollout_tp
    return int(max(actor, engine))


def judge(layout: Layout, plan, speed) -> Judged:
    step = predict_step_time(plan, speed)
    reason = None
    if not plan.fits:
        reason = verdict(plan).split(" (also over: ")[0]
        if len(plan.overflows) > 1:
            reason += f" (and {len(plan.overflows) - 1} more phases)"
    else:
        beyond = headroom_beyond_uncertainty_bytes(plan)
        if beyond < 0:
            reason = (
                f"fits by {plan.headroom_bytes / GIB:.2f} GiB at {plan.peak_phase}, within the uncertainty "
                f"({-beyond / GIB:.2f} GiB short)"
            )
        else:
            host = host_plan(plan)
            if host.fits is False:
                reason = (
                    f"host: {host.peak_bytes_per_node / GIB:.1f} GiB per node at {host.peak_phase} over the node's "
                    f"{host.node_memory_bytes / GIB:.1f} GiB"
                )
    return Judged(layout, step.seconds, step.bound, plan.peak_bytes, plan.budget_bytes, reason is None, reason, plan)


@dataclass
class Search:
    judged: list[Judged]
    considered: int
    rejected_by_checks: int
    skipped_by_bound: int
    sampled_from: int | None
    seconds: float
    cheap_smallest: int | None = None


def search(cfg, base, speed, max_layouts: int = 3000, fraction_budget: int = 60, seed: int = 0) -> Search:
    t0 = time.monotonic()
    shape, device = base.shape, base.device
    world = cfg.cluster.world_size
    layouts = enumerate_layouts(shape, world, cfg.cluster.procs_per_node, base.on_cuda)
    total = len(layouts)
    valid, rejected, skipped, smallest = [], 0, 0, None
    for layout in layouts:
        bound = params_lower_bound(shape, layout, world, base.element_bytes)
        if bound > device.total_bytes:
            skipped += 1
            smallest = bound if smallest is None else min(smallest, bound)
            continue
        try:
            run_cfg = configure(cfg, layout)
            inputs = layout_inputs(base, run_cfg)
        except ValueError:
            rejected += 1
            continue
        valid.append((layout, inputs))
    sampled_from = None
    if len(valid) > max_layouts:
        sampled_from = len(valid)
        valid = random.Random(seed).sample(valid, max_layouts)
    own = experiment_layout(cfg)  # the experiment's own layout, always judged: the baseline
    if all(layout != own for layout, _ in valid):
        try:
            valid.append((own, layout_inputs(base, configure(cfg, own))))
        except ValueError:
            pass
    judged = []
    for layout, inputs in valid:
        judged.append(judge(layout, make_plan(inputs), speed))
    if base.on_cuda and fraction_budget:
        # the planner's own recommendation (make plan's), for the fastest layouts that miss at fraction 0
        # the misses it can help: train is the peak (the optimizer's states are on the device then), within half a
        # budget of fitting; the fastest first
        helped = [
            j
            for j in judged
            if not j.feasible and j.plan.peak_phase == "train" and j.peak_bytes <= 1.5 * j.budget_bytes
        ]
        misses = sorted(helped, key=lambda j: j.seconds)[:fraction_budget]
        for j in misses:
            fraction = recommend_optimizer_offload_fraction(j.plan.inputs)
            if not fraction:
                continue
            layout = dataclasses.replace(j.layout, optimizer_offload_fraction=fraction)
            try:
                inputs = layout_inputs(base, configure(cfg, layout))
            except ValueError:
                continue
            judged.append(judge(layout, make_plan(inputs), speed))
    return Search(judged, total, rejected, skipped, sampled_from, time.monotonic() - t0, smallest)


def ranked(result: Search) -> tuple[list[Judged], list[Judged]]:
    ok = sorted((j for j in result.judged if j.feasible), key=lambda j: j.seconds)
    bad = sorted((j for j in result.judged if not j.feasible), key=lambda j: j.seconds)
    return ok, bad


def table(rows: list[Judged]) -> str:
    lines = [f"{'#':>3}  {'layout':<72} {'step s':>9} {'peak GiB':>9}  bound"]
    for i, j in enumerate(rows, 1):
        lines.append(f"{i:>3}  {j.layout.label():<72} {j.seconds:>9.3f} {j.peak_bytes / GIB:>9.2f}  {j.bound}")
    return "\n".join(lines)


def experiment_yaml(exp: str, name: str, layout: Layout, header: str) -> str:
    """The base experiment's YAML with the layout's keys set and ``exp: name``."""
    data = yaml.safe_load((EXP_DIR / f"{exp}.yaml").read_text()) or {}
    data["exp"] = name
    for section, values in layout.overrides().items():
        target = data.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, dict):
                target.setdefault(key, {}).update(value)
            else:
                target[key] = value
    return "# @package _global_\n" + header + yaml.safe_dump(data, sort_keys=False)


def write_winner(exp: str, cluster: dict, winner: Judged, out: Path, note: str) -> object:
    """Write the YAML, check it composes and fits when planned exactly; returns the exact plan (removes the file
    and raises ValueError when it does not compose)."""
    name = out.stem
    header = f"# written by `make tune EXP={exp}`: {winner.layout.label()}; {note}\n"
    text = experiment_yaml(exp, name, winner.layout, header)
    data = yaml.safe_load(text)
    data.setdefault("cluster", {}).update(cluster)
    text = "# @package _global_\n" + header + yaml.safe_dump(data, sort_keys=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    existed = out.exists()
    out.write_text(text)
    try:
        cfg = compose(name) if out.parent.resolve() == EXP_DIR.resolve() else compose_from_file(out)
    except ConfigError as exc:
        if not existed:
            out.unlink()
        raise ValueError(f"the winner's YAML does not compose: {exc}") from None
    return make_plan(plan_inputs(cfg, data_prompt_length(cfg).tokens))


def chart(
    result: Search, path: Path, title: str, marked: dict[str, Judged] | None = None, max_points: int = 4000
) -> list[str]:
    """Predicted step time against peak memory of every judged layout (sampled beyond ``max_points``), fits and
    rejected apart, each of ``marked`` (label -> layout: the winner, the experiment's own) drawn on top as a
    labelled star; returns the legend's labels."""
    import matplotlib  # optional library: the chart only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional library: the chart only

    points = result.judged
    sampled = len(points) > max_points
    if sampled:
        points = random.Random(0).sample(points, max_points)
    fig, ax = plt.subplots(figsize=(8, 5))
    for feasible, colour, label in ((False, "tab:red", "rejected"), (True, "tab:green", "fits")):
        xs = [j.peak_bytes / GIB for j in points if j.feasible == feasible]
        ys = [j.seconds for j in points if j.feasible == feasible]
        ax.scatter(xs, ys, s=8, c=colour, alpha=0.5, label=f"{label} ({len(xs)})")
    for (label, j), colour in zip((marked or {}).items(), ("gold", "tab:blue", "tab:purple")):
        star = f"{label}: {j.layout.label()} {j.seconds:.3g} s"
        ax.scatter(
            [j.peak_bytes / GIB], [j.seconds], s=160, marker="*", c=colour, edgecolors="black", zorder=3, label=star
        )
    if result.judged:
        ax.axvline(result.judged[0].budget_bytes / GIB, color="grey", ls="--", lw=1, label="budget")
    ax.set_xlabel("predicted peak GiB per rank")
    ax.set_ylabel("predicted step seconds")
    ax.set_yscale("log")
    ax.set_title(title + (f" (sampled {max_points} of {len(result.judged)})" if sampled else ""))
    legend = ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [text.get_text() for text in legend.get_texts()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="tiny_cpu")
    parser.add_argument("--nodes", type=int, default=None, help="default: the experiment's cluster.num_nodes")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: cluster.procs_per_node")
    parser.add_argument("--device", default=None, help="default: cluster.device")
    parser.add_argument("--out", default=None, help="the winner's YAML (default experiments/conf/exp/tuned_<exp>.yaml)")
    parser.add_argument("--chart", default=None, help="PNG (default: runs/tune/<exp>_<N>x<device>.png)")
    parser.add_argument("--json", default=None, help="write every judged layout and the ranking here")
    parser.add_argument("--max-layouts", type=int, default=3000, help="plan at most this many (sampled, seed 0)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--no-write", action="store_true", help="print only: no YAML")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of the experiment")
    args = parser.parse_args(argv)

    cluster = {}
    if args.nodes is not None:
        cluster["num_nodes"] = args.nodes
    if args.gpus_per_node is not None:
        cluster["procs_per_node"] = args.gpus_per_node
    if args.device is not None:
        cluster["device"] = args.device
    try:
        device_name = args.device or compose(args.exp, args.overrides).cluster.device
        speed = None if device_name.lower() == "cpu" else speed_preset(device_name)
        cluster_overrides = [f"cluster.{k}={v}" for k, v in cluster.items()]
        try:
            cfg = compose(args.exp, [*args.overrides, *cluster_overrides])
        except ConfigError:  # the experiment's own layout does not split this world: start from the smallest
            flat = ["actor.tp=1", "actor.pp=1", "actor.vpp=null", "actor.ep=1", "actor.etp=null", "rollout.tp=1"]
            cfg = compose(args.exp, [*args.overrides, *cluster_overrides, *flat])
        prompt = data_prompt_length(cfg)
        base = plan_inputs(cfg, prompt.tokens)
        if speed is None:  # CPU: measured, the GEMMs at the experiment's own engine weights
            from tools.speed_probe import measure_cpu_speed_for  # heavy library: torch, only for a CPU search

            speed = measure_cpu_speed_for(base)
    except (ConfigError, ValueError) as exc:
        print(f"make tune: {exc}", file=sys.stderr)
        return 2
    world, dev = cfg.cluster.world_size, cfg.cluster.device
    what = f"{args.exp} on {cfg.cluster.num_nodes} x {cfg.cluster.procs_per_node} {dev}"
    result = search(cfg, base, speed, max_layouts=args.max_layouts)
    ok, bad = ranked(result)
    sample_note = (
        f"; {args.max_layouts} sampled (seed 0) of the {result.sampled_from} that pass the checks"
        if result.sampled_from
        else ""
    )
    print(
        f"{what}: {result.considered} layouts, {result.skipped_by_bound} skipped (params alone exceed the device), "
        f"{result.rejected_by_checks} rejected by the run's checks, {len(result.judged)} planned{sample_note}; "
        f"{len(ok)} fit with headroom beyond the uncertainty ({result.seconds:.1f} s)"
    )
    if not ok:
        if result.judged:
            least = min(result.judged, key=lambda j: j.peak_bytes)
            smallest, budget = least.peak_bytes, least.budget_bytes
        else:
            smallest, budget = result.cheap_smallest or 0, base.device.total_bytes
        why = "over" if smallest > budget else "within the uncertainty of"
        print(
            f"no layout of {cfg.model.path} fits {world} x {dev}: the smallest peak is {smallest / GIB:.2f} GiB "
            f"{why} {budget / GIB:.2f} GiB",
            file=sys.stderr,
        )
        return 1
    print(f"\nbest {min(args.top, len(ok))} (predicted step seconds, {speed.name} speeds):")
    print(table(ok[: args.top]))
    own = experiment_layout(cfg)
    mine = next((j for j in result.judged if j.layout == own), None)
    if mine is not None:
        rank = f"rank {ok.index(mine) + 1} of {len(ok)}" if mine.feasible else f"rejected: {mine.reason}"
        print(f"\nthe experiment's own layout: {own.label()}  {mine.seconds:.3f} s ({mine.bound}); {rank}")
    if bad:
        print("\nbest rejected (by predicted time):")
        for j in bad[:5]:
            print(f"  {j.layout.label()}  {j.seconds:.3f} s: {j.reason}")
    chart_path = Path(args.chart or REPO / "runs" / "tune" / f"{args.exp}_{world}x{dev}.png")
    marks = {"fastest that fits": ok[0]} | ({"the experiment's own": mine} if mine is not None else {})
    chart(result, chart_path, what, marks)
    print(f"\nchart: {chart_path}")
    result_json = {
        "exp": args.exp,
        "cluster": {"num_nodes": cfg.cluster.num_nodes, "procs_per_node": cfg.cluster.procs_per_node, "device": dev},
        "considered": result.considered,
        "skipped_by_bound": result.skipped_by_bound,
        "rejected_by_checks": result.rejected_by_checks,
        "sampled_from": result.sampled_from,
        "search_seconds": result.seconds,
        "ranked": [j.to_json() for j in ok],
        "rejected": [j.to_json() for j in bad[:50]],
    }
    if not args.no_write:
        out = Path(args.out or EXP_DIR / f"tuned_{args.exp}.yaml")
        for j in ok[:3]:  # planned again exactly (the sync's staging and its reference check) from the YAML
            note = f"predicted {j.seconds:.3f} s/step ({j.bound}), peak {j.peak_bytes / GIB:.2f} GiB"
            try:
                exact = write_winner(args.exp, cluster, j, out, note)
            except ValueError as exc:
                print(f"{j.layout.label()}: {exc}", file=sys.stderr)
                continue
            if exact.fits and headroom_beyond_uncertainty_bytes(exact) >= 0:
                print(f"wrote {out} ({j.layout.label()}; planned exactly: {verdict(exact)})")
                result_json["winner"] = {**j.to_json(), "yaml": str(out), "exact_verdict": verdict(exact)}
                break
            print(f"{j.layout.label()}: planned exactly it does not keep its headroom ({verdict(exact)}); next")
        else:
            print("none of the best three fits when planned exactly; no YAML kept", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result_json, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
