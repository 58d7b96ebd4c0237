"""tools/speed_probe.py's measurements that start ranks: gloo's all-reduce and exchange between two of them."""

from __future__ import annotations

import pytest

from planner.speed import SpeedSpec
from tests.planner_inputs import CPU_SPEED
from tools.speed_probe import measure_gloo


def test_the_gloo_probe_times_an_all_reduce_an_exchange_and_a_buckets_collectives_between_two_spawned_ranks():
    rates = measure_gloo(calls=20, exchanges=2)
    assert rates["all_reduce_seconds"] > 0 and rates["exchange_bytes_per_s"] > 0
    assert rates["reduce_scatter_bytes_per_s"] > 0 and rates["all_gather_bytes_per_s"] > 0
    # what the probe writes is a speed the model takes
    speed = SpeedSpec(
        **{
            **vars(CPU_SPEED),
            "gloo_all_reduce_seconds": rates["all_reduce_seconds"],
            "gloo_exchange_bytes_per_s": rates["exchange_bytes_per_s"],
            "gloo_reduce_scatter_bytes_per_s": rates["reduce_scatter_bytes_per_s"],
            "gloo_all_gather_bytes_per_s": rates["all_gather_bytes_per_s"],
        }
    )
    assert speed.gloo_exchange_bytes_per_s == rates["exchange_bytes_per_s"]
    with pytest.raises(ValueError, match="calls=0 and exchanges=1 must be >= 1"):
        measure_gloo(calls=0, exchanges=1)
    with pytest.raises(ValueError, match="calls=1 and exchanges=0 must be >= 1"):
        measure_gloo(calls=1, exchanges=0)
    with pytest.raises(ValueError, match="gloo_all_reduce_seconds=0.0 must be > 0"):
        SpeedSpec(**{**vars(CPU_SPEED), "gloo_all_reduce_seconds": 0.0})
    with pytest.raises(ValueError, match="gloo_exchange_bytes_per_s=-1.0 must be > 0"):
        SpeedSpec(**{**vars(CPU_SPEED), "gloo_exchange_bytes_per_s": -1.0})
    with pytest.raises(ValueError, match="gloo_all_gather_bytes_per_s=0.0 must be > 0"):
        SpeedSpec(**{**vars(CPU_SPEED), "gloo_all_gather_bytes_per_s": 0.0})
