"""The planner's constants that are not derived from the model's shape, one file per device kind.

``planner/calibration/<kind>.json`` (``cpu``, ``cuda``) holds each constant with its value, its uncertainty
and its source: ``fit`` (written by ``make calibrate`` from measured runs on that device kind, with the runs,
configs, library versions, date and device in ``provenance``), ``published`` (a figure with its reference),
``estimate`` (no measurement yet: the reference says what it stands for) or ``policy`` (a chosen safety
margin, not a measurement). ``make plan`` prints them and marks what was never measured on the planned
device. Pure standard library: the planner imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

CALIBRATION_DIR = Path(__file__).resolve().parent
SOURCES = ("fit", "published", "estimate", "policy")
# the transient terms' factors and workspaces, and the margin: the same names on every device kind
_TRANSIENT_CONSTANTS = (
    "local_spec_activation_factor",
    "engine_activation_factor",
    "train_workspace_bytes",
    "engine_workspace_bytes",
    "heap_retention_bytes",
    "margin_fraction",
)
# the step-time model's (planner/step_time.py), in <kind>_time.json: efficiencies (of a peak) and op factors (in a
# device's op_seconds)
TIME_CONSTANTS = (
    "compute_efficiency",
    "memory_efficiency",
    "vocab_pass_efficiency",  # of memory bandwidth, the [rows, V] fp32 passes reach (their exp and draws compute)
    "host_efficiency",
    "link_efficiency",
    "collective_step_ops",  # one sequential step of a collective (its latency), in op_seconds
    "gloo_collective_factor",  # a rollout's gloo collective over the probe's all-reduce between two idle ranks
    "host_storage_ops",  # one storage an offload copies out (its host buffer's set-up), in op_seconds
    "actor_op_factor",  # seconds of one counted actor forward op over op_seconds
    "actor_backward_op_factor",  # the same for backward's ops
    "native_layer_step_ops",  # one native engine layer's step (decode or prefill), in op_seconds
    "native_step_ops",  # one native engine step (decode or prefill) beyond its layers, in op_seconds
    "vllm_layer_step_ops",  # the same for vLLM
    "vllm_step_ops",  # one vLLM engine step beyond its layers (its scheduler, sampler), in op_seconds
    "param_tensor_ops",  # one parameter tensor in an optimizer step or a weight sync
    "micro_batch_ops",  # one micro-batch's forward or backward beyond the model's ops (schedule, loss)
    "phase_ops",  # one phase's fixed cost (its barrier, its bookkeeping)
)
# every constant the planner reads, per device kind (a calibration file must define all of its kind's)
CONSTANTS: dict[str, tuple[str, ...]] = {
    "cpu": ("runtime_overhead_bytes", "runtime_after_launch_bytes", "vllm_runtime_bytes", *_TRANSIENT_CONSTANTS),
    "cuda": (
        "runtime_overhead_bytes",
        "vllm_cuda_graph_bytes",
        "nccl_bytes_per_communicator",
        "nccl_channels",
        "fused_activation_factor",
        "host_runtime_bytes",
        *_TRANSIENT_CONSTANTS,
    ),
    "cpu_time": TIME_CONSTANTS,
    "cuda_time": TIME_CONSTANTS,
}


@dataclass(frozen=True)
class Constant:
    name: str
    value: float
    uncertainty: float  # +- this much (same unit as value)
    source: str  # fit | published | estimate | policy
    reference: str  # where the figure comes from (a file, a doc, the fit's runs)
    unit: str = "bytes"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"constant {self.name}: source={self.source!r} is not one of {SOURCES}")
        if self.uncertainty < 0:
            raise ValueError(f"constant {self.name}: uncertainty={self.uncertainty} must be >= 0")

    @property
    def measured(self) -> bool:
        """Fitted from runs on this device kind (a published figure or an estimate is not a measurement here)."""
        return self.source == "fit"


@dataclass(frozen=True)
class Calibration:
    device_kind: str
    constants: dict[str, Constant]
    provenance: dict = field(default_factory=dict)
    path: str = ""

    def __post_init__(self) -> None:
        missing = set(CONSTANTS.get(self.device_kind, ())) - set(self.constants)
        if missing:
            raise ValueError(f"calibration {self.path or self.device_kind}: missing constants {sorted(missing)}")

    def __getitem__(self, name: str) -> Constant:
        return self.constants[name]

    def value(self, name: str) -> float:
        return self.constants[name].value

    def with_values(self, **values: float) -> Calibration:
        """A copy with some constants replaced (what ``make calibrate`` writes, and mutation checks)."""
        constants = dict(self.constants)
        for name, value in values.items():
            constants[name] = replace(constants[name], value=value)
        return replace(self, constants=constants)

    def to_json(self) -> dict:
        return {
            "device_kind": self.device_kind,
            "constants": {
                name: {k: v for k, v in vars(c).items() if k != "name"} for name, c in self.constants.items()
            },
            "provenance": self.provenance,
        }


def from_json(data: dict, path: str = "") -> Calibration:
    constants = {name: Constant(name=name, **fields) for name, fields in data["constants"].items()}
    return Calibration(data["device_kind"], constants, data.get("provenance", {}), path)


@cache
def load(device_kind: str) -> Calibration:
    """The calibration file of ``device_kind`` (``cpu`` or ``cuda``)."""
    path = CALIBRATION_DIR / f"{device_kind}.json"
    if not path.exists():
        raise ValueError(f"no calibration file for device kind {device_kind!r} ({path}); run `make calibrate`")
    return from_json(json.loads(path.read_text()), str(path))


def write(calibration: Calibration, path: Path | None = None) -> Path:
    path = path or CALIBRATION_DIR / f"{calibration.device_kind}.json"
    path.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
    load.cache_clear()
    return path
