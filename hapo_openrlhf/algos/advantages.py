"""Advantage estimators, registered by name.

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

from .quadrants import DEFAULT_QUANTILE, entropy_threshold, normalize_quadrants, quadrant_masks
from .registry import Registry

ESTIMATORS = Registry("advantage estimator", fixed=("inputs",))


@dataclass(frozen=True)
class AdvantageInputs:
    """rewards [B]; response_mask [B,T]; entropy [B,T] (behaviour policy, detached);
    group_index [B] (same value = same prompt); optional logprobs/old_logprobs [B,T]."""

    rewards: torch.Tensor
    response_mask: torch.Tensor
    entropy: torch.Tensor
    group_index: torch.Tensor
    logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None

    def __post_init__(self):
        m = self.response_mask
        if m.dim() != 2:
            raise ValueError(f"response_mask must be [B, T], got shape {tuple(m.shape)}")
        B = m.shape[0]
        for name in ("rewards", "group_index"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != B:
                raise ValueError(f"{name} must be [B]=[{B}], got shape {tuple(t.shape)}")
        for name in ("entropy", "logprobs", "old_logprobs"):
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
def _group_ids(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inv = torch.unique(group_index, return_inverse=True)
    return inv, int(inv.max()) + 1 if inv.numel() else 0


def group_mean_std(values_B: torch.Tensor, group_index: torch.Tensor, unbiased: bool = True):
    """Per-sequence mean and std of its group's values ([B] each). Singleton groups: std 0."""
    gid, K = _group_ids(group_index)
    v = values_B.double()
    cnt = torch.zeros(K, dtype=torch.float64).index_add_(0, gid, torch.ones_like(v))
    mean = torch.zeros(K, dtype=torch.float64).index_add_(0, gid, v) / cnt
    sq = torch.zeros(K, dtype=torch.float64).index_add_(0, gid, (v - mean[gid]) ** 2)
    denom = (cnt - 1).clamp(min=1) if unbiased else cnt
    std = torch.where(cnt > 1, (sq / denom).sqrt(), torch.zeros_like(sq))
    return mean[gid].to(values_B.dtype), std[gid].to(values_B.dtype)


def grpo_sequence_advantage(inputs: AdvantageInputs, eps: float = 1e-6, std_normalize: bool = True):
    """A_i = (r_i - mean_G r) / (std_G r + eps), or r_i - mean_G r (Dr. GRPO). Returns [B]."""
    r = inputs.rewards.float()
    mean, std = group_mean_std(r, inputs.group_index)
    centred = r - mean
    if not std_normalize:
        return centred
    # zero-variance groups: centred is exactly 0, so A is 0 whatever eps is
    return centred / (std + eps)


def _broadcast(adv_B: torch.Tensor, inputs: AdvantageInputs) -> torch.Tensor:
    return adv_B.unsqueeze(-1) * inputs.mask


def group_token_entropy_stats(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """mu_G, sigma_G of H over all valid tokens of each sequence's group, as [B,1]."""
    gid, K = _group_ids(inputs.group_index)
    m = inputs.mask.double()
    H = inputs.entropy.detach().double() * m
    cnt = torch.zeros(K, dtype=torch.float64).index_add_(0, gid, m.sum(-1))
    s1 = torch.zeros(K, dtype=torch.float64).index_add_(0, gid, H.sum(-1))
    mu = s1 / cnt.clamp(min=1)
    dev = ((inputs.entropy.detach().double() - mu[gid].unsqueeze(-1)) ** 2) * m
    s2 = torch.zeros(K, dtype=torch.float64).index_add_(0, gid, dev.sum(-1))
    sigma = (s2 / cnt.clamp(min=1)).sqrt()
    return mu[gid].unsqueeze(-1).float(), sigma[gid].unsqueeze(-1).float()


def _quadrant_token_masks(inputs, polarity_B, threshold, quantile):
    tau = entropy_threshold(inputs.entropy, inputs.response_mask, quantile=quantile, value=threshold)
    return quadrant_masks(polarity_B, inputs.entropy, inputs.response_mask, tau), tau


# ------------------------------------------------------------------ estimators
@ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs, *, eps: float = 1e-6) -> AdvantageOutput:
    """GRPO: group-normalised outcome reward broadcast to every response token."""
    return AdvantageOutput(_broadcast(grpo_sequence_advantage(inputs, eps), inputs))


@ESTIMATORS.register("dr_grpo")
def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutput:
    """Dr. GRPO: A = r - mean_G r (no std division); pair with seq-mean-token-sum-norm."""
    return AdvantageOutput(_broadcast(grpo_sequence_advantage(inputs, std_normalize=False), inputs))


def _check_hapo(p: Mapping[str, Any]) -> None:
    alpha, phi = float(p["alpha"]), float(p["phi"])
    if alpha < 0:
        raise ValueError(f"hapo.alpha must be >= 0, got {alpha}")
    if phi <= 0:
        raise ValueError(f"hapo.phi must be > 0, got {phi}")
    if alpha * phi >= 1:
        raise ValueError(
            f"hapo.alpha * hapo.phi = {alpha * phi:g} >= 1: the multiplier 1 + alpha*c could "
            f"reach 0 or flip the advantage's sign; choose alpha*phi < 1 (paper: 0.2 * 2)"
        )
    if p["normalize"] not in ("zscore", "mean_ratio"):
        raise ValueError(f"hapo.normalize must be 'zscore' or 'mean_ratio', got {p['normalize']!r}")
    if p["base"] not in ("grpo", "dr_grpo"):
        raise ValueError(f"hapo.base must be 'grpo' or 'dr_grpo', got {p['base']!r}")
    normalize_quadrants(p["ablate"])


def hapo_multiplier(inputs: AdvantageInputs, alpha: float, phi: float, normalize: str, eps: float):
    """1 + alpha * c with c the clipped, group-normalised entropy (detached). [B,T]."""
    mu, sigma = group_token_entropy_stats(inputs)
    H = inputs.entropy.detach().float()
    if normalize == "zscore":
        c = ((H - mu) / (sigma + eps)).clamp(-phi, phi)
        return 1.0 + alpha * c
    c = (H / (mu + eps)).clamp(0.0, phi)
    return 1.0 + alpha * (c - 1.0)


@ESTIMATORS.register("hapo", validate=_check_hapo)
def hapo(
    inputs: AdvantageInputs,
    *,
    alpha: float = 0.2,
    phi: float = 2.0,
    normalize: str = "zscore",
    ablate: tuple[str, ...] = (),
    base: str = "grpo",
    threshold: float | None = None,
    quantile: float = DEFAULT_QUANTILE,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """HAPO: A^h = A * (1 + alpha * clip(z(H), -phi, phi)), sign-preserving (alpha*phi < 1).

    ``ablate`` names quadrants whose tokens keep the plain base advantage;
    ``threshold``/``quantile`` define the high-entropy cut used by ``ablate``.
    """
    seq_adv = grpo_sequence_advantage(inputs, eps, std_normalize=(base == "grpo"))
    base_adv = _broadcast(seq_adv, inputs)
    mult = hapo_multiplier(inputs, alpha, phi, normalize, eps)
    ablated = normalize_quadrants(ablate)
    if ablated:
        masks, _ = _quadrant_token_masks(inputs, torch.sign(seq_adv), threshold, quantile)
        keep_base = torch.zeros_like(inputs.response_mask, dtype=torch.bool)
        for q in ablated:
            keep_base |= masks[q]
        mult = torch.where(keep_base, torch.ones_like(mult), mult)
    adv = base_adv * mult
    valid = inputs.response_mask.bool() & (base_adv != 0)
    m = mult[valid]
    metrics = {
        "hapo/adv_scale_mean": float(m.mean()) if m.numel() else 1.0,
        "hapo/adv_scale_min": float(m.min()) if m.numel() else 1.0,
        "hapo/adv_scale_max": float(m.max()) if m.numel() else 1.0,
    }
    return AdvantageOutput(adv, metrics=metrics)


def _check_quadrant(p: Mapping[str, Any]) -> None:
    if not normalize_quadrants(p["quadrants"]):
        raise ValueError("quadrant.quadrants must name at least one of PHR, PLR, NHR, NLR")
    if p["base"] not in ("grpo", "dr_grpo"):
        raise ValueError(f"quadrant.base must be 'grpo' or 'dr_grpo', got {p['base']!r}")


@ESTIMATORS.register("quadrant", validate=_check_quadrant)
def quadrant(
    inputs: AdvantageInputs,
    *,
    quadrants: tuple[str, ...] = ("PHR",),
    base: str = "grpo",
    threshold: float | None = None,
    quantile: float = DEFAULT_QUANTILE,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """Hard quadrant mask: only tokens of the named quadrants carry gradient and count
    in the loss normaliser; the rest are removed from the loss mask."""
    seq_adv = grpo_sequence_advantage(inputs, eps, std_normalize=(base == "grpo"))
    masks, tau = _quadrant_token_masks(inputs, torch.sign(seq_adv), threshold, quantile)
    keep = torch.zeros_like(inputs.response_mask, dtype=torch.bool)
    for q in normalize_quadrants(quadrants):
        keep |= masks[q]
    adv = _broadcast(seq_adv, inputs) * keep
    n = max(int(inputs.response_mask.bool().sum()), 1)
    metrics = {"quadrant/train_token_frac": int(keep.sum()) / n, "quadrant/train_threshold": float(tau)}
    return AdvantageOutput(adv, loss_mask=keep.to(inputs.response_mask.dtype), metrics=metrics)


@ESTIMATORS.register("w_reinf")
def w_reinf(
    inputs: AdvantageInputs, *, lam: float = 0.1, correct_threshold: float = 0.5
) -> AdvantageOutput:
    """Weighted REINFORCE (Zhu et al. 2025): +lam for correct, -1 for incorrect, no baseline."""
    correct = inputs.rewards >= correct_threshold
    seq = torch.where(correct, torch.full_like(inputs.rewards, lam, dtype=torch.float32), -1.0)
    return AdvantageOutput(_broadcast(seq.float(), inputs))


@ESTIMATORS.register("entro_adv")
def entro_adv(
    inputs: AdvantageInputs, *, alpha: float = 0.4, kappa: float = 2.0, eps: float = 1e-6
) -> AdvantageOutput:
    """Entropy advantage (Cheng et al. 2025): A + min(alpha * detach(H), |A| / kappa)."""
    if kappa <= 1:
        raise ValueError(f"entro_adv.kappa must be > 1 to keep the sign of A, got {kappa}")
    A = _broadcast(grpo_sequence_advantage(inputs, eps), inputs)
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
    adv = _broadcast(grpo_sequence_advantage(inputs, eps), inputs) * keep
    n = max(int(inputs.response_mask.bool().sum()), 1)
    return AdvantageOutput(
        adv,
        loss_mask=keep.to(inputs.response_mask.dtype),
        metrics={"forking/token_frac": int(keep.sum()) / n, "forking/threshold": float(tau)},
    )


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)
