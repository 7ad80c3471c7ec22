"""Sampling from the embedded families' models: their forward (decoder), the KV-cache sampler,
and ``generate`` -> ``Rollout``; used by the embedded trainer (local/) and the evaluation's Hugging
Face engine (eval/engines.py)."""
