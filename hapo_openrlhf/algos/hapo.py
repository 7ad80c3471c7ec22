"""HAPO: Hindsight-Aware Policy Optimization, the method this package is built around.

Source: arXiv 2604.11056v1 (where the method is called EAPO), Eq. 6-7; Appendix B.1 gives the
quadrant split, Appendix B Tables 5-6 the run settings; version 2 renamed it HAPO and keeps
alpha = 0.2, phi = 2. In our notation (SPEC 2.3-2.4; docs/method.md, section 3), for the group G of
a prompt, mu_H and sigma_H the mean and population std of the behaviour entropy over the group's
valid response tokens:

    credit_{i,t} = clip((H_{i,t} - mu_H) / sigma_H, -|A_{i,t}| / phi, +|A_{i,t}| / phi)      (Eq. 6)
    A^h_{i,t}    = A_{i,t} + alpha * sign(A_{i,t}) * detach(credit_{i,t})                   (Eq. 7)

so |A^h| / |A| lies in [1 - alpha/phi, 1 + alpha/phi] and the sign is kept iff alpha < phi (the
registration refuses alpha >= phi). A^h replaces A in the clipped surrogate; nothing else changes.

Deviations and additions (each off by default, so the defaults are the published rule):
* sigma_H = 0 (every token of the group at the same entropy) gives credit 0; the paper does not say.
* ``form: multiplicative`` is the project's earlier reconstruction from the paper's prose,
  A * (1 + alpha clip(z, -phi, phi)) (or the ``mean_ratio`` normalisation), kept for comparison
  (docs/method.md, "The earlier reconstruction").
* ``base: dr_grpo`` shapes Dr. GRPO's unnormalised advantage instead of GRPO's.
* ``ablate: [Q, ...]``: tokens of those Four Quadrant Decomposition quadrants keep the plain base
  advantage (the paper's quadrant ablations), with the entropy split ``split`` / ``quantile`` /
  ``threshold`` (the published group mean by default).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .advantages import (ESTIMATORS, AdvantageInputs, AdvantageOutput, broadcast_to_tokens, grpo_sequence_advantage,
                         split_quadrants)
from .groups import group_token_entropy_stats
from .quadrants import DEFAULT_QUANTILE, check_split, normalize_quadrants

HAPO_FORMS = ("additive", "multiplicative")


def _check_hapo(p: Mapping[str, Any]) -> None:
    alpha, phi, form = float(p["alpha"]), float(p["phi"]), p["form"]
    if form not in HAPO_FORMS:
        raise ValueError(f"hapo.form must be one of {list(HAPO_FORMS)}, got {form!r}")
    if not alpha >= 0 or alpha == float("inf"):
        raise ValueError(f"hapo.alpha must be a finite number >= 0, got {alpha}")
    if not phi > 0 or phi == float("inf"):
        raise ValueError(f"hapo.phi must be a finite number > 0, got {phi}")
    if form == "additive" and alpha >= phi:
        raise ValueError(
            f"hapo.alpha ({alpha:g}) must be < hapo.phi ({phi:g}): |A^h|/|A| lies in "
            f"[1 - alpha/phi, 1 + alpha/phi] and alpha >= phi could zero or flip the advantage's "
            f"sign (paper: alpha 0.2, phi 2; its sweep goes up to alpha 1.0)"
        )
    if form == "multiplicative" and alpha * phi >= 1:
        raise ValueError(
            f"hapo.alpha * hapo.phi = {alpha * phi:g} >= 1 with hapo.form: multiplicative: the "
            f"multiplier 1 + alpha*c could reach 0 or flip the advantage's sign; choose alpha*phi < 1"
        )
    if p["normalize"] not in ("zscore", "mean_ratio"):
        raise ValueError(f"hapo.normalize must be 'zscore' or 'mean_ratio', got {p['normalize']!r}")
    if form == "additive" and p["normalize"] != "zscore":
        raise ValueError("hapo.normalize: mean_ratio exists only for hapo.form: multiplicative "
                         "(the published credit is the z-score)")
    if p["base"] not in ("grpo", "dr_grpo"):
        raise ValueError(f"hapo.base must be 'grpo' or 'dr_grpo', got {p['base']!r}")
    normalize_quadrants(p["ablate"])
    check_split(p["split"], p["quantile"], p["threshold"], "hapo.")


def hapo_credit(inputs: AdvantageInputs, base_adv: torch.Tensor, phi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The published entropy credit (arXiv 2604.11056v1, Eq. 6), detached, [B,T]:
    clip((H - mu_H) / sigma_H, -|A|/phi, +|A|/phi), with mu_H, sigma_H over the valid
    tokens of the token's group; sigma_H = 0 gives credit 0. Also returns the bool
    [B,T] mask of tokens whose z-score reached the bound (|z| >= |A|/phi)."""
    mu, sigma = group_token_entropy_stats(inputs.entropy, inputs.response_mask, inputs.group_index)
    H = inputs.entropy.detach().float()
    z = torch.where(sigma > 0, (H - mu) / sigma.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(H))
    bound = base_adv.abs() / phi
    credit = torch.maximum(torch.minimum(z, bound), -bound)
    valid = inputs.response_mask.bool()
    return torch.where(valid, credit, torch.zeros_like(credit)), valid & (z.abs() >= bound)


def hapo_multiplier(inputs: AdvantageInputs, alpha: float, phi: float, normalize: str, eps: float):
    """The pre-publication reconstruction (``form: multiplicative``): 1 + alpha * c with c
    the group-normalised entropy clipped to [-phi, phi] (``zscore``) or H/mu_H clipped to
    [0, phi] (``mean_ratio``), detached. Returns the multiplier [B,T] and the bool [B,T]
    mask of tokens whose c reached a clip bound."""
    mu, sigma = group_token_entropy_stats(inputs.entropy, inputs.response_mask, inputs.group_index)
    H = inputs.entropy.detach().float()
    if normalize == "zscore":
        z = (H - mu) / (sigma + eps)
        return 1.0 + alpha * z.clamp(-phi, phi), z.abs() >= phi
    r = H / (mu + eps)
    return 1.0 + alpha * (r.clamp(0.0, phi) - 1.0), (r <= 0) | (r >= phi)


@ESTIMATORS.register("hapo", validate=_check_hapo)
def hapo(
    inputs: AdvantageInputs,
    *,
    alpha: float = 0.2,
    phi: float = 2.0,
    form: str = "additive",
    normalize: str = "zscore",
    ablate: tuple[str, ...] = (),
    base: str = "grpo",
    split: str = "group_mean",
    quantile: float = DEFAULT_QUANTILE,
    threshold: float | None = None,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """HAPO as published (``form: additive``): A^h = A + alpha * sign(A) * credit, with
    credit = clip((H - mu_H)/sigma_H, -|A|/phi, +|A|/phi) over the token's group, so
    |A^h|/|A| lies in [1 - alpha/phi, 1 + alpha/phi] (sign kept iff alpha < phi).
    ``form: multiplicative`` is the earlier reconstruction A * (1 + alpha*clip(z, -phi, phi)).

    ``ablate`` names quadrants whose tokens keep the plain base advantage; the quadrants
    split entropy by ``split`` (group mean as published, batch ``quantile``, or ``value``).
    """
    seq_adv = grpo_sequence_advantage(inputs, eps, std_normalize=(base == "grpo"))
    base_adv = broadcast_to_tokens(seq_adv, inputs)
    if form == "additive":
        credit, saturated = hapo_credit(inputs, base_adv, phi)
        adv = base_adv + alpha * torch.sign(base_adv) * credit
    else:
        mult, saturated = hapo_multiplier(inputs, alpha, phi, normalize, eps)
        adv = base_adv * mult
    ablated = normalize_quadrants(ablate)
    if ablated:
        masks, _ = split_quadrants(inputs, split, quantile, threshold)
        keep_base = torch.zeros_like(inputs.response_mask, dtype=torch.bool)
        for q in ablated:
            keep_base |= masks[q]
        adv = torch.where(keep_base, base_adv, adv)
        saturated = saturated & ~keep_base
    valid = inputs.response_mask.bool() & (base_adv != 0)
    scale = (adv[valid] / base_adv[valid]).abs()
    n = scale.numel()
    metrics = {
        "hapo/adv_scale_mean": float(scale.mean()) if n else 1.0,
        "hapo/adv_scale_min": float(scale.min()) if n else 1.0,
        "hapo/adv_scale_max": float(scale.max()) if n else 1.0,
        "hapo/credit_saturated_frac": float(saturated[valid].float().mean()) if n else 0.0,
    }
    # padding may hold anything, even NaN entropy: it is 0 here whatever it held
    return AdvantageOutput(torch.where(inputs.response_mask.bool(), adv, torch.zeros_like(adv)), metrics=metrics)
