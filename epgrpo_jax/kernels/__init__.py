"""Hand-written kernels that XLA calls (CPU only)."""
