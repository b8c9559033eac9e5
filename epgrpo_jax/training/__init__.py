"""The run's configuration, the jitted programs and the RL and SFT loops."""
