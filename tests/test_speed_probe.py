"""tools/speed_probe.py's measurement that starts ranks: gloo's all-reduce between two of them."""

from __future__ import annotations

import pytest

from planner.speed import SpeedSpec
from tests.planner_inputs import CPU_SPEED
from tools.speed_probe import gloo_all_reduce_seconds


def test_the_gloo_probe_times_an_all_reduce_between_two_spawned_ranks():
    seconds = gloo_all_reduce_seconds(calls=20)
    assert seconds > 0
    # what the probe writes is a speed the model takes
    assert SpeedSpec(**{**vars(CPU_SPEED), "gloo_all_reduce_seconds": seconds}).gloo_all_reduce_seconds == seconds
    with pytest.raises(ValueError, match="calls=0 must be >= 1"):
        gloo_all_reduce_seconds(calls=0)
    with pytest.raises(ValueError, match="gloo_all_reduce_seconds=0.0 must be > 0"):
        SpeedSpec(**{**vars(CPU_SPEED), "gloo_all_reduce_seconds": 0.0})
