"""Every point of a grid composed (:func:`run.compose.compose`) and planned on the experiment's device
(:func:`planner.make_plan`) before anything launches; the infeasible ones carry their reason."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from planner import make_plan
from planner.report import verdict
from run.compose import ConfigError, compose
from run.config import RunConfig
from run.memory_plan import data_prompt_length, plan_inputs
from tools.sweep.agent import point_overrides
from tools.sweep.grid import short_key


@dataclass
class Point:
    index: int
    params: dict[str, Any]
    overrides: list[str]
    cfg: RunConfig | None = None
    plan: Any = None  # planner.Plan
    reason: str | None = None  # why it is not run (infeasible) or why it failed
    status: str = "pending"  # pending | infeasible | ok | failed | not run
    result: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``03_offload.params=True_util=0.5``: the index and each parameter by its short name."""
        parts = [f"{short_key(k)}={v}" for k, v in self.params.items()]
        return re.sub(r"[^\w.=,+-]", "_", f"{self.index:02d}_" + "_".join(parts))


def validate(exp: str, fixed: list[str], grid: list[dict[str, Any]]) -> list[Point]:
    """Compose and plan every point on the experiment's device; infeasible ones get their reason."""

    points = []
    for index, params in enumerate(
        tqdm(grid, desc=f"checking points on {exp}", unit="point", leave=False, disable=None)
    ):
        point = Point(index, params, point_overrides(params))
        try:
            point.cfg = compose(exp, [*fixed, *point.overrides])
            point.plan = make_plan(plan_inputs(point.cfg, data_prompt_length(point.cfg).tokens))
        except (ConfigError, ValueError) as exc:
            point.status, point.reason = "infeasible", f"config: {exc}"
        else:
            if not point.plan.fits:
                point.status, point.reason = "infeasible", f"plan on {point.cfg.cluster.device}: {verdict(point.plan)}"
        points.append(point)
    return points


def print_validation(points: list[Point], exp: str, device: str) -> None:
    feasible = [p for p in points if p.status != "infeasible"]
    print(
        f"{len(points)} points, {len(feasible)} fit {exp} on {device} (planner), {len(points) - len(feasible)} do not"
    )
    for p in points:
        if p.status == "infeasible":
            print(f"  skip {p.name}: {p.reason}")
