"""Evaluation metrics: unbiased Pass@k and Avg@k."""

from .metrics import avg_at_k, pass_at_k, summarize_samples

__all__ = ["avg_at_k", "pass_at_k", "summarize_samples"]
