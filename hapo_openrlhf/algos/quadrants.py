"""Four Quadrant Decomposition: reward polarity x token entropy.

Shape legend: B sequences, T tokens. ``polarity_B`` is the sign of the
group-normalised (sequence) advantage: +1 positive, -1 negative, 0 neither.

Quadrants: PHR (positive, high entropy), PLR (positive, low), NHR (negative,
high), NLR (negative, low). High entropy means H >= tau, with tau by default
the 80th percentile of H over the batch's valid tokens.
"""

from __future__ import annotations

import math

import torch

QUADRANTS = ("PHR", "PLR", "NHR", "NLR")
DEFAULT_QUANTILE = 0.8


def normalize_quadrants(names) -> tuple[str, ...]:
    """Accept "PHR", ["PHR", "NLR"], ("all",) ...; return a validated tuple."""
    if names is None:
        return ()
    if isinstance(names, str):
        names = [names]
    out = []
    for n in names:
        n = str(n).upper()
        if n == "ALL":
            out.extend(QUADRANTS)
            continue
        if n not in QUADRANTS:
            raise ValueError(f"unknown quadrant {n!r}; expected a subset of {list(QUADRANTS)}")
        out.append(n)
    return tuple(dict.fromkeys(out))


def entropy_threshold(
    entropy_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    quantile: float | None = DEFAULT_QUANTILE,
    value: float | None = None,
) -> torch.Tensor:
    """tau: a fixed ``value``, or the ``quantile`` of H over valid tokens, chosen so
    that exactly the top ceil((1 - quantile) * N) tokens (ties aside) have H >= tau."""
    if value is not None:
        return torch.as_tensor(float(value))
    if quantile is None or not 0.0 <= quantile <= 1.0:
        raise ValueError(f"entropy quantile must be in [0, 1], got {quantile}")
    valid = entropy_BT.detach()[mask_BT.bool()].float()
    n = valid.numel()
    if n == 0:
        return torch.tensor(float("inf"))
    n_high = min(n, max(1, math.ceil(round((1.0 - quantile) * n, 6))))
    return valid.kthvalue(n - n_high + 1).values


def polarity_from_advantages(adv: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Sequence polarity [B] from token or sequence advantages ([B,T] or [B])."""
    if adv.dim() == 2:
        # any valid token carries the broadcast sequence value; sum is sign-safe
        adv = (adv * mask_BT).sum(-1)
    return torch.sign(adv)


def quadrant_masks(
    polarity_B: torch.Tensor, entropy_BT: torch.Tensor, mask_BT: torch.Tensor, tau: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Boolean [B,T] masks per quadrant; padding and zero-polarity tokens are in none."""
    valid = mask_BT.bool()
    pos = (polarity_B > 0).unsqueeze(-1) & valid
    neg = (polarity_B < 0).unsqueeze(-1) & valid
    high = entropy_BT.detach() >= tau
    return {"PHR": pos & high, "PLR": pos & ~high, "NHR": neg & high, "NLR": neg & ~high}


def quadrant_metrics(
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float | torch.Tensor | None = None,
    *,
    quantile: float = DEFAULT_QUANTILE,
    polarity: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-quadrant token share, mean entropy, sum and mean of |A|.

    advantages/entropy/response_mask: [B,T]. ``threshold`` is tau (default:
    the ``quantile`` of H over valid tokens). ``polarity`` [B] defaults to the
    sign of ``advantages``. Token shares are over all valid tokens, so they sum
    to 1 - ``quadrant/zero_adv_frac``.
    """
    _check_bt("advantages", advantages, response_mask)
    _check_bt("entropy", entropy, response_mask)
    tau = (
        entropy_threshold(entropy, response_mask, quantile=quantile)
        if threshold is None
        else torch.as_tensor(threshold)
    )
    pol = polarity if polarity is not None else polarity_from_advantages(advantages, response_mask)
    masks = quadrant_masks(pol, entropy, response_mask, tau)
    n_valid = max(int(response_mask.bool().sum()), 1)
    abs_adv = advantages.detach().abs().float()
    out: dict[str, float] = {"quadrant/threshold": float(tau)}
    covered = torch.zeros_like(response_mask, dtype=torch.bool)
    for q, m in masks.items():
        n = int(m.sum())
        covered |= m
        out[f"quadrant/{q}/token_frac"] = n / n_valid
        out[f"quadrant/{q}/entropy_mean"] = float(entropy.detach()[m].float().mean()) if n else 0.0
        out[f"quadrant/{q}/adv_abs_sum"] = float(abs_adv[m].sum())
        out[f"quadrant/{q}/adv_abs_mean"] = float(abs_adv[m].mean()) if n else 0.0
    out["quadrant/zero_adv_frac"] = 1.0 - int(covered.sum()) / n_valid
    return out


def quadrant_entropy_change(
    masks: dict[str, torch.Tensor], entropy_before: torch.Tensor, entropy_after: torch.Tensor
) -> dict[str, float]:
    """Mean H_after - H_before per quadrant (same tokens, re-scored after the update)."""
    delta = (entropy_after.detach() - entropy_before.detach()).float()
    return {
        f"quadrant/{q}/entropy_delta": float(delta[m].mean()) if bool(m.any()) else 0.0
        for q, m in masks.items()
    }


def _check_bt(name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
    if t.shape != mask.shape or t.dim() != 2:
        raise ValueError(
            f"{name} must be [B, T] like response_mask {tuple(mask.shape)}, got {tuple(t.shape)}"
        )
