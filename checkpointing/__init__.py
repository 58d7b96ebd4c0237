"""A run's checkpoints on disk: their layout, :class:`~checkpointing.checkpoint.RLState`, the
:class:`~checkpointing.checkpoint.Checkpointer`, every rank's RNG/task state, resume and the stop request."""
