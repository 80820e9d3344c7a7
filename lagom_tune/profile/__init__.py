"""Profiling: which points to measure, in what order, and the run folder that keeps them."""
