"""The optimizer, the trainer's steps and checkpoints, the held-out evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import require
from .model_data import _optional_seed


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = 0
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    micro_batch_size: int = 32
    # optimizer steps in a row with a non-finite gradient (each skipped) before the run stops
    # (every back end; hapo_openrlhf/grad_guard.py)
    max_consecutive_skips: int = 3

    def __post_init__(self):
        require(math.isfinite(self.lr) and self.lr > 0, f"optim.lr must be a finite number > 0, got {self.lr}")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay must be >= 0")
        require(self.lr_warmup_steps >= 0, f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas must be two values in [0, 1)")
        require(self.ppo_epochs >= 1 and self.micro_batch_size >= 1, "optim.ppo_epochs and optim.micro_batch_size must be >= 1")
        require(math.isfinite(self.grad_clip) and self.grad_clip > 0, "optim.grad_clip must be a finite number > 0")
        require(self.max_consecutive_skips >= 1,
                 f"optim.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = 60
    eval_every: int = 0  # 0: only before and after RL
    save_every: int = 10
    keep_last: int = 2
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    sample_every: int = 10  # dump token-level samples (token-credit view) every N steps; 0: never
    sample_count: int = 16
    # the embedded trainer's re-scoring of the step's tokens after the update (one no-grad forward):
    # actor/entropy_after and quadrant/Q/entropy_delta on RL steps 1, 1 + N, ...; 0: never
    entropy_change_every: int = 1

    def __post_init__(self):
        require(self.steps >= 0, "trainer.steps must be >= 0")
        require(self.save_every >= 0 and self.eval_every >= 0, "trainer.save_every/eval_every must be >= 0")
        require(self.keep_last >= 1, "trainer.keep_last must be >= 1")
        require(self.threads >= 0, f"trainer.threads must be >= 0 (0: torch's default), got {self.threads}")
        require(self.sample_every >= 0, f"trainer.sample_every must be >= 0 (0: never), got {self.sample_every}")
        require(self.sample_count >= 0, f"trainer.sample_count must be >= 0, got {self.sample_count}")
        require(self.entropy_change_every >= 0,
                f"trainer.entropy_change_every must be >= 0 (0: never), got {self.entropy_change_every}")


# samples per problem (Avg@k / Pass@k): the papers use k <= 64; more is a typo that would
# allocate k x problems x tokens before the first evaluation
MAX_SAMPLES = 4096


# a response budget: beyond any model this project trains (DeepScaleR's contexts are 24k)
MAX_NEW_TOKENS = 1 << 20


@dataclass(frozen=True)
class EvalConfig:
    temperature: float = 0.6
    top_p: float = 0.95
    n_samples: int = 4
    max_new_tokens: int = 40
    # the sampling seed of held-out evaluations; none: the run's seed + 99. A fixed seed gives
    # every run of an experiment the same sampling stream (common random numbers), so runs
    # from one warm start share its evaluation and paired differences lose that noise
    seed: int | None = None

    def __post_init__(self):
        require(1 <= self.n_samples <= MAX_SAMPLES, f"eval.n_samples must be in [1, {MAX_SAMPLES}], got {self.n_samples}")
        require(self.temperature > 0 and 0 < self.top_p <= 1, "eval: temperature > 0, top_p in (0, 1]")
        require(1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
                 f"eval.max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        require(_optional_seed(self.seed), f"eval.seed must be none or an integer >= 0, got {self.seed!r}")
