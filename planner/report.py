"""A plan as a readable table and as JSON (``make plan``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.comms import NCCL_PROTOCOL_BUFFER_BYTES
from planner.host import host_plan
from planner.plan import COMPONENTS, Plan, engine_rollout_activation_bytes, make_plan
from planner.sizes import worst_routed_copies_ratio

GIB = 2**30
# column header per component (the legend under the table spells them out)
SHORT = {
    "actor_params": "params",
    "actor_grads": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "logits": "logits",
    "ref_params": "ref",
    "engine_weights": "eng_w",
    "kv_cache": "kv",
    "engine_reserve": "eng_res",
    "comm_buffers": "comm",
    "sync_bucket": "bucket",
    "reference_check": "refchk",
    "export_staging": "export",
}


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f}"


def size(num_bytes: float) -> str:
    """``2.50 GiB``, or below 1 GiB ``41.0 MiB`` (a CPU run's KV cache reads 0.00 in GiB)."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


def verdict(plan: Plan) -> str:
    """One line: fits with the peak and headroom, or the worst overflow and by how much."""
    budget = f"budget {gib(plan.budget_bytes)} GiB"
    if plan.overflows:
        worst = max(plan.overflows, key=lambda o: o.over_bytes)
        others = [o.phase for o in plan.overflows if o.phase != worst.phase]
        also = f" (also over: {', '.join(others)})" if others else ""
        return (
            f"DOES NOT FIT: {worst.phase} needs {gib(worst.predicted_bytes)} GiB, {gib(worst.over_bytes)} GiB over "
            f"the {budget}{also}"
        )
    if plan.kv_cache_too_small:
        return (
            f"DOES NOT FIT: the KV cache ({size(plan.kv_cache_bytes)}) is smaller than one max_model_len sequence "
            f"({size(plan.min_kv_cache_bytes)}); the engine would refuse to start"
        )
    return (
        f"fits: peak {plan.peak_phase} {gib(plan.peak_bytes)} GiB, {gib(plan.headroom_bytes)} GiB left in the {budget}"
    )


def format_table(plan: Plan, side_by_side: list[tuple[str, Plan]] | None = None, title: str = "") -> str:
    inp = plan.inputs
    offload = "/".join(
        "yes" if v else "no" for v in (inp.actor.offload.params, inp.actor.offload.grads, inp.actor.offload.optimizer)
    )
    lines = [
        f"plan{': ' + title if title else ''}  model {inp.shape.source or inp.shape.model_type}  device {inp.device.name}",
        f"actor TP={inp.actor.tp} PP={inp.actor.pp}{f' VPP={inp.actor.vpp}' if inp.actor.vpp else ''} DP={inp.actor_dp}"
        f" {inp.dtype}, offload params/grads/optimizer={offload}, micro-batch {inp.actor.micro_batch_size} x "
        f"{inp.seq_len} tokens ({inp.prompt_tokens} prompt + {inp.response_tokens} response), recompute={inp.actor.recompute}"
        f"{', packed' if inp.actor.remove_padding else ''}"
        f"{f', <= {inp.actor.max_tokens_per_micro_batch} tokens/micro-batch' if inp.actor.max_tokens_per_micro_batch else ''}"
        f"{f', log-prob chunks of {inp.actor.logprob_chunk_tokens}' if inp.actor.logprob_chunk_tokens else ''}",
        f"engine {inp.rollout.engine} TP={inp.rollout.tp}, wake_strategy={inp.rollout.wake_strategy}, sync bucket "
        f"{gib(inp.sync_bucket_bytes)} GiB",
        f"device {gib(plan.capacity_bytes)} GiB - runtime {gib(plan.runtime_overhead_bytes)} - margin "
        f"{gib(plan.margin_bytes)} = budget {gib(plan.budget_bytes)} GiB per rank",
        *plan.notes,
        "",
    ]
    widths = [max(6, len(SHORT[c])) for c in COMPONENTS]
    header = f"{'phase (GiB)':<18}{'total':>8}  " + " ".join(f"{SHORT[c]:>{w}}" for c, w in zip(COMPONENTS, widths))
    lines.append(header)
    for p in plan.phases:
        mark = " <- peak" if p.name == plan.peak_phase else ""
        mark += " OVER" if p.predicted_bytes > plan.budget_bytes else ""
        cells = " ".join(f"{gib(p.components[c]) if p.components[c] else '-':>{w}}" for c, w in zip(COMPONENTS, widths))
        lines.append(f"{p.name:<18}{gib(p.predicted_bytes):>8}  {cells}{mark}")
    lines.append("  " + ", ".join(f"{SHORT[c]}={c}" for c in COMPONENTS))
    lines.append("")
    lines.append(verdict(plan))
    window = plan.wake_window_peak
    lines.append(
        f"wake window (wake_weights -> wake_kv_cache) peaks in {window.name} at {gib(window.predicted_bytes)} GiB; "
        f"rollout {gib(plan.phase('rollout').predicted_bytes)} GiB"
    )
    util = plan.equivalent_utilization(plan.recommended_kv_cache_bytes)
    lines.append(
        f"KV cache {gib(plan.kv_cache_bytes)} GiB ({plan.kv_cache_source}) = {plan.kv_cache_tokens():,} tokens at "
        f"{plan.kv_bytes_per_token / 1024:.1f} KiB/token; largest safe {gib(plan.largest_safe_kv_cache_bytes)} GiB "
        f"(bounded by {plan.kv_limiting_phase}), "
        f"recommended {gib(plan.recommended_kv_cache_bytes)} GiB = {plan.kv_cache_tokens(plan.recommended_kv_cache_bytes):,}"
        " tokens"
    )
    same = ", ".join(f"{engine} {value:.3f}" for engine, value in util.items())
    lines.append(
        f"recommended gpu_memory_utilization for {inp.rollout.engine}: {plan.recommended_gpu_memory_utilization} "
        f"(same KV cache as {same})"
    )
    lines += routing_lines(plan)
    lines += ["", *host_lines(plan), "", *communicator_lines(plan), *constants_lines(plan)]
    if side_by_side:
        lines += ["", f"side by side (KV cache fixed at {gib(plan.kv_cache_bytes)} GiB):"]
        lines.append(
            f"{'variant':<26}{'peak phase':<18}{'peak GiB':>9}{'headroom':>10}  {'fits':<5}{'largest safe KV':>16}"
        )
        for label, v in side_by_side:
            lines.append(
                f"{label:<26}{v.peak_phase:<18}{gib(v.peak_bytes):>9}{gib(v.headroom_bytes):>10}  "
                f"{'yes' if v.fits else 'no':<5}{gib(v.largest_safe_kv_cache_bytes):>16}"
            )
    return "\n".join(lines)


def plan_json(plan: Plan, side_by_side: list[tuple[str, Plan]] | None = None) -> dict:
    """The JSON ``make plan`` writes (keys pinned by tests/test_plan_cli.py)."""
    inp = plan.inputs
    return {
        "phases": [
            {"name": p.name, "predicted_bytes": p.predicted_bytes, "components": dict(p.components)}
            for p in plan.phases
        ],
        "peak_bytes": plan.peak_bytes,
        "peak_phase": plan.peak_phase,
        "fits": plan.fits,
        "wake_window_peak": {"phase": plan.wake_window_peak.name, "bytes": plan.wake_window_peak.predicted_bytes},
        "recommended_gpu_memory_utilization": plan.recommended_gpu_memory_utilization,
        "kv_cache_bytes": plan.kv_cache_bytes,
        "kv_cache_tokens": plan.kv_cache_tokens(),
        "kv_cache_source": plan.kv_cache_source,
        "recommended_kv_cache_bytes": plan.recommended_kv_cache_bytes,
        "largest_safe_kv_cache_bytes": plan.largest_safe_kv_cache_bytes,
        "kv_limiting_phase": plan.kv_limiting_phase,
        "min_kv_cache_bytes": plan.min_kv_cache_bytes,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "equivalent_gpu_memory_utilization": plan.equivalent_utilization(plan.recommended_kv_cache_bytes),
        "overflows": [
            {"phase": o.phase, "predicted_bytes": o.predicted_bytes, "over_bytes": o.over_bytes} for o in plan.overflows
        ],
        "verdict": verdict(plan),
        "device": {
            "name": inp.device.name,
            "capacity_bytes": plan.capacity_bytes,
            "runtime_overhead_bytes": plan.runtime_overhead_bytes,
            "margin_bytes": plan.margin_bytes,
            "budget_bytes": plan.budget_bytes,
        },
        "pp_stage": plan.pp_stage,
        "constants": constants_used(plan),
        "headroom_bytes": plan.headroom_bytes,
        "uncertainty_bytes": uncertainty_bytes(plan),
        "headroom_beyond_uncertainty_bytes": headroom_beyond_uncertainty_bytes(plan),
        "communicators": [vars(c) for c in inp.communicators],
        "host": host_plan(plan).to_json(),
        "moe_routing": None if (routing := routing_headroom(plan)) is None else routing.to_json(),
        "wake_strategy": inp.rollout.wake_strategy,
        "engine": inp.rollout.engine,
        "variants": [
            {
                "variant": label,
                "peak_phase": v.peak_phase,
                "peak_bytes": v.peak_bytes,
                "fits": v.fits,
                "largest_safe_kv_cache_bytes": v.largest_safe_kv_cache_bytes,
            }
            for label, v in side_by_side or []
        ],
    }


# ---------------------------------------------------------------- MoE routing
@dataclass(frozen=True)
class RoutingHeadroom:
    """How unevenly an MoE model may route before the plan stops fitting, in routed copies an EP rank's experts
    receive over balanced routing's N k (what a run logs per step as ``train/moe/routed_copies_max_ratio``)."""

    planned_ratio: float  # the plan's: 1.0 (balanced) or the capacity factor's bound
    source: str  # "balanced" | "capacity_factor"
    worst_ratio: float  # every copy the EP group can send one rank (planner.sizes.worst_routed_copies_ratio)
    fits_up_to_ratio: float | None  # the most at which the plan still fits (the KV cache fixed); None: not even planned

    def to_json(self) -> dict:
        return dict(vars(self))


def routing_headroom(plan: Plan, tolerance: float = 0.005) -> RoutingHeadroom | None:
    """The routed-copies ratio up to which ``plan`` still fits, its KV cache fixed, found by bisection between the
    planned and the worst ratio (the experts' activations grow with it; nothing else does); None for a dense model
    or EP 1, where every routed copy stays on its rank (the ratio is 1 exactly)."""
    inp = plan.inputs
    worst = worst_routed_copies_ratio(inp.shape, inp.actor.ep)
    if worst == 1.0:
        return None

    def fits(ratio: float) -> bool:
        return make_plan(inp.at_lengths(inp.planned_lengths(routed_copies_ratio=ratio), plan.kv_cache_bytes)).fits

    planned = inp.routed_copies_ratio
    source = "balanced" if inp.actor.moe_expert_capacity_factor is None else "capacity_factor"
    if not fits(planned):
        return RoutingHeadroom(planned, source, worst, None)
    if fits(worst):
        return RoutingHeadroom(planned, source, worst, worst)
    low, high = planned, worst
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return RoutingHeadroom(planned, source, worst, round(low, 3))


def routing_lines(plan: Plan) -> list[str]:
    """``make plan``'s MoE routing line (nothing for a dense model or EP 1)."""
    headroom = routing_headroom(plan)
    if headroom is None:
        return []
    factor = plan.inputs.actor.moe_expert_capacity_factor
    if factor is None:
        planned = "balanced (1.00x; without actor.moe_expert_capacity_factor megatron drops no token)"
    else:
        planned = f"at {headroom.planned_ratio:.2f}x, actor.moe_expert_capacity_factor={factor}'s bound (megatron drops the rest)"
    if headroom.fits_up_to_ratio is None:
        fits = "does not fit even there"
    elif headroom.fits_up_to_ratio >= headroom.worst_ratio:
        fits = "fits at any routing"
    else:
        fits = f"fits up to {headroom.fits_up_to_ratio:.2f}x"
    return [
        f"MoE routing: planned {planned}; {fits} (x: the routed copies one rank's experts receive over balanced "
        f"routing's; worst case {headroom.worst_ratio:.2f}x, every token's copies on one rank); each step logs its "
        "own as train/moe/routed_copies_max_ratio, and its plan uses it",
    ]


# ---------------------------------------------------------------- constants and their sources
def constants_used(plan: Plan) -> list[dict]:
    """Each calibration constant this plan uses: value, source, reference, whether it was measured on this
    device kind, and how many bytes of the peak phase its uncertainty can move."""
    inp = plan.inputs
    cal = inp.constants
    peak = plan.peak.components
    used: list[tuple[str, float, float]] = []  # name, the value this plan uses, bytes of the peak per unit of it
    if inp.runtime_overhead_bytes is None and inp.measures_runtime_at_launch:  # the launch level is measured
        used.append(("runtime_after_launch_bytes", cal.value("runtime_after_launch_bytes"), 1.0))
    elif inp.runtime_overhead_bytes is None:
        used.append(("runtime_overhead_bytes", plan.runtime_overhead_bytes, 1.0))
    reserve = inp.engine_profile.runtime_reserve_constant(inp.device.kind)
    if reserve is not None and not (inp.on_cuda and inp.cuda_graph_bytes is not None):
        used.append((reserve, cal.value(reserve), 1.0))
    if inp.on_cuda and inp.num_communicators:
        if inp.comm_bytes_per_communicator is None:
            per_comm = ("nccl_bytes_per_communicator", cal.value("nccl_bytes_per_communicator"), inp.num_communicators)
            used.append(per_comm)
        # each NCCL communicator holds one ring buffer set per channel (planner/comms.py)
        used.append(("nccl_channels", cal.value("nccl_channels"), inp.num_communicators * NCCL_PROTOCOL_BUFFER_BYTES))
    if inp.on_cuda and inp.attention == "flash":
        factor = cal.value("fused_activation_factor")
        used.append(("fused_activation_factor", factor, peak["activations"] / factor if factor else 0.0))
    if inp.attention == "unfused":
        factor = cal.value("local_spec_activation_factor")
        used.append(("local_spec_activation_factor", factor, peak["activations"] / factor if factor else 0.0))
    if cal.value("train_workspace_bytes") or cal["train_workspace_bytes"].uncertainty:
        used.append(("train_workspace_bytes", cal.value("train_workspace_bytes"), float(plan.peak_phase == "train")))
    if not inp.engine_profile.profiles_activations(inp.device.kind):
        factor = cal.value("engine_activation_factor")
        rollout_act = engine_rollout_activation_bytes(inp) if plan.peak_phase in ("rollout", "engine_sleep") else 0
        used.append(("engine_activation_factor", factor, rollout_act / factor if factor else 0.0))
    if inp.margin_fraction is None:
        used.append(("margin_fraction", cal.value("margin_fraction"), 0.0))
    out = []
    for name, value, per_unit in used:
        c = cal[name]
        out.append(
            {
                "name": name,
                "value": value,
                "unit": c.unit,
                "uncertainty": c.uncertainty,
                "source": c.source,
                "reference": c.reference,
                "measured_on_device_kind": c.measured,
                "uncertainty_bytes_at_peak": int(c.uncertainty * per_unit),
            }
        )
    return out


def _value(c: dict) -> str:
    if c["unit"] == "bytes":
        if c["value"] >= 2**30:
            return f"{gib(c['value'])} GiB +- {gib(c['uncertainty'])}"
        for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
            if max(c["value"], c["uncertainty"]) >= size or unit == "KiB":
                return f"{c['value'] / size:.1f} {unit} +- {c['uncertainty'] / size:.1f}"
    return f"{c['value']:g} +- {c['uncertainty']:g}"


def uncertainty_bytes(plan: Plan) -> dict[str, int]:
    """What can move the peak beyond the plan, by source: each non-policy constant's uncertainty at the peak,
    the device total's (an estimated ``mem_get_info`` total), and what planner/comms.py counts in a
    communicator's uncertainty beyond the channel count (a tree / NVLS buffer set per channel)."""
    out = {c["name"]: c["uncertainty_bytes_at_peak"] for c in constants_used(plan) if c["source"] != "policy"}
    inp = plan.inputs
    if inp.device.total_uncertainty_bytes:
        out["device_total_bytes"] = inp.device.total_uncertainty_bytes
    if inp.on_cuda and inp.num_communicators:
        channels = inp.constants["nccl_channels"]
        per_unit = inp.num_communicators * NCCL_PROTOCOL_BUFFER_BYTES
        structural = sum(c.uncertainty_bytes for c in inp.communicators) - round(channels.uncertainty * per_unit)
        out["nccl_tree_or_nvls_buffers"] = max(0, structural)
    return out


def headroom_beyond_uncertainty_bytes(plan: Plan) -> int:
    """Headroom at the peak less everything :func:`uncertainty_bytes` lists (negative: not safe)."""
    return plan.headroom_bytes - sum(uncertainty_bytes(plan).values())


OFFLOAD_FRACTION_STEP = 0.05


def recommend_optimizer_offload_fraction(inp, min_beyond_bytes: int = 0) -> float | None:
    """The smallest ``actor.optimizer_offload_fraction`` (in steps of 0.05) whose plan fits and keeps
    ``min_beyond_bytes`` of headroom beyond the uncertainty (megatron's distributed optimizer on CUDA); None: none
    does, or not CUDA."""

    if not inp.on_cuda:
        return None
    steps = round(1 / OFFLOAD_FRACTION_STEP)
    for i in range(steps + 1):
        fraction = round(i * OFFLOAD_FRACTION_STEP, 2)
        # megatron's optimizer on CUDA: distributed when DP > 1, and for its CPU offload
        distributed = inp.actor_dp > 1 or fraction > 0
        # both at once: PlanInputs rejects a fraction > 0 without the distributed optimizer (actor_dp = 1)
        actor = replace(inp.actor, optimizer_offload_fraction=fraction)
        trial = replace(inp, actor=actor, distributed_optimizer=distributed)
        plan = make_plan(trial)
        if plan.fits and headroom_beyond_uncertainty_bytes(plan) >= min_beyond_bytes:
            return fraction
    return None


def communicator_lines(plan: Plan) -> list[str]:
    """Each communicator the step uses (planner/comms.py), its size and what it holds."""
    inp = plan.inputs
    comms = inp.communicators
    if not comms:
        return []
    per = inp.comm_bytes_per_communicator
    per = inp.constants.value("nccl_bytes_per_communicator") if per is None else per
    lines = [
        f"communicators ({len(comms)}, {inp.num_communicators} NCCL; {gib(inp.comm_bytes)} GiB with "
        f"{_mib(per)} each beyond the counted buffers):"
    ]
    for c in comms:
        lines.append(
            f"  {c.name:<30}{c.ranks:>3} ranks {_mib(c.bytes):>10} +- {_mib(c.uncertainty_bytes):<10} {c.use} [{c.source}]"
        )
    return lines


def host_lines(plan: Plan) -> list[str]:
    """The node's host memory at its peak phase, per rank by component (planner/host.py), against its RAM."""
    host = host_plan(plan)
    peak = host.peak
    parts = ", ".join(f"{name} {gib(value)}" for name, value in peak.components.items() if value)
    if host.node_memory_bytes is None:
        verdict_line = "node RAM unknown"
    else:
        verdict_line = (
            f"{'fits' if host.fits else 'DOES NOT FIT'} the node's {gib(host.node_memory_bytes)} GiB "
            f"({host.node_memory_source})"
        )
    return [
        f"host memory per node: peak {gib(host.peak_bytes_per_node)} GiB in {host.peak_phase} = "
        f"{host.ranks_per_node} ranks x {gib(peak.rank_bytes)} GiB ({parts}): {verdict_line}"
    ]


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def constants_lines(plan: Plan) -> list[str]:
    """Where each constant comes from, which were never measured on this device, and the headroom kept
    beyond their uncertainty."""
    inp = plan.inputs
    constants = constants_used(plan)
    path = f"planner/calibration/{inp.device.kind}.json"
    lines = [f"constants ({'this plan overrides some; ' if inp.calibration else ''}{path}):"]
    for c in constants:
        mark = "measured" if c["measured_on_device_kind"] else f"NEVER MEASURED on {inp.device.name}"
        if c["source"] == "policy":
            mark = "policy"
        lines.append(f"  {c['name']:<32}{_value(c):<24}{c['source']:<9}{mark}: {c['reference']}")
    if inp.device.total_source:
        lines.append(
            f"  device total {gib(inp.device.total_bytes)} GiB +- {gib(inp.device.total_uncertainty_bytes)}: "
            f"{inp.device.total_source}"
        )
    spread = uncertainty_bytes(plan)
    unmeasured = [c for c in constants if not c["measured_on_device_kind"] and c["source"] != "policy"]
    unmeasured_spread = sum(c["uncertainty_bytes_at_peak"] for c in unmeasured)
    beyond = headroom_beyond_uncertainty_bytes(plan)
    lines.append(
        f"headroom {gib(plan.headroom_bytes)} GiB at the peak ({plan.peak_phase}); the uncertainty moves the peak by "
        f"up to {gib(sum(spread.values()))} GiB ({gib(unmeasured_spread)} GiB of it from {len(unmeasured)} constants "
        f"never measured on {inp.device.name}; "
        + ", ".join(f"{name} {gib(value)}" for name, value in spread.items() if value)
        + f"): {gib(beyond)} GiB of headroom beyond it"
        + ("" if beyond >= 0 or not plan.fits else f"; NOT SAFE until `make calibrate` runs on {inp.device.name}")
    )
    return lines
