"""Advantage estimators, registered by name: the inputs and outputs every estimator shares, the
sequence-level baselines (GRPO, Dr. GRPO, W-REINF) and the token-level baselines of HAPO's paper
(the quadrant masks, EntroAdv, Forking). HAPO itself is ``algos/hapo.py``; the competing methods
have a module each.

Shape legend: B sequences (G per prompt), T response tokens, K groups.
Every estimator takes one ``AdvantageInputs`` plus keyword-only parameters
and returns an ``AdvantageOutput``: token advantages [B,T] (0 on masked
tokens), an optional loss mask [B,T] (quadrant / forking modes remove tokens
from the loss *and* its normaliser) and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .groups import group_mean_std
from .groups import masked_mean as _masked_mean
from .quadrants import DEFAULT_QUANTILE, check_split, entropy_cut, entropy_threshold, normalize_quadrants, quadrant_masks
from .registry import Registry

# ``trains_prm``: the estimator reads ``AdvantageInputs.process_q``, an implicit process reward
# model's q, so a trainer builds and trains that model (the ``prm`` config section; PRIME)
ESTIMATORS = Registry("advantage estimator", fixed=("inputs",), hooks=("trains_prm",))


@dataclass(frozen=True)
class AdvantageInputs:
    """rewards [B]; response_mask [B,T]; entropy [B,T] (behaviour policy, detached);
    group_index [B] (same value = same prompt); optional logprobs/old_logprobs [B,T];
    optional correct [B] bool (the verifier's outcome, before any length penalty:
    the quadrants' polarity); optional step (optimizer steps so far) and response_ids
    [B,T] (token ids), for the estimators that need them; optional process_q [B,T] (an implicit
    PRM's log pi_phi - log pi_ref per response token: PRIME)."""

    rewards: torch.Tensor
    response_mask: torch.Tensor
    entropy: torch.Tensor
    group_index: torch.Tensor
    logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    # optimizer steps taken before this rollout batch (schedules keyed to the step: EAPO's
    # kappa decay); every back end checkpoints its step, so a resumed schedule is exact
    step: int | None = None
    # the response's token ids [B,T] (LESS matches low-entropy segments across a group)
    response_ids: torch.Tensor | None = None
    # the implicit process reward model's q per response token [B,T] (algos/prime.py)
    process_q: torch.Tensor | None = None

    def __post_init__(self):
        m = self.response_mask
        if m.dim() != 2:
            raise ValueError(f"response_mask must be [B, T], got shape {tuple(m.shape)}")
        B = m.shape[0]
        for name in ("rewards", "group_index", "correct"):
            t = getattr(self, name)
            if t is None and name == "correct":
                continue
            if t.dim() != 1 or t.shape[0] != B:
                raise ValueError(f"{name} must be [B]=[{B}], got shape {tuple(t.shape)}")
        for name in ("entropy", "logprobs", "old_logprobs", "response_ids", "process_q"):
            t = getattr(self, name)
            if t is not None and t.shape != m.shape:
                raise ValueError(f"{name} must be [B, T]={tuple(m.shape)}, got {tuple(t.shape)}")
        if not bool(torch.isfinite(self.rewards).all()):
            raise ValueError("rewards contain NaN/inf")

    @property
    def mask(self) -> torch.Tensor:
        return self.response_mask.to(torch.float32)


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor
    loss_mask: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def compute_advantages(name: str, inputs: AdvantageInputs, **params: Any) -> torch.Tensor:
    """Token advantages [B,T] from the estimator registered as ``name``."""
    return run_estimator(name, inputs, **params).advantages


def run_estimator(name: str, inputs: AdvantageInputs, **params: Any) -> AdvantageOutput:
    """Like ``compute_advantages`` but also returns the loss mask and metrics."""
    if not isinstance(inputs, AdvantageInputs):
        raise ValueError(f"inputs must be an AdvantageInputs, got {type(inputs).__name__}")
    return ESTIMATORS.call(name, inputs=inputs, **params)


def list_estimators() -> list[str]:
    return ESTIMATORS.names()


# --------------------------------------------------------------------- helpers
def grpo_sequence_advantage(inputs: AdvantageInputs, eps: float = 1e-6, std_normalize: bool = True):
    """A_i = (r_i - mean_G r) / (std_G r + eps), or r_i - mean_G r (Dr. GRPO). Returns [B]."""
    r = inputs.rewards.float()
    mean, std = group_mean_std(r, inputs.group_index)
    centred = r - mean
    if not std_normalize:
        return centred
    # zero-variance groups: centred is exactly 0, so A is 0 whatever eps is
    return centred / (std + eps)


def broadcast_to_tokens(adv_B: torch.Tensor, inputs: AdvantageInputs) -> torch.Tensor:
    """A sequence advantage [B] on every valid response token [B,T] (0 on padding)."""
    return adv_B.unsqueeze(-1) * inputs.mask


def outcome_polarity(inputs: AdvantageInputs) -> torch.Tensor:
    """[B]: +1 for a correct response, -1 for an incorrect one (the paper's polarity).
    Without ``inputs.correct``, the sign of the GRPO advantage stands in for it: the
    same wherever a group's binary rewards differ, 0 (no quadrant) where they do not."""
    if inputs.correct is not None:
        c = inputs.correct.bool()
        return torch.where(c, torch.ones_like(c, dtype=torch.float32), -torch.ones_like(c, dtype=torch.float32))
    return torch.sign(grpo_sequence_advantage(inputs))


def split_quadrants(
    inputs: AdvantageInputs, split: str, quantile: float, threshold: float | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Quadrant masks [B,T] (outcome polarity x entropy split) and the cut tau."""
    tau = entropy_cut(inputs.entropy, inputs.response_mask, inputs.group_index,
                      split=split, quantile=quantile, threshold=threshold)
    return quadrant_masks(outcome_polarity(inputs), inputs.entropy, inputs.response_mask, tau), tau


# ------------------------------------------------------------------ estimators
@ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs, *, eps: float = 1e-6) -> AdvantageOutput:
    """GRPO: group-normalised outcome reward broadcast to every response token."""
    return AdvantageOutput(broadcast_to_tokens(grpo_sequence_advantage(inputs, eps), inputs))


@ESTIMATORS.register("dr_grpo")
def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutput:
    """Dr. GRPO: A = r - mean_G r (no std division); pair with seq-mean-token-sum-norm."""
    return AdvantageOutput(broadcast_to_tokens(grpo_sequence_advantage(inputs, std_normalize=False), inputs))


def _check_quadrant(p: Mapping[str, Any]) -> None:
    if not normalize_quadrants(p["quadrants"]):
        raise ValueError("quadrant.quadrants must name at least one of PHR, PLR, NHR, NLR")
    if p["base"] not in ("grpo", "dr_grpo"):
        raise ValueError(f"quadrant.base must be 'grpo' or 'dr_grpo', got {p['base']!r}")
    check_split(p["split"], p["quantile"], p["threshold"], "quadrant.")


@ESTIMATORS.register("quadrant", validate=_check_quadrant)
def quadrant(
    inputs: AdvantageInputs,
    *,
    quadrants: tuple[str, ...] = ("PHR",),
    base: str = "grpo",
    split: str = "group_mean",
    quantile: float = DEFAULT_QUANTILE,
    threshold: float | None = None,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """Hard quadrant mask: only tokens of the named quadrants carry gradient and count
    in the loss normaliser; the rest (and every token of a zero-advantage group) are
    removed from the loss mask. Polarity is the outcome; the entropy split is ``split``."""
    seq_adv = grpo_sequence_advantage(inputs, eps, std_normalize=(base == "grpo"))
    masks, tau = split_quadrants(inputs, split, quantile, threshold)
    keep = torch.zeros_like(inputs.response_mask, dtype=torch.bool)
    for q in normalize_quadrants(quadrants):
        keep |= masks[q]
    keep &= (seq_adv != 0).unsqueeze(-1)
    adv = broadcast_to_tokens(seq_adv, inputs) * keep
    n = max(int(inputs.response_mask.bool().sum()), 1)
    metrics = {"quadrant/train_token_frac": int(keep.sum()) / n,
               "quadrant/train_threshold": float(tau.float().mean())}
    return AdvantageOutput(adv, loss_mask=keep.to(inputs.response_mask.dtype), metrics=metrics)


@ESTIMATORS.register("w_reinf")
def w_reinf(
    inputs: AdvantageInputs, *, lam: float = 0.1, correct_threshold: float = 0.5
) -> AdvantageOutput:
    """Weighted REINFORCE (Zhu et al. 2025): +lam for correct, -1 for incorrect, no baseline."""
    correct = inputs.rewards >= correct_threshold
    r = inputs.rewards.float()
    seq = torch.where(correct, torch.full_like(r, lam), torch.full_like(r, -1.0))
    return AdvantageOutput(broadcast_to_tokens(seq.float(), inputs))


@ESTIMATORS.register("entro_adv")
def entro_adv(
    inputs: AdvantageInputs, *, alpha: float = 0.4, kappa: float = 2.0, eps: float = 1e-6
) -> AdvantageOutput:
    """Entropy advantage (Cheng et al. 2025): A + min(alpha * detach(H), |A| / kappa)."""
    if kappa <= 1:
        raise ValueError(f"entro_adv.kappa must be > 1 to keep the sign of A, got {kappa}")
    A = broadcast_to_tokens(grpo_sequence_advantage(inputs, eps), inputs)
    bonus = torch.minimum(alpha * inputs.entropy.detach().float(), A.abs() / kappa)
    adv = (A + bonus) * inputs.mask
    return AdvantageOutput(adv, metrics={"entro_adv/bonus_mean": float(_masked_mean(bonus, inputs.mask))})


@ESTIMATORS.register("forking")
def forking(
    inputs: AdvantageInputs, *, rho: float = 0.2, eps: float = 1e-6
) -> AdvantageOutput:
    """80/20 forking tokens (Wang et al. 2025): gradient only on the top-rho entropy
    tokens of the batch; the others leave the loss and its normaliser."""
    if not 0 < rho <= 1:
        raise ValueError(f"forking.rho must be in (0, 1], got {rho}")
    tau = entropy_threshold(inputs.entropy, inputs.response_mask, quantile=1.0 - rho)
    keep = inputs.response_mask.bool() & (inputs.entropy.detach() >= tau)
    adv = broadcast_to_tokens(grpo_sequence_advantage(inputs, eps), inputs) * keep
    n = max(int(inputs.response_mask.bool().sum()), 1)
    return AdvantageOutput(
        adv,
        loss_mask=keep.to(inputs.response_mask.dtype),
        metrics={"forking/token_frac": int(keep.sum()) / n, "forking/threshold": float(tau)},
    )
