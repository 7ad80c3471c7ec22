"""Sampling: prompts and samples per step, temperature, top-p, lengths, the old log-probs' source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import choices, require


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 40
    # under top-p < 1, log rollout/nucleus_logmass on RL steps 1, 1 + N, 1 + 2N, ... (0: never);
    # it costs a sort of every [chunk, V/TP] block of the old-log-prob pass (docs/performance.md)
    nucleus_metric_every: int = 1
    # the embedded trainer's old log-probs, behaviour entropy and nucleus mass: "sampler" (what
    # the sampler computed as it drew, from the same logits; no scoring forward) or "forward"
    # (a separate no-grad forward over the batch, as OpenRLHF recomputes them); they agree to
    # float tolerance (tests/generation/test_sampler.py). Models the sampler does not serve use a forward.
    old_logprobs: Literal["auto", "sampler", "forward"] = "auto"  # auto: sampler on backend local, forward on the others

    def __post_init__(self):
        require(self.prompts_per_step > 0, "rollout.prompts_per_step must be > 0")
        require(self.old_logprobs in choices(type(self), "old_logprobs"),
                 f"rollout.old_logprobs must be auto, sampler or forward, got {self.old_logprobs!r}")
        require(self.samples_per_prompt >= 2, "rollout.samples_per_prompt must be >= 2 (group baselines)")
        require(self.temperature > 0, "rollout.temperature must be > 0")
        require(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        require(self.max_new_tokens > 0, "rollout.max_new_tokens must be > 0")
        require(self.nucleus_metric_every >= 0,
                 f"rollout.nucleus_metric_every must be >= 0 (0: never), got {self.nucleus_metric_every}")
