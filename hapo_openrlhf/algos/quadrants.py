"""Four Quadrant Decomposition: reward polarity x token entropy.

Shape legend: B sequences, T tokens. ``polarity_B`` is the response's outcome:
+1 correct (positive), -1 incorrect (negative); 0 puts a sequence in no quadrant.

Quadrants: PHR (positive, high entropy), PLR (positive, low), NHR (negative,
high), NLR (negative, low). High entropy means H >= tau where, as published
(arXiv 2604.11056v1, App. B.1), tau is the mean token entropy mu_H of the
token's group (``split="group_mean"``, a [B,1] tau). Two options remain: the
``quantile`` of H over the batch's valid tokens (``split="quantile"``, the
project's earlier rule; 0.8 = top 20%) and a fixed ``value``.
"""

from __future__ import annotations

import math

import torch

from .groups import group_token_entropy_stats

QUADRANTS = ("PHR", "PLR", "NHR", "NLR")
DEFAULT_QUANTILE = 0.8
SPLITS = ("group_mean", "quantile", "value")


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
        return torch.tensor(float(value), device=entropy_BT.device)
    if quantile is None or not 0.0 <= quantile <= 1.0:
        raise ValueError(f"entropy quantile must be in [0, 1], got {quantile}")
    valid = entropy_BT.detach()[mask_BT.bool()].float()
    n = valid.numel()
    if n == 0:
        return torch.tensor(float("inf"), device=entropy_BT.device)
    n_high = min(n, max(1, math.ceil(round((1.0 - quantile) * n, 6))))
    return valid.kthvalue(n - n_high + 1).values


def check_split(split: str, quantile: float | None, threshold: float | None, key: str) -> None:
    """Validate a split setting; ``key`` names the config keys in the error."""
    if split not in SPLITS:
        raise ValueError(f"{key}split must be one of {list(SPLITS)}, got {split!r}")
    if split == "value" and threshold is None:
        raise ValueError(f"{key}split 'value' needs {key}threshold (a fixed entropy cut)")
    if split != "value" and threshold is not None:
        raise ValueError(f"{key}threshold is only used with {key}split: value (got split {split!r})")
    if split == "quantile" and (quantile is None or not 0.0 < float(quantile) < 1.0):
        raise ValueError(f"{key}quantile must be in (0, 1), got {quantile}")


def entropy_cut(
    entropy_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    group_index_B: torch.Tensor | None = None,
    *,
    split: str = "group_mean",
    quantile: float = DEFAULT_QUANTILE,
    threshold: float | None = None,
) -> torch.Tensor:
    """tau for ``high = H >= tau``: [B,1] group means (``group_mean``, needs
    ``group_index_B``), or a scalar (``quantile`` of the batch, or a fixed ``value``)."""
    check_split(split, quantile, threshold, "")
    if split == "group_mean":
        if group_index_B is None:
            raise ValueError("split 'group_mean' needs the group index of every sequence")
        return group_token_entropy_stats(entropy_BT, mask_BT, group_index_B)[0]
    if split == "value":
        return entropy_threshold(entropy_BT, mask_BT, value=threshold)
    return entropy_threshold(entropy_BT, mask_BT, quantile=quantile)


def polarity_from_advantages(adv: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Sequence polarity [B] from token or sequence advantages ([B,T] or [B])."""
    if adv.dim() == 2:
        # any valid token carries the broadcast sequence value; sum is sign-safe
        adv = (adv * mask_BT).sum(-1)
    return torch.sign(adv)


def quadrant_masks(
    polarity_B: torch.Tensor, entropy_BT: torch.Tensor, mask_BT: torch.Tensor, tau: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Boolean [B,T] masks per quadrant; padding and zero-polarity tokens are in none.
    ``tau`` is a scalar or a [B,1] per-sequence cut (its group's mean entropy)."""
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

    advantages/entropy/response_mask: [B,T]. ``threshold`` is tau, a scalar or a
    [B,1] per-sequence cut (default: the ``quantile`` of H over valid tokens).
    ``polarity`` [B] (the outcome, +1 / -1) defaults to the sign of ``advantages``.
    Token shares are over all valid tokens; with an outcome polarity they sum to 1.
    ``quadrant/high_frac`` is the share of valid tokens with H >= tau,
    ``quadrant/zero_adv_frac`` the share whose advantage is 0 (degenerate groups).
    """
    _check_bt("advantages", advantages, response_mask)
    _check_bt("entropy", entropy, response_mask)
    tau = (
        entropy_threshold(entropy, response_mask, quantile=quantile)
        if threshold is None
        else torch.as_tensor(threshold, device=entropy.device)
    )
    pol = polarity if polarity is not None else polarity_from_advantages(advantages, response_mask)
    masks = quadrant_masks(pol, entropy, response_mask, tau)
    valid = response_mask.bool()
    n_valid = max(int(valid.sum()), 1)
    abs_adv = advantages.detach().abs().float()
    out: dict[str, float] = {
        "quadrant/threshold": float(tau.float().mean()),
        "quadrant/high_frac": int((valid & (entropy.detach() >= tau)).sum()) / n_valid,
        "quadrant/zero_adv_frac": int((valid & (advantages.detach() == 0)).sum()) / n_valid,
    }
    for q, m in masks.items():
        n = int(m.sum())
        out[f"quadrant/{q}/token_frac"] = n / n_valid
        out[f"quadrant/{q}/entropy_mean"] = float(entropy.detach()[m].float().mean()) if n else 0.0
        out[f"quadrant/{q}/adv_abs_sum"] = float(abs_adv[m].sum())
        out[f"quadrant/{q}/adv_abs_mean"] = float(abs_adv[m].mean()) if n else 0.0
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
