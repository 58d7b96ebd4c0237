"""The RL algorithm: losses, advantages, batching, the rollout across replicas (``generation``), tasks
and rewards (``data``), evaluation. The run that drives it is :mod:`run`."""
