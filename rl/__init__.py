"""The RL algorithm and its orchestration: configs, data, rewards, losses, the phase loop."""
