"""Plots and the token heat map of runs."""
