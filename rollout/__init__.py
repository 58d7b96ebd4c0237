"""Rollout engines behind one protocol; never imports ``megatron_backend``."""
