"""The implicit process reward model an estimator that ``trains_prm`` reads (PRIME, ``algos/prime.py``):
where its weights and its reference start, the order of its update and scoring, its loss and optimizer.
The names follow the official recipe (verl ``recipe/prime``: ``reward_model.model.*``); the defaults
are its ``run_prime_qwen.sh`` settings. The scale beta is the estimator's (``algorithm.estimator_params.beta``,
the recipe's ``beta_train``): the PRM's loss and the process rewards share it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .base import choices, require

# the recipe's other losses (dpo, bon_acc, bon_rm) need the "reverse" order's broadcast group statistics
NOT_BUILT_LOSSES = ("dpo", "bon_acc", "bon_rm")


@dataclass(frozen=True)
class PRMConfig:
    # a Hugging Face model directory for the PRM's starting weights; null: the policy's weights when RL
    # starts (after any warm-up), as the recipe starts it from the SFT model the policy starts from
    path: str | None = None
    # its frozen reference; null: the PRM's own starting weights (the recipe's ref_path = the SFT model)
    ref_path: str | None = None
    # before: train on the batch, then score it again (the recipe's default, two forwards); after: score
    # it with the update's own forward (one); none: score only, never train
    update: Literal["before", "after", "none"] = "before"
    loss: Literal["ce"] = "ce"  # BCE of sigmoid(beta sum q) against the outcome (compute_ce_dpo_loss_rm)
    lr: float = 1e-6  # constant, as the recipe's
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 10.0
    # responses per PRM optimizer step (the recipe's reward_model.mini_batch_size); null: the whole batch
    mini_batch_size: int | None = None
    micro_batch_size: int = 32  # responses per forward / backward (gradient accumulation)

    def __post_init__(self):
        if self.loss in NOT_BUILT_LOSSES:
            raise ValueError(f"prm.loss {self.loss!r} is one of the recipe's losses this project does not build "
                             f"(dpo, bon_acc and bon_rm need the 'reverse' order's broadcast group statistics): use ce")
        require(self.loss in choices(type(self), "loss"), f"prm.loss must be ce (the recipe's default), got {self.loss!r}")
        require(self.update in choices(type(self), "update"),
                f"prm.update must be before, after or none (the recipe's reward_model.model.update), got {self.update!r}")
        require(math.isfinite(self.lr) and self.lr > 0, f"prm.lr must be a finite number > 0, got {self.lr}")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                f"prm.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "prm.betas must be two values in [0, 1)")
        require(math.isfinite(self.grad_clip) and self.grad_clip > 0,
                f"prm.grad_clip must be a finite number > 0, got {self.grad_clip}")
        require(self.mini_batch_size is None or self.mini_batch_size >= 1,
                f"prm.mini_batch_size must be null (the whole batch) or >= 1, got {self.mini_batch_size}")
        require(self.micro_batch_size >= 1, f"prm.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        for key in ("path", "ref_path"):
            v = getattr(self, key)
            require(v is None or bool(str(v).strip()), f"prm.{key} must be null or a model directory, got {v!r}")


def openrlhf_prm_batches(cfg, world: int) -> tuple[int, int]:
    """On OpenRLHF (``integrations/openrlhf/actors/prm_actor.py``): (responses per PRM optimizer step
    over the group, rows per micro-batch) for a run config ``cfg`` and a PRM group of ``world``
    data-parallel actors. The micro-batches are the experience maker's (``openrlhf.
    micro_rollout_batch_size`` rows: the PRM trains on the micro-batches it scores); a mini-batch
    (``prm.mini_batch_size``, null: the whole rollout batch) must be whole micro-batches on every
    actor -- else one named line."""
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    mini, micro = cfg.prm.mini_batch_size or rows, cfg.openrlhf.micro_rollout_batch_size
    if rows % mini or mini % (micro * world):
        raise ValueError(f"prm.mini_batch_size {mini} must divide the rollout batch ({rows} responses) and be whole "
                         f"micro-batches (openrlhf.micro_rollout_batch_size {micro}) on each of the PRM group's "
                         f"{world} actors")
    return mini, micro
