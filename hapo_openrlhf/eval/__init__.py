"""Evaluation: unbiased Pass@k and Avg@k, the benchmark harness behind `hapo eval`."""

from .metrics import avg_at_k, pass_at_k, summarize_samples

__all__ = ["avg_at_k", "pass_at_k", "summarize_samples"]
