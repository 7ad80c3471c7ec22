"""The host surrogate's building blocks, public: what the policy losses of ``algos/losses.py`` and
the methods built on PPO's surrogate (STARE, RSI-S, PAEC: ``algos/stare.py``, ``rsi.py``, ``paec.py``)
are made of. A new method composes these; it imports no private name of another module.

Shape legend: B sequences, T response tokens.
"""

from __future__ import annotations

import torch

from .groups import masked_mean

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def default_normalizer(response_mask: torch.Tensor, aggregation: str) -> float:
    """The local normaliser; pass the sum over micro-batches/ranks for split == whole."""
    m = response_mask.bool()
    if aggregation == "token-mean":
        return float(m.sum())
    if aggregation in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return float(m.any(-1).sum())
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    aggregation: str,
    normalizer: float | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a token loss to a scalar.

    token-mean: sum(loss*m) / N_tokens.  seq-mean-token-mean: sum_i mean_t(loss_i) / N_seqs
    (sequences with no valid token contribute 0 and are not counted).
    seq-mean-token-sum-norm (Dr. GRPO): sum_i sum_t(loss_i) / norm_constant / N_seqs, with
    norm_constant a fixed budget (default T).
    """
    m = mask_BT.to(loss_BT.dtype)
    if normalizer is None:
        normalizer = default_normalizer(mask_BT, aggregation)
    # a tensor normaliser (OpenRLHF hands one over, on the device) stays one: no host sync
    normalizer = normalizer.clamp(min=1.0) if isinstance(normalizer, torch.Tensor) else max(float(normalizer), 1.0)
    if aggregation == "token-mean":
        return (loss_BT * m).sum() / normalizer
    if aggregation == "seq-mean-token-mean":
        per_seq = (loss_BT * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum() / normalizer
    if aggregation == "seq-mean-token-sum-norm":
        const = float(norm_constant if norm_constant is not None else mask_BT.shape[-1])
        return (loss_BT * m).sum() / const / normalizer
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


K3_MAX = 10.0  # verl's kl_penalty "low_var_kl" / "k3": the estimate is clamped to [-10, 10]


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0,
    as verl computes it: the log-ratio clamped to [-20, 20], the estimate to at most
    ``K3_MAX`` (where the clamp binds the token's KL gradient is zero)."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(max=K3_MAX)


def ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip):
    """The clipped surrogate per token, -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), bounded below by
    -c A for A < 0 with ``dual_clip`` c (Ye et al. 2020); returns (term, ratio, log-ratio, clipped).
    The log-ratio is clamped to [-20, 20] before exp, as OpenRLHF's PolicyLoss does."""
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        pg3 = -advantages * dual_clip
        lower = (advantages < 0) & (pg > pg3)
        pg = torch.where(advantages < 0, torch.minimum(pg, pg3), pg)
        clipped = clipped | lower
    return pg, ratio, log_ratio, clipped


def weighted(pg: torch.Tensor, token_weight: torch.Tensor | None) -> torch.Tensor:
    """The per-token policy term times the mismatch-correction weight (None: unchanged)."""
    return pg if token_weight is None else pg * token_weight


def ppo_metrics(ratio, log_ratio, clipped, mask) -> dict[str, float]:
    """The metrics every PPO-style loss reports: clip fraction, mean ratio, approximate KL."""
    return {
        "actor/clip_frac": masked_mean(clipped.float(), mask).detach(),
        "actor/ratio_mean": masked_mean(ratio.detach(), mask),
        "actor/approx_kl": masked_mean((-log_ratio).detach(), mask),
    }


def check_clip(p) -> None:
    """A clip configuration: eps_low in [0, 1), eps_high >= 0, dual_clip > 1 or None."""
    if not (0 <= p["eps_low"] < 1 and p["eps_high"] >= 0):
        raise ValueError(f"clip eps_low must be in [0, 1) and eps_high >= 0, got {p['eps_low']}, {p['eps_high']}")
    if p.get("dual_clip") is not None and p["dual_clip"] <= 1:
        raise ValueError(f"dual_clip must be > 1 (paper value 3), got {p['dual_clip']}")
