"""The components' configs, one keyword-checked dataclass each, below everything that reads them.

``ActorConfig`` (``actor.*``, configs/actor.py) and ``RolloutConfig`` (``rollout.*``, configs/rollout.py) are
read as they are by the component they configure (megatron_backend, rollout) and by the memory planner
(planner/inputs.py::PlanInputs holds them), so a setting has one name and one check. No torch here.
"""

from configs.actor import ActorConfig, OffloadConfig
from configs.rollout import AUTO, RolloutConfig
from configs.step import step_flags

__all__ = ["AUTO", "ActorConfig", "OffloadConfig", "RolloutConfig", "step_flags"]
