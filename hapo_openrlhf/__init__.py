"""hapo-openrlhf: HAPO, the Four Quadrant Decomposition and GRPO-family baselines
for RL from verifiable rewards. ``hapo_openrlhf.algos`` is the pure-torch core."""

__version__ = "0.1.0"
