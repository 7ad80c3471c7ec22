"""EAPO-entropic (Yeo et al., arXiv 2609.33781, "Surprising Success, Repeated Failure").

Source of truth: wgcyeo/EAPO ``src/trainers/eapo_trainer.py`` (``normalize_token_entropies``,
``eapo_token_advantages``, the kappa schedule in ``_generate_and_score_completions``); the
tests mirror those functions. In our notation, with A_i the GRPO advantage (2.2) and H
the behaviour entropy of every valid response token of the **whole rollout batch** (every
back end computes advantages over the whole batch, so this is every data-parallel rank):

    h = clamp((H - q10) / (q90 - q10 + 1e-8), 0, 1)      q: linearly interpolated percentiles
    r = exp(kappa_t * sign(A_i) * h)     w = r / mean_valid(r)     A^E = A_i * w
    kappa_t = kappa * (1 - min(step / decay_steps, 1))   (decay_steps 0: no decay)

Each response keeps its mean advantage; kappa = 0 is GRPO; failures put the most weight
on their *lowest*-entropy tokens (HAPO: on the highest). No gradient. The reference's
base advantage is TRL's GRPO advantage; ours is the registry's ``grpo`` (same formula,
our ``eps``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .advantages import ESTIMATORS, AdvantageInputs, AdvantageOutput, grpo_sequence_advantage

QUANTILES = (0.10, 0.90)
NORM_EPS = 1e-8  # the reference's normalisation epsilon (percentile spread and mean weight)


def linear_quantile(values: torch.Tensor, q: float, presorted: bool = False) -> torch.Tensor:
    """The q-quantile with linear interpolation (numpy's default), by sorting: no 2^24 input
    limit as in ``torch.quantile``. ``presorted``: ``values`` is sorted already (one sort
    serves both percentiles)."""
    v = values.flatten() if presorted else values.flatten().sort().values
    rank = q * (v.numel() - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return torch.lerp(v[lo], v[hi], rank - lo)


def normalized_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """h in [0, 1] [B,T] (0 off the mask) and the two percentiles of the batch's valid tokens."""
    valid = entropy.detach().float()[mask.bool()]
    if valid.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.float32), math.nan, math.nan
    ordered = valid.sort().values
    q_lo, q_hi = (linear_quantile(ordered, q, presorted=True) for q in QUANTILES)
    h = ((entropy.detach().float() - q_lo) / (q_hi - q_lo + NORM_EPS)).clamp(0.0, 1.0)
    # padding may hold anything (NaN included): it is 0 here, as in the reference
    return torch.where(mask.bool(), h, torch.zeros((), device=h.device)), float(q_lo), float(q_hi)


def kappa_at(kappa: float, decay_steps: int, step: int | None) -> float:
    if decay_steps <= 0:
        return kappa
    if step is None:
        raise ValueError("eapo_entropic.decay_steps > 0 needs the optimizer step (AdvantageInputs.step)")
    return kappa * (1.0 - min(step / decay_steps, 1.0))


def _check(p: Mapping[str, Any]) -> None:
    if not p["kappa"] >= 0:
        raise ValueError(f"eapo_entropic.kappa must be >= 0 (ln 4 = 1.386 is the paper's), got {p['kappa']}")
    if p["decay_steps"] < 0:
        raise ValueError(f"eapo_entropic.decay_steps must be >= 0 (0: no decay), got {p['decay_steps']}")


@ESTIMATORS.register("eapo_entropic", validate=_check)
def eapo_entropic(inputs: AdvantageInputs, *, kappa: float = math.log(4.0), decay_steps: int = 0,
                  eps: float = 1e-6) -> AdvantageOutput:
    """GRPO's A_i spread over the response's tokens by exp(kappa sign(A) h), mean kept."""
    mask = inputs.mask
    h, q_lo, q_hi = normalized_entropy(inputs.entropy, inputs.response_mask)
    k = kappa_at(kappa, decay_steps, inputs.step)
    A = grpo_sequence_advantage(inputs, eps).float().unsqueeze(-1)
    logr = k * torch.sign(A) * h
    r = torch.exp(logr - logr.max(dim=-1, keepdim=True).values)  # a per-row constant: cancels below
    mean_r = (r * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    w = r / mean_r.clamp(min=NORM_EPS) * mask
    valid = mask.bool() & (A != 0)
    w_valid = w[valid]
    metrics = {"eapo/kappa": k, "eapo/entropy_q10": q_lo, "eapo/entropy_q90": q_hi,
               "eapo/weight_min": float(w_valid.min()) if w_valid.numel() else math.nan,
               "eapo/weight_max": float(w_valid.max()) if w_valid.numel() else math.nan}
    return AdvantageOutput(A * w, metrics=metrics)
