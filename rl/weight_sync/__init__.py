"""Actor -> engine weight sync: plan (pure), execute (bucketed, in place), verify, and the baseline."""

from rl.weight_sync.execute import SyncStats, execute_sync
from rl.weight_sync.plan import SyncPlan, Transfer, plan_sync

__all__ = ["SyncPlan", "SyncStats", "Transfer", "execute_sync", "plan_sync"]
