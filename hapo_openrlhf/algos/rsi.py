"""RSI-S (Lv et al., arXiv 2606.31575): the loss keeps the tokens whose relative surprisal
index lies in [lower, upper].

Source: the abstract and independent re-implementations (SPEC 2.8), which agree on the
index; the interval's bounds are **not published**, so ``lower`` and ``upper`` are
required parameters with no default (a run's values are in its ``config.yaml``: they are
that run's choice, not the paper's). In our notation, per valid response token, from the
current forward, detached:

    s_t = -log pi_theta(o_t)      H_t = entropy of pi_theta at t      RSI_t = s_t / H_t
    keep_t = 1[lower <= RSI_t <= upper]     (upper None: no upper bound)

and the host surrogate (PPO clip, optional dual clip, times the mismatch weight) is
aggregated over the kept tokens, the normaliser counting kept tokens. Where H_t = 0 the
distribution is one-hot: RSI_t is 0 for the token it certainly samples (s_t = 0), +inf
otherwise. The normaliser: every back end hands the loss one global count for the whole
optimizer step (micro-batches and ranks), fixed before the forward; the kept tokens are
known only after it, so the count is rescaled by this call's kept fraction,
``normalizer * kept / valid`` -- exactly the kept count when the step is one micro-batch,
exactly the host loss when every token is kept (``lower 0, upper None``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .groups import masked_mean
from .losses import LOSSES
from .surrogate import aggregate, check_clip, ppo_metrics, ppo_terms, weighted


def relative_surprisal(logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """RSI = s / H, detached; 0 where s = 0 (a one-hot's own token), +inf where only H = 0."""
    s = (-logprobs.detach()).clamp(min=0)
    h = entropy.detach().to(s.dtype)
    return torch.where(s > 0, s / h, torch.zeros((), dtype=s.dtype, device=s.device))


def _check(p: Mapping[str, Any]) -> None:
    missing = [k for k in ("lower", "upper") if k not in p]
    if missing:
        raise ValueError(f"rsi_s: {' and '.join(missing)} must be set: Lv et al. (arXiv 2606.31575) publish the "
                         f"relative surprisal index but not its interval bounds, so there is no default "
                         f"(upper: null means no upper bound); the values are the run's own, not the paper's")
    check_clip(p)
    if not p["lower"] >= 0:
        raise ValueError(f"rsi_s.lower must be >= 0 (the index s / H is never negative), got {p['lower']!r}")
    if p["upper"] is not None and not p["upper"] >= p["lower"]:
        raise ValueError(f"rsi_s.upper must be >= rsi_s.lower ({p['lower']!r}) or null, got {p['upper']!r}")


@LOSSES.register("rsi_s", validate=_check, metrics=("rsi/kept_frac", "rsi/index_mean"))
def rsi_s(*, logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
          entropy=None, token_weight=None, lower: float, upper: float | None, eps_low: float = 0.2,
          eps_high: float = 0.2, dual_clip: float | None = None):
    """The host surrogate over the tokens with lower <= s / H <= upper (current policy)."""
    if entropy is None:
        raise ValueError("rsi_s needs `entropy` (the current policy's, [B, T]) for its index s / H")
    pg, ratio, log_ratio, clipped = ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    rsi = relative_surprisal(logprobs, entropy)
    valid = response_mask.bool()
    keep = valid & (rsi >= lower) & (rsi <= (math.inf if upper is None else upper))
    if normalizer is not None and aggregation == "token-mean":
        kept, n = keep.sum(), valid.sum()
        normalizer = normalizer * torch.where(n > 0, kept / n.clamp(min=1), torch.ones((), device=n.device))
    loss = aggregate(weighted(pg, token_weight), keep, aggregation, normalizer, norm_constant)
    metrics = ppo_metrics(ratio, log_ratio, clipped, response_mask)
    metrics["rsi/kept_frac"] = masked_mean(keep.float(), response_mask)
    metrics["rsi/index_mean"] = masked_mean(torch.where(torch.isfinite(rsi), rsi, torch.zeros_like(rsi)), keep)
    return loss, metrics

