"""PAEC (Yang et al., arXiv 2606.08543): a lower bound on the entropy of selected positions.

Source: the abstract and third-party summaries (SPEC 2.8) -- there is no code. Published:
a soft position mask from the nucleus (top-p) entropy and the top-two log-probability gap
(detached); the top (1 - rho) = 20% of positions selected; an anchor H0, the mask-weighted
mean entropy over the first K = 4 steps; a floor H_low = rho_min * H0; the loss term
beta * max(0, H_low - H_bar)^2, H_bar the mask-weighted mean entropy (gradient through it).
**Not published**, so required parameters with no default (docs/method.md says which values a
run used, and that they are its own): ``beta``, ``rho_min``, ``top_p`` and how the two signals
make the mask -- ``mask`` (the score) and ``softness`` (how soft):

    score_t = Hp_t (mask "nucleus_entropy") | -g_t ("top2_gap") | Hp_t exp(-g_t) ("product")
    per response: thr = the k-th largest score, k = max(1, ceil((1 - rho) T_i))
    m_t = 1[score_t >= thr] (softness 0)  |  sigmoid((score_t - thr) / softness) (softness > 0)

Hp (the entropy of the policy renormalised over its top-p nucleus) and g come from the
current forward at the rollout temperature, detached (``nucleus.sharded_nucleus_stats`` on
every head). H_bar = sum m H / sum m over the loss call's valid tokens (per micro-batch, as
verl computes its entropy term), its penalty weighted by the call's share of the step's
normaliser, so the calls sum to the token-weighted mean of their penalties (exactly the
whole batch's when the step is one call). The host loss is PPO clip (optional dual clip,
times the mismatch weight). Anchor: while fewer than K steps are seen the penalty is 0 and
each step's mean H_bar (the actors' reported ``paec/masked_entropy``) is recorded
(``observe``, after the step); H0 is their mean; the state is checkpointed.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .groups import masked_mean
from .losses import LOSSES, CheckpointStateError, check_number
from .surrogate import aggregate, check_clip, default_normalizer, ppo_metrics, ppo_terms, weighted

MASKS = ("nucleus_entropy", "top2_gap", "product")
UNPUBLISHED = ("beta", "rho_min", "top_p", "mask", "softness")


def position_mask(nucleus_entropy, top2_gap, response_mask, *, mask: str, rho: float, softness: float):
    """[B, T] m in [0, 1]: each response's top max(1, ceil((1 - rho) T_i)) positions by score
    (ties at the threshold all join), or a sigmoid around that threshold; 0 off the response."""
    score = {"nucleus_entropy": lambda: nucleus_entropy, "top2_gap": lambda: -top2_gap,
             "product": lambda: nucleus_entropy * torch.exp(-top2_gap)}[mask]().detach().float()
    valid = response_mask.bool()
    n = valid.sum(-1)
    k = torch.where(n > 0, torch.ceil((1 - rho) * n.float() - 1e-9).clamp(min=1), torch.zeros_like(n, dtype=torch.float))
    ranked = torch.where(valid, score, torch.full_like(score, -math.inf)).sort(-1, descending=True).values
    thr = ranked.gather(-1, (k.long() - 1).clamp(min=0).unsqueeze(-1))  # [B, 1]
    m = (score >= thr).float() if softness == 0 else torch.sigmoid((score - thr) / softness)
    return torch.where(valid, m, torch.zeros_like(m))


def step_state(params, persisted, **_batch):
    """Before a step: the floor H_low = rho_min * H0 once the anchor is set, else None."""
    h0 = persisted.get("anchor")
    state = {"h_low": None if h0 is None else params["rho_min"] * float(h0)}
    return state, dict(persisted), ({} if h0 is None else {"paec/h_low": state["h_low"]})


def observe(params, persisted, metrics: Mapping[str, float]) -> dict:
    """After a step, from its reported mean H_bar: record it until K steps are seen, then fix H0."""
    out = dict(persisted)
    h = metrics.get("paec/masked_entropy")
    if out.get("anchor") is not None or h is None or not math.isfinite(float(h)):
        return out
    seen = list(out.get("anchor_steps", [])) + [float(h)]
    out["anchor_steps"] = seen
    if len(seen) >= params["anchor_steps"]:
        out["anchor"] = sum(seen) / len(seen)
    return out


def resume(old, new, persisted):
    """A resume whose config changed ``anchor_steps``: applied while the anchor is still being
    measured (the steps seen so far count towards the new K); refused once H0 is fixed, since the
    steps that would make it up under the new K are past. ``rho_min`` and the rest apply as they are
    (the floor is computed from the config each step)."""
    if old["anchor_steps"] == new["anchor_steps"]:
        return dict(persisted), []
    if persisted.get("anchor") is not None:
        raise ValueError(f"paec.anchor_steps changed {old['anchor_steps']} -> {new['anchor_steps']} at --resume, but "
                         f"the checkpoint's anchor H0 = {persisted['anchor']} was fixed over the first "
                         f"{old['anchor_steps']} steps and cannot be re-measured: resume with "
                         f"algorithm.loss_params.anchor_steps={old['anchor_steps']}, or start a new run")
    seen = len(persisted.get("anchor_steps", []))
    return dict(persisted), [f"paec.anchor_steps {old['anchor_steps']} -> {new['anchor_steps']}: the anchor is "
                             f"measured over {new['anchor_steps']} steps ({seen} seen so far)"]


def check_state(persisted) -> None:
    """The anchor as a checkpoint holds it: the steps' masked entropies seen so far (finite, >= 0)
    and H0 once fixed (finite, >= 0), nothing else."""
    unknown = sorted(set(persisted) - {"anchor", "anchor_steps"})
    if unknown:
        raise CheckpointStateError(f"paec state has unknown key(s) {unknown}")
    seen = persisted.get("anchor_steps", [])
    if not isinstance(seen, (list, tuple)):
        raise CheckpointStateError(f"paec state anchor_steps must be a list of entropies, got {seen!r}")
    for i, h in enumerate(seen):
        check_number(f"paec state anchor_steps[{i}]", h, lo=0.0)
    check_number("paec state anchor", persisted.get("anchor"), none=True, lo=0.0)


def _check(p: Mapping[str, Any]) -> None:
    missing = [k for k in UNPUBLISHED if k not in p]
    if missing:
        raise ValueError(f"paec: {', '.join(missing)} must be set: Yang et al. (arXiv 2606.08543) do not publish "
                         f"them, so there is no default (mask: one of {MASKS}; softness: 0 for the hard top (1 - rho) "
                         f"selection); the values are the run's own, not the paper's")
    check_clip(p)
    if p["mask"] not in MASKS:
        raise ValueError(f"paec.mask must be one of {MASKS}, got {p['mask']!r}")
    if isinstance(p["anchor_steps"], bool) or not isinstance(p["anchor_steps"], int) or p["anchor_steps"] < 1:
        raise ValueError(f"paec.anchor_steps must be an integer >= 1, got {p['anchor_steps']!r}")
    for key, ok, want in (("rho", 0 <= p["rho"] < 1, "in [0, 1)"), ("rho_min", p["rho_min"] >= 0, ">= 0"),
                          ("top_p", 0 < p["top_p"] <= 1, "in (0, 1]"), ("beta", p["beta"] >= 0, ">= 0"),
                          ("softness", p["softness"] >= 0, ">= 0")):
        if not ok:
            raise ValueError(f"paec.{key} must be {want}, got {p[key]!r}")


@LOSSES.register("paec", validate=_check, step_state=step_state, observe=observe, resume=resume,
                 check_state=check_state,
                 metrics=("paec/masked_entropy", "paec/mask_mean", "paec/penalty", "paec/below_floor"))
def paec(*, logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
         entropy=None, nucleus_entropy=None, top2_gap=None, token_weight=None, loss_state=None,
         beta: float, rho_min: float, top_p: float, mask: str, softness: float, rho: float = 0.8,
         anchor_steps: int = 4, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None):
    """PPO clip plus beta * max(0, H_low - H_bar)^2 (0 until the anchor is set)."""
    if entropy is None or nucleus_entropy is None or top2_gap is None:
        raise ValueError("paec needs `entropy` (current policy, with grad) and the head's `nucleus_entropy` and "
                         "`top2_gap` ([B, T], detached)")
    pg, ratio, log_ratio, clipped = ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    loss = aggregate(weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    m = position_mask(nucleus_entropy, top2_gap, response_mask, mask=mask, rho=rho, softness=softness)
    m = m.to(entropy.dtype)
    h_bar = (m * entropy).sum() / m.sum().clamp(min=1e-12)
    h_low = (loss_state or {}).get("h_low")
    penalty = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if h_low is not None and beta:
        share = default_normalizer(response_mask, aggregation) / max(float(normalizer), 1.0) if normalizer is not None else 1.0
        penalty = beta * torch.relu(h_low - h_bar) ** 2 * share
    metrics = ppo_metrics(ratio, log_ratio, clipped, response_mask)
    metrics.update({"paec/masked_entropy": h_bar.detach(), "paec/mask_mean": masked_mean(m.detach(), response_mask),
                    "paec/penalty": penalty.detach(),
                    "paec/below_floor": (h_bar.detach() < (math.inf if h_low is None else h_low)).float()
                    * float(h_low is not None)})
    return loss + penalty, metrics
