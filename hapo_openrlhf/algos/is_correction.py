"""Rollout/training mismatch correction (importance sampling between the rollout
engine's and the trainer's probabilities), with OpenRLHF 0.11.2's semantics
(``PolicyLoss`` with ``--algo.advantage.is_correction_{level,mode,gating,threshold}``;
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", Yao et al.).

vLLM samples with its own kernels (bf16), so pi_rollout != pi_train even at equal
weights. Per token, with ``old`` the trainer's log-probs of the sampled tokens at
make-experience time and ``rollout`` vLLM's::

    log w_t = (old_t - rollout_t), detached                 # the token IS weight pi_train / pi_rollout

A gate reads one statistic per *unit* (a token, or with ``level: seq`` a sequence):

* ``gating: ratio``: the ratio itself -- per token ``w_t``, per sequence the geometric
  mean ``exp(mean_t log w_t)``;
* ``gating: binary_kl`` / ``tv``: the sampled token's binary KL
  ``p log(p/q) + (1-p) log((1-p)/(1-q))`` or ``|p - q|`` between ``p = exp(rollout)``
  and ``q = exp(old)`` (both clamped to [1e-6, 1 - 1e-6]); per sequence the plain mean.

Units outside ``[low, high]`` are handled by ``mode``:

* ``mask``: dropped (weight 0); in-band tokens keep their per-token weight ``w_t``
  (token-mask = ICEPOP, seq-mask with ratio gating = seq-mask-TIS, seq-mask with
  binary_kl = FlashREINFORCE's trust region);
* ``clip``: the token ratio clamped into ``[low, high]`` (token-level TIS; token level
  and ratio gating only).

The weight multiplies each token's **policy-loss term before aggregation**; entropy
bonuses and KL-to-reference terms are not reweighted (as upstream keeps them outside
``PolicyLoss``). It is independent of HAPO's shaping: the estimator shapes the
advantage, the correction reweights the surrogate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .groups import masked_mean

LEVELS = ("off", "token", "seq")
MODES = ("mask", "clip")
GATINGS = ("ratio", "binary_kl", "tv")


@dataclass(frozen=True)
class ISCorrection:
    """One correction setting; the validation and its messages are OpenRLHF 0.11.2's
    (``PolicyLoss.__init__`` and ``train_ppo_ray``'s threshold handling)."""

    level: str = "off"
    mode: str = "mask"
    gating: str = "ratio"
    threshold: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self):
        th = tuple(float(x) for x in (self.threshold if isinstance(self.threshold, (list, tuple))
                                      else [self.threshold]))
        if len(th) == 1:  # a single value is an upper bound only
            th = (0.0, th[0])
        if len(th) != 2:
            raise ValueError("is_correction threshold takes HIGH or LOW HIGH")
        object.__setattr__(self, "threshold", th)
        if self.level not in LEVELS:
            raise ValueError(f"is_correction_level must be off/token/seq, got {self.level}")
        if self.mode not in MODES:
            raise ValueError(f"is_correction_mode must be mask/clip, got {self.mode}")
        if self.gating not in GATINGS:
            raise ValueError(f"is_correction_gating must be ratio/binary_kl/tv, got {self.gating}")
        if self.mode == "clip" and (self.level == "seq" or self.gating != "ratio"):
            raise ValueError("is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio")
        if self.gating != "ratio" and self.level != "off" and th[0] > 0:
            raise ValueError(f"is_correction_gating={self.gating} takes an upper bound only (a single delta)")
        if not th[0] <= th[1]:
            raise ValueError(f"is_correction threshold: low {th[0]} must be <= high {th[1]}")

    @property
    def enabled(self) -> bool:
        return self.level != "off"

    @classmethod
    def of(cls, spec: "ISCorrection | Mapping[str, Any] | None") -> "ISCorrection":
        if spec is None:
            return cls()
        if isinstance(spec, ISCorrection):
            return spec
        unknown = sorted(set(spec) - {"level", "mode", "gating", "threshold"})
        if unknown:
            raise ValueError(f"is_correction has no key(s) {unknown}; allowed: level, mode, gating, threshold")
        return cls(**dict(spec))


def _row_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    m = m.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1)


def is_correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None,
                          response_mask: torch.Tensor, spec, as_tensors: bool = False
                          ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The per-token weight [B, T] (detached; None when the correction is off) that
    multiplies a loss's per-token policy term, and its metrics: ``actor/vllm_kl`` (mean
    of rollout - old over valid tokens), ``actor/is_filter_frac`` (out-of-band units at
    the unit's own granularity), ``actor/is_ratio_mean`` / ``actor/is_ratio_max`` (the
    token ratio over valid tokens; 1 without one). ``as_tensors``: the metrics as 0-d
    tensors on the inputs' device (no host sync), else floats."""
    cfg = ISCorrection.of(spec)
    if not cfg.enabled:
        return None, {}
    if rollout_logprobs is None:
        raise ValueError("is_correction is on but no rollout log-probs reached the loss (the engine must return "
                         "them: OpenRLHF asks vLLM for logprobs when --algo.advantage.is_correction_level != off)")
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"rollout_logprobs {tuple(rollout_logprobs.shape)} must match old_logprobs "
                         f"{tuple(old_logprobs.shape)}")
    low, high = cfg.threshold
    mask = response_mask.bool()
    bad = ~torch.isfinite(rollout_logprobs.detach()) & mask
    if bool(bad.any()):  # a sampled token has p > 0: anything else is an engine or alignment fault
        raise ValueError(f"rollout_logprobs: {int(bad.sum())} response token(s) have non-finite rollout log-probs "
                         f"(rows {bad.any(-1).nonzero().flatten().tolist()[:8]}); the engine's log-probs are unusable")
    # at least fp32 (bf16 log-probs upcast; fp64 kept)
    dt = torch.promote_types(old_logprobs.dtype, torch.float32)
    old, rollout = old_logprobs.detach().to(dt), rollout_logprobs.detach().to(dt)
    rollout = torch.where(mask, rollout, old)  # padding: weight 1 (masked out anyway), never NaN
    is_log_ratio = old - rollout
    token_is = is_log_ratio.exp()
    seq = cfg.level == "seq"
    # the per-sequence mean divides by the row's token count unclamped, as upstream does: a row
    # without response tokens gets a NaN statistic, which no band contains (filtered, weight 0)
    if cfg.gating == "ratio":
        stat = (_row_mean(is_log_ratio, mask).unsqueeze(-1) if seq else is_log_ratio).exp()
    else:
        p = rollout.exp().clamp(1e-6, 1 - 1e-6)
        q = old.exp().clamp(1e-6, 1 - 1e-6)
        if cfg.gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
        if seq:
            stat = _row_mean(stat, mask).unsqueeze(-1)
    if cfg.mode == "clip":
        coef = stat.clamp(min=low, max=high)
        filtered = (stat < low) | (stat > high)
    else:
        keep = (stat >= low) & (stat <= high)
        coef = torch.where(keep, token_is, torch.zeros_like(token_is))
        filtered = ~keep
    coef = coef.expand_as(old)
    filter_frac = filtered.float().mean() if seq else masked_mean(filtered.float(), mask)
    any_valid = mask.any()  # masked reductions: boolean indexing would wait for the GPU
    one = torch.ones((), dtype=token_is.dtype, device=token_is.device)
    metrics = {
        "actor/vllm_kl": masked_mean(rollout - old, mask).detach(),
        "actor/is_filter_frac": filter_frac.detach(),
        "actor/is_ratio_mean": torch.where(any_valid, masked_mean(token_is, mask), one).detach(),
        "actor/is_ratio_max": torch.where(any_valid, token_is.masked_fill(~mask, float("-inf")).max(), one).detach(),
    }
    if not as_tensors:
        metrics = {k: float(v) for k, v in metrics.items()}
    return coef.to(old_logprobs.dtype), metrics


def mismatch_by_entropy(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                        entropy: torch.Tensor, tau: torch.Tensor | float) -> dict[str, float]:
    """``actor/vllm_kl`` (mean of rollout - old) over the high- and low-entropy halves of the
    valid tokens: high = behaviour entropy H >= tau, the Four Quadrant split (by default
    each group's mean token entropy, as published). Shows where a mismatch lives: under top-p
    with ``behaviour: processed`` it is -log P(nucleus), on the high-entropy tokens.
    A half with no token is left out. [B, T] inputs; ``tau`` a scalar or broadcastable."""
    mask = response_mask.bool()
    diff = (rollout_logprobs.float() - old_logprobs.float())
    high = (entropy.float() >= torch.as_tensor(tau, dtype=torch.float32)) & mask
    out = {}
    for name, m in (("high", high), ("low", mask & ~high)):
        if bool(m.any()):
            out[f"actor/vllm_kl_{name}_entropy"] = float(diff[m].mean())
    return out
