"""Supervised fine-tuning of a model on prompt/completion rows (the warm start)."""
