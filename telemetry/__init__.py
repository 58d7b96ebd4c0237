"""What a run measures and reports: the memory timeline (``memory_timeline``), its charts
(``memory_charts``), the run's writer to files and W&B (``tracking``), the step's metrics and checks (``metrics``)."""
