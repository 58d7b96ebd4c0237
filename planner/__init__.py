"""The memory planner: bytes per device in every phase of the RL step, predicted before launch.

A pure analytical model (imports only :mod:`modelspec` and the standard library; psutil for the
``cpu`` device): :class:`PlanInputs` (model shape, layouts, offload flags, wake strategy, batch sizes,
engine, device) -> :func:`make_plan` -> :class:`Plan` (every phase itemized by component, the peak,
whether it fits, the largest safe KV cache and its ``gpu_memory_utilization`` under each engine's
meaning). :func:`check_fits` compares a measured free-memory figure with the plan before the KV cache
wakes. ``make plan EXP=<name>`` (tools/plan.py) prints and writes one.
"""

from planner.devices import DEVICE_NAMES, DeviceSpec, device_preset
from planner.inputs import PlanInputs, StepLengths
from planner.plan import COMPONENTS, PHASES, FitCheck, PhasePlan, Plan, check_fits, make_plan, variants

__all__ = [
    "COMPONENTS",
    "DEVICE_NAMES",
    "PHASES",
    "DeviceSpec",
    "FitCheck",
    "PhasePlan",
    "Plan",
    "PlanInputs",
    "StepLengths",
    "check_fits",
    "device_preset",
    "make_plan",
    "variants",
]
