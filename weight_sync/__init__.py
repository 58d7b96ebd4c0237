"""Actor -> engine weight sync: plan (pure), execute (bucketed, in place, over a pluggable transport),
verify, and the gather-and-broadcast baseline for the benchmark."""

from weight_sync.execute import SyncStats, execute_sync
from weight_sync.sync import SyncResult, WeightSync, WeightSyncConfig
from weight_sync.transfers import SyncPlan, Transfer, plan_sync
from weight_sync.transport import TorchP2PTransport, Transport

__all__ = [
    "SyncPlan",
    "SyncResult",
    "SyncStats",
    "TorchP2PTransport",
    "Transfer",
    "Transport",
    "WeightSync",
    "WeightSyncConfig",
    "execute_sync",
    "plan_sync",
]
