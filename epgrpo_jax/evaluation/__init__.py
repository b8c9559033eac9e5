"""Held-out evaluation: sampling and scoring problems (Acc, Fmt, pass@k), the benchmark table,
and a training run's checkpoint restored as a policy to evaluate."""
