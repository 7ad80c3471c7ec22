"""Policy losses, registered by name, with one keyword-only contract.

Shape legend: B sequences, T response tokens. Every loss takes
``logprobs, old_logprobs, advantages, response_mask`` ([B,T]) plus
``aggregation`` and ``normalizer``; it returns ``(loss, metrics)``.

``normalizer`` is the *global* denominator (valid tokens for token-mean,
sequences for the seq-mean modes) across micro-batches and data-parallel
ranks, so summing each micro-batch's loss gives the one-big-batch gradient.

``token_weight`` ([B,T], detached, or None) is the rollout/training mismatch
correction (``algos.is_correction``): every registered loss must take it and multiply
its per-token policy term by it before aggregating (the registry refuses a loss that
does not take it); ``compute_policy_loss`` computes it from ``rollout_logprobs`` and
``is_correction``.

``loss_state`` (a mapping, or None) is state the trainer keeps across steps for a loss
that has some (STARE's controller, ``algos/stare.py``; PAEC's anchor, ``algos/paec.py``);
checkpointed by every back end.

``nucleus_entropy`` and ``top2_gap`` ([B,T], detached, or None): the current forward's
entropy over its top-p nucleus and log p(1st) - log p(2nd), which every head computes for
a loss that takes them (``head_signals_top_p``; ``algos.nucleus.sharded_nucleus_stats``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .groups import masked_mean as _mmean
from .is_correction import is_correction_weights
from .registry import Registry

LOSSES = Registry(
    "policy loss",
    fixed=(
        "logprobs",
        "old_logprobs",
        "advantages",
        "response_mask",
        "aggregation",
        "normalizer",
        "norm_constant",
        "entropy",
        "ref_logprobs",
        "kl_coef",
        "generator",
        "token_weight",
        "loss_state",
        "nucleus_entropy",
        "top2_gap",
    ),
    required=("token_weight",),
)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# losses whose value on whole rows, with the global normaliser, sums over row blocks
# to the whole batch's loss (each token's term depends on its own row only): they can
# run inside the fused head's forward (``algos.fused.fused_token_loss``). kl_cov and
# clip_cov select tokens over the whole batch, so they cannot.
ROW_LOCAL_LOSSES = frozenset({"ppo", "entro_reg"})


# name -> step_state(params, persisted, *, entropy, response_mask, old_logprobs, advantages, loss_mask) ->
# (loss_state for this step's loss calls, the state to checkpoint, metrics): the losses
# that keep state across steps (STARE's controller). Trainers call ``loss_step_state``.
STATEFUL: dict[str, Any] = {}
# name -> observe(params, persisted, metrics) -> persisted: a stateful loss's update after a
# step from the step's reported metrics (PAEC's anchor). Trainers call ``loss_observe``.
OBSERVERS: dict[str, Any] = {}
# name -> resume(old_params, new_params, persisted) -> (persisted, notes): a stateful loss's answer to a
# resume whose config changed its parameters -- the state made to train what the new config says (each
# note says what changed), or a ValueError naming a change that cannot be applied and how to apply it.
# Trainers call ``loss_resume``.
RESUMERS: dict[str, Any] = {}
# name -> check(persisted) -> None: a stateful loss's persisted state as a checkpoint holds it, checked
# at restore (types, finiteness, ranges); a damaged one raises CheckpointStateError naming the key, and the
# trainer falls back to an older checkpoint. Trainers call ``check_loss_state``.
STATE_CHECKS: dict[str, Any] = {}


class CheckpointStateError(ValueError):
    """A checkpoint's trainer or method state is damaged (the resume falls back to an older one)."""


def check_number(where: str, value: Any, *, none: bool = False, nan: bool = False, lo: float | None = None,
                 hi: float | None = None) -> None:
    """A persisted number: a real (not a bool, not a string), finite unless ``nan`` allows NaN,
    inside [lo, hi] where given; None where ``none`` allows it. Raises CheckpointStateError."""
    if value is None and none:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and math.isnan(value):
        ok = nan
    elif ok:
        ok = math.isfinite(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        rng = f" in [{lo}, {hi}]" if lo is not None or hi is not None else ""
        raise CheckpointStateError(f"{where} must be a finite number{rng}{' or null' if none else ''}, got {value!r}")


def check_loss_state(name: str | None, persisted: Any) -> None:
    """``name``'s persisted state as a checkpoint holds it (``STATE_CHECKS``); any mapping for a loss
    without a check. Raises CheckpointStateError naming the key."""
    if not isinstance(persisted, Mapping):
        raise CheckpointStateError(f"trainer.loss_state must be a mapping, got {persisted!r}")
    if persisted and name in STATE_CHECKS:
        STATE_CHECKS[name](persisted)


# name -> the method's own metric keys (``stare/...``) its loss returns beside ``actor/...``:
# the actors report them per micro-batch, and every rank must know the keys up front
METHOD_METRICS: dict[str, tuple[str, ...]] = {}


def loss_step_state(name: str, params: dict, persisted: dict | None, **batch: Any) -> tuple[dict | None, dict, dict]:
    """Once per step, before the loss: what ``name``'s calls get as ``loss_state`` this step,
    the state to checkpoint, and metrics; (None, {}, {}) for a loss without state."""
    if name not in STATEFUL:
        return None, {}, {}
    return STATEFUL[name]({**LOSSES.get(name).defaults, **params}, persisted or {}, **batch)


def loss_observe(name: str, params: dict, persisted: dict | None, metrics: dict) -> dict:
    """After a step: ``name``'s persisted state updated from the step's metrics (unchanged
    for a loss without an observer)."""
    if name not in OBSERVERS:
        return dict(persisted or {})
    return OBSERVERS[name]({**LOSSES.get(name).defaults, **params}, persisted or {}, metrics)


def loss_resume(old_name: str | None, old_params: dict | None, name: str, params: dict,
                persisted: dict | None) -> tuple[dict, list[str]]:
    """A checkpoint's persisted loss state for a resume under (``name``, ``params``), saved under
    (``old_name``, ``old_params``): unchanged when nothing changed; a loss that changed starts
    without the old one's state; a stateful loss whose parameters changed applies them
    (``RESUMERS``) or refuses by name. Returns (state, notes naming what the resume does)."""
    persisted = dict(persisted or {})
    if old_name is not None and old_name != name:
        return {}, ([f"algorithm.loss {old_name} -> {name}: the checkpoint's {old_name} state is not used"]
                    if persisted else [])
    if name not in RESUMERS or not persisted:
        return persisted, []
    defaults = LOSSES.get(name).defaults
    return RESUMERS[name]({**defaults, **(old_params or {})}, {**defaults, **params}, persisted)


def head_signals_top_p(name: str, params: dict) -> float | None:
    """The top-p at which the heads must compute ``nucleus_entropy`` and ``top2_gap`` for
    ``name`` (its ``top_p`` parameter), or None when the loss takes neither."""
    if not {"nucleus_entropy", "top2_gap"} & LOSSES.get(name).accepts:
        return None
    return float({**LOSSES.get(name).defaults, **params}["top_p"])


def list_losses() -> list[str]:
    return LOSSES.names()


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


def compute_policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **params: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(scalar loss, metrics) from the loss registered as ``name``.

    Common keywords: aggregation ("token-mean"), normalizer (global count),
    norm_constant, entropy ([B,T] current-policy entropy *with* grad, for
    entro_reg), ref_logprobs + kl_coef (k3 KL to a reference), generator,
    rollout_logprobs ([B,T], the rollout engine's log-probs of the sampled tokens) +
    is_correction (``algos.is_correction.ISCorrection`` or a mapping with level, mode,
    gating, threshold: OpenRLHF 0.11.2's mismatch correction, applied to every loss).
    ``sync`` (default True): the metrics as floats, and a non-finite loss is a
    ``FloatingPointError``; False (the actors' per-micro-batch path): 0-d tensors on the
    loss's device and no check -- nothing waits for the GPU, and a non-finite loss reaches
    the gradient guard at the optimizer step (``hapo_openrlhf/grad_guard.py``).
    """
    for k, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        if t.shape != response_mask.shape or t.dim() != 2:
            raise ValueError(
                f"{k} must be [B, T] like response_mask {tuple(response_mask.shape)}, got {tuple(t.shape)}"
            )
    params.setdefault("aggregation", "token-mean")
    if params["aggregation"] not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {params['aggregation']!r}; expected one of {AGGREGATIONS}")
    ref, kl_coef = params.pop("ref_logprobs", None), float(params.pop("kl_coef", 0.0))
    rollout, spec = params.pop("rollout_logprobs", None), params.pop("is_correction", None)
    sync = params.pop("sync", True)
    weight, is_metrics = is_correction_weights(old_logprobs, rollout, response_mask, spec, as_tensors=True)
    loss, metrics = LOSSES.call(
        name,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        token_weight=weight,
        **params,
    )
    metrics.update(is_metrics)
    if kl_coef and ref is not None:
        kl = k3_kl(logprobs, ref)
        kl_term = aggregate(kl, response_mask, params["aggregation"], params.get("normalizer"), params.get("norm_constant"))
        loss = loss + kl_coef * kl_term
        metrics["actor/kl_ref"] = _mmean(kl.detach(), response_mask)
    if not sync:  # the actors' hot path: a non-finite loss reaches the gradient guard at the step
        return loss, {k: torch.as_tensor(v, device=loss.device) for k, v in metrics.items()}
    if not bool(torch.isfinite(loss.detach())):
        raise FloatingPointError(f"non-finite policy loss from {name!r}: {float(loss.detach())}")
    return loss, {k: float(v) for k, v in metrics.items()}


K3_MAX = 10.0  # verl's kl_penalty "low_var_kl" / "k3": the estimate is clamped to [-10, 10]


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0,
    as verl computes it: the log-ratio clamped to [-20, 20], the estimate to at most
    ``K3_MAX`` (where the clamp binds the token's KL gradient is zero)."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(max=K3_MAX)


def _ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip):
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


def _weighted(pg: torch.Tensor, token_weight: torch.Tensor | None) -> torch.Tensor:
    """The per-token policy term times the mismatch-correction weight (None: unchanged)."""
    return pg if token_weight is None else pg * token_weight


def _ppo_metrics(ratio, log_ratio, clipped, mask) -> dict[str, float]:
    return {
        "actor/clip_frac": _mmean(clipped.float(), mask).detach(),
        "actor/ratio_mean": _mmean(ratio.detach(), mask),
        "actor/approx_kl": _mmean((-log_ratio).detach(), mask),
    }


def _check_clip(p) -> None:
    if not (0 <= p["eps_low"] < 1 and p["eps_high"] >= 0):
        raise ValueError(f"clip eps_low must be in [0, 1) and eps_high >= 0, got {p['eps_low']}, {p['eps_high']}")
    if p.get("dual_clip") is not None and p["dual_clip"] <= 1:
        raise ValueError(f"dual_clip must be > 1 (paper value 3), got {p['dual_clip']}")


@LOSSES.register("ppo", validate=_check_clip)
def ppo(
    *,
    logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
    token_weight=None, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
):
    """PPO clipped surrogate; eps_high > eps_low is DAPO's clip-higher, dual_clip bounds
    the loss of negative-advantage tokens at -A * c (Ye et al. 2020)."""
    pg, ratio, log_ratio, clipped = _ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    loss = aggregate(_weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    return loss, _ppo_metrics(ratio, log_ratio, clipped, response_mask)


@LOSSES.register("entro_reg", validate=_check_clip)
def entro_reg(
    *,
    logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
    entropy=None, token_weight=None, beta: float = 1e-3, eps_low: float = 0.2, eps_high: float = 0.2,
    dual_clip: float | None = None,
):
    """PPO clip minus beta * (aggregated current-policy entropy, gradient flows through H);
    the mismatch weight reweights the PPO term only."""
    if entropy is None:
        raise ValueError("entro_reg needs `entropy` (current policy, with grad) of shape [B, T]")
    pg, ratio, log_ratio, clipped = _ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    pg_loss = aggregate(_weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    ent = aggregate(entropy, response_mask, aggregation, normalizer, norm_constant)
    metrics = _ppo_metrics(ratio, log_ratio, clipped, response_mask)
    metrics["actor/entropy_bonus"] = ent.detach()
    return pg_loss - beta * ent, metrics


@LOSSES.register("kl_cov")
def kl_cov(
    *,
    logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
    token_weight=None, k_ratio: float = 2e-4, kl_coef_cov: float = 1.0,
):
    """KL-Cov (Cui et al. 2025): unclipped PG; the top k_ratio of valid tokens by
    cov(A, logp) also get kl_coef_cov * |logp - logp_old|: max(1, int(k*N)) tokens, as verl
    and the authors' code select them (k_ratio 0 selects none: plain unclipped PG)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)
    ratio = log_ratio.exp()
    pg = -advantages * ratio
    pg_kl = pg + kl_coef_cov * log_ratio.abs()
    valid = response_mask.bool()
    flat_idx = valid.flatten().nonzero().squeeze(-1)
    a = advantages.detach().flatten()[flat_idx]
    lp = logprobs.detach().flatten()[flat_idx]
    cov = (a - a.mean()) * (lp - lp.mean())
    n = flat_idx.numel()
    k = min(n, max(1, int(k_ratio * n))) if k_ratio > 0 and n > 0 else 0
    chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if k > 0:
        chosen[flat_idx[torch.topk(cov, k).indices]] = True
    chosen = chosen.view_as(valid)
    pg = torch.where(chosen, pg_kl, pg)
    loss = aggregate(_weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    metrics = _ppo_metrics(ratio, log_ratio, torch.zeros_like(chosen), response_mask)
    metrics["actor/kl_cov_frac"] = _mmean(chosen.float(), response_mask).detach()
    return loss, metrics


@LOSSES.register("clip_cov", validate=_check_clip)
def clip_cov(
    *,
    logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
    generator=None, token_weight=None, clip_ratio: float = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0,
    eps_low: float = 0.2, eps_high: float = 0.2,
):
    """Clip-Cov (Cui et al. 2025): PPO clip, then detach a random clip_ratio (at least one)
    of the not-already-clipped tokens whose cov(A, logp) lies in (cov_lb, cov_ub)."""
    pg, ratio, log_ratio, clipped = _ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, None)
    m = response_mask.bool()
    a, lp = advantages.detach(), logprobs.detach()
    cov = (a - a[m].mean()) * (lp - lp[m].mean())
    eligible = m & ~clipped & (cov > cov_lb) & (cov < cov_ub)
    idx = eligible.flatten().nonzero().squeeze(-1)
    n = max(int(clip_ratio * int(m.sum())), 1)
    drop = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if idx.numel():
        # drawn on the generator's device (a CPU generator, checkpointed by the trainer, also
        # serves CUDA tensors: the same draws on any device), then moved to the tokens'
        rng_device = generator.device if generator is not None else torch.device("cpu")
        perm = torch.randperm(idx.numel(), generator=generator, device=rng_device)[: min(n, idx.numel())]
        drop[idx[perm.to(idx.device)]] = True
    drop = drop.view_as(m)
    pg = torch.where(drop, torch.zeros_like(pg), pg)
    loss = aggregate(_weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    metrics = _ppo_metrics(ratio, log_ratio, clipped, response_mask)
    metrics["actor/clip_cov_frac"] = _mmean(drop.float(), response_mask).detach()
    return loss, metrics
