"""STARE (Luo et al., arXiv 2606.19236): surprisal-guided token weights on the clipped surrogate.

Source of truth: hp-luo/STARE ``verl/trainer/ppo/core_algos.py`` (``compute_stare_token_weights``,
``compute_policy_loss_stare``, ``STAREController``) and ``recipe/STARE/stare_ray_trainer.py``
(the controller's once-per-step update). A loss-side weight omega multiplies the per-token
dual-clip surrogate (after the mismatch weight, as the reference orders them), token-mean:

    T+ = valid tokens with A > 0, T- = A < 0;  s = -log pi_theta(o_t), detached
    L+ = the k+ = max(1, ceil(P |T+|)) most surprising tokens of T+ (L- likewise, variant C2)
    omega = W on L+, M on L- (C2), else 1;  omega = 1 everywhere while the gate is off

``selection="micro_batch"`` (the reference) picks L+/L- within each call of the loss, i.e.
per rank and micro-batch, from the current forward's log-probs; so P selects over fewer
tokens as the micro-batch shrinks. ``selection="batch"`` takes one threshold per step over
the whole batch (every rank) from the behaviour pass's surprisal (``stare_thresholds``; the
trainer passes it in ``loss_state``): a token is in L+ when its surprisal under the
behaviour policy is at least the k+-th largest of T+ (ties at the threshold all join).
The controller (``StareController``) is updated once per step from the batch's token-mean
behaviour entropy, before the loss: gate = 1[H < H_tgt]; adaptive:
W <- clip(W + a sgn(H_tgt - H), 1, w_max), M <- clip(M - a sgn(H_tgt - H), m_min, 1).
Its state is checkpointed (the reference rebuilds it from the config on a resume).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch

from .groups import masked_mean
from .losses import LOSSES, CheckpointStateError, check_number
from .surrogate import aggregate, check_clip, ppo_metrics, ppo_terms, weighted

VARIANTS, SELECTIONS = ("O1", "C2"), ("micro_batch", "batch")


def top_count(n: int, ratio: float) -> int:
    """The reference's ceil(n P), at least one, at most n (its ``int(n P + 0.999999)``)."""
    return 0 if n == 0 or ratio <= 0 else min(n, max(1, int(n * ratio + 0.999999)))


def top_surprisal(surprisal: torch.Tensor, candidates: torch.Tensor, ratio: float,
                  count: int | None = None) -> torch.Tensor:
    """The ``top_count`` most surprising candidates; ties broken by position (row-major). The one
    host read is the candidates' count (which sets k; ``count`` when the caller has read it): the
    non-candidates sort last (-inf; a surprisal is >= 0), and a stable sort keeps row-major order
    among equal values, as sorting the candidates alone would."""
    k = top_count(int(candidates.sum()) if count is None else count, ratio)
    chosen = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    if k:
        ranked = torch.where(candidates.flatten(), surprisal.flatten(), -math.inf)
        chosen[torch.sort(ranked, descending=True, stable=True).indices[:k]] = True
    return chosen.view_as(candidates)


def stare_thresholds(surprisal: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     ratio: float) -> dict[str, float]:
    """``selection="batch"``: the k-th largest surprisal of T+ and of T- over the whole batch
    (inf where a set is empty, so nothing is selected)."""
    out = {}
    for key, cand in (("threshold_pos", mask.bool() & (advantages > 0)), ("threshold_neg", mask.bool() & (advantages < 0))):
        v = surprisal[cand].float()
        k = top_count(v.numel(), ratio)
        out[key] = float(v.topk(k).values[-1]) if k else math.inf
    return out


def stare_omega(surprisal, advantages, mask, *, variant, ratio, gate, w, m, thresholds=None):
    """(omega, L+, L-) [B,T]: W on L+, M on L- (C2 only), 1 elsewhere and while the gate is off."""
    valid = mask.bool()
    pos, neg = valid & (advantages > 0), valid & (advantages < 0)
    if thresholds is None:  # selection within this call (the reference's micro-batch): one host read
        n_pos, n_neg = torch.stack([pos.sum(), neg.sum()]).tolist()
        l_pos, l_neg = top_surprisal(surprisal, pos, ratio, n_pos), top_surprisal(surprisal, neg, ratio, n_neg)
    else:
        l_pos, l_neg = pos & (surprisal >= thresholds["threshold_pos"]), neg & (surprisal >= thresholds["threshold_neg"])
    if variant == "O1":
        l_neg = torch.zeros_like(l_neg)
    omega = torch.ones_like(surprisal)  # on the tokens' device, in their dtype
    if gate:
        omega = torch.where(l_pos, torch.full_like(omega, w), torch.where(l_neg, torch.full_like(omega, m), omega))
    return omega, l_pos, l_neg


@dataclass
class StareController:
    target_entropy: float = 0.3
    reweight_w: float = 1.1
    reweight_m: float = 0.9
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    gate_on: bool = True
    current_ent: float = math.nan

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> "StareController":
        keys = ("target_entropy", "reweight_w", "reweight_m", "adaptive", "alpha", "w_max", "m_min")
        return cls(**{k: p[k] for k in keys if k in p})

    def update(self, entropy: float) -> None:
        """Once per step, before the loss, from the batch's token-mean behaviour entropy
        (a non-finite value leaves the state as it was, as in the reference)."""
        if not math.isfinite(entropy):
            return
        self.current_ent, self.gate_on = float(entropy), bool(entropy < self.target_entropy)
        if self.adaptive and self.alpha:
            sign = float((self.target_entropy > entropy) - (self.target_entropy < entropy))
            self.reweight_w = min(max(self.reweight_w + self.alpha * sign, 1.0), self.w_max)
            self.reweight_m = min(max(self.reweight_m - self.alpha * sign, self.m_min), 1.0)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """The state a step changes (W, M, the gate, the last entropy); the settings (target,
        step size, bounds) stay this run's config, so a resume may change them."""
        for k in ("reweight_w", "reweight_m", "gate_on", "current_ent"):
            if k in sd:
                setattr(self, k, sd[k])


def step_state(params, persisted, *, entropy, response_mask, old_logprobs, advantages, loss_mask):
    """The controller's once-per-step update from the whole batch's token-mean behaviour
    entropy, and for ``selection="batch"`` the step's thresholds over the batch's behaviour
    surprisal (the callers hold the whole batch: every data-parallel rank's rows)."""
    ctl = StareController.from_params(params)
    ctl.load_state_dict(persisted)
    m = response_mask.bool()
    ctl.update(float(torch.where(m, entropy.float(), 0.0).sum()) / max(int(m.sum()), 1))
    state = ctl.state_dict()
    if params["selection"] == "batch":
        state = {**state, **stare_thresholds(-old_logprobs, advantages, loss_mask, params["top_ratio"])}
    return state, ctl.state_dict(), {"stare/batch_entropy": ctl.current_ent}


def resume(old, new, persisted):
    """A resume whose config changed the controller's settings: a changed initial W (M) restarts
    the controller's W (M) at the new value -- the checkpoint holds the W the old setting led to,
    which would otherwise keep training -- and a W (M) outside new bounds is brought inside them.
    The settings themselves (target, step size, bounds) are always this run's config."""
    out, notes = dict(persisted), []
    for key, letter in (("reweight_w", "W"), ("reweight_m", "M")):
        if old[key] != new[key] and key in out:
            notes.append(f"stare.{key} {old[key]} -> {new[key]}: the controller's {letter} restarts at {new[key]} "
                         f"(the checkpoint's {letter} was {out[key]})")
            out[key] = float(new[key])
    if "reweight_w" in out and out["reweight_w"] > new["w_max"]:
        notes.append(f"stare.w_max {new['w_max']}: the controller's W {out['reweight_w']} is brought down to it")
        out["reweight_w"] = float(new["w_max"])
    if "reweight_m" in out and out["reweight_m"] < new["m_min"]:
        notes.append(f"stare.m_min {new['m_min']}: the controller's M {out['reweight_m']} is brought up to it")
        out["reweight_m"] = float(new["m_min"])
    return out, notes


def check_state(persisted) -> None:
    """The controller as a checkpoint holds it: W >= 1 and M in (0, 1] (as the controller keeps
    them), finite and float32-sized; the gate true or false; the last entropy a number (NaN before
    the first finite one)."""
    for key, lo, hi in (("reweight_w", 1.0, 3.4e38), ("reweight_m", 1.2e-38, 1.0)):
        if key in persisted:
            check_number(f"stare state {key}", persisted[key], lo=lo, hi=hi)
    if "gate_on" in persisted and not isinstance(persisted["gate_on"], bool):
        raise CheckpointStateError(f"stare state gate_on must be true or false, got {persisted['gate_on']!r}")
    if "current_ent" in persisted:
        check_number("stare state current_ent", persisted["current_ent"], nan=True, lo=0.0)
    for key in ("threshold_pos", "threshold_neg"):
        if key in persisted:
            raise CheckpointStateError(f"stare state {key} is a step's value, never checkpointed")


def _check(p: Mapping[str, Any]) -> None:
    check_clip(p)
    if p["variant"] not in VARIANTS or p["selection"] not in SELECTIONS:
        raise ValueError(f"stare.variant must be one of {VARIANTS} and stare.selection one of {SELECTIONS}, "
                         f"got {p['variant']!r}, {p['selection']!r}")
    if not isinstance(p["adaptive"], bool):
        raise ValueError(f"stare.adaptive must be true or false, got {p['adaptive']!r}")
    for key, ok, want in (("top_ratio", 0 <= p["top_ratio"] <= 1, "in [0, 1]"), ("reweight_w", p["reweight_w"] >= 1, ">= 1"),
                          ("reweight_m", 0 < p["reweight_m"] <= 1, "in (0, 1]"), ("alpha", p["alpha"] >= 0, ">= 0"),
                          ("w_max", p["w_max"] >= p["reweight_w"], ">= reweight_w"),
                          ("m_min", 0 < p["m_min"] <= p["reweight_m"], "in (0, reweight_m]"),
                          ("target_entropy", p["target_entropy"] >= 0, ">= 0")):
        if not ok:
            raise ValueError(f"stare.{key} must be {want}, got {p[key]!r}")


@LOSSES.register("stare", validate=_check, step_state=step_state, resume=resume, check_state=check_state,
                 metrics=("stare/gate_on", "stare/reweight_w", "stare/reweight_m", "stare/positive_reweight_frac",
                          "stare/negative_reweight_frac", "stare/mean_weight"))
def stare(*, logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
          token_weight=None, loss_state=None, variant: str = "O1", selection: str = "micro_batch",
          top_ratio: float = 0.1, reweight_w: float = 1.1, reweight_m: float = 0.9, target_entropy: float = 0.3,
          adaptive: bool = False, alpha: float = 0.01, w_max: float = 1.5, m_min: float = 0.5,
          eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = 10.0):
    """Dual-clip PPO times omega; ``loss_state`` = the controller's ``state_dict`` (+ the
    batch thresholds); without one, the configured W and M with the gate on."""
    ctl = dict(loss_state or {})
    gate, W, M = bool(ctl.get("gate_on", True)), float(ctl.get("reweight_w", reweight_w)), float(ctl.get("reweight_m", reweight_m))
    pg, ratio, log_ratio, clipped = ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    if selection == "batch" and "threshold_pos" not in ctl:
        raise ValueError("stare.selection='batch' needs the step's thresholds (stare_thresholds) in loss_state")
    omega, l_pos, l_neg = stare_omega(-(logprobs if selection == "micro_batch" else old_logprobs).detach(), advantages,
                                      response_mask, variant=variant, ratio=top_ratio, gate=gate, w=W, m=M,
                                      thresholds=ctl if selection == "batch" else None)
    loss = aggregate(weighted(pg, token_weight) * omega, response_mask, aggregation, normalizer, norm_constant)
    metrics = ppo_metrics(ratio, log_ratio, clipped, response_mask)
    metrics.update({"stare/gate_on": float(gate), "stare/reweight_w": W, "stare/reweight_m": M,
                    "stare/positive_reweight_frac": masked_mean(l_pos.float(), response_mask),
                    "stare/negative_reweight_frac": masked_mean(l_neg.float(), response_mask),
                    "stare/mean_weight": masked_mean(omega, response_mask)})
    return loss, metrics
