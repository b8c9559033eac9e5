"""Training examples, prompts, batches and the evaluation benchmarks."""
