"""Files, configuration, checkpoints, metrics and the command-line conventions."""
