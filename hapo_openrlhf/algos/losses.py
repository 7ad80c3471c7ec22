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
from .surrogate import (AGGREGATIONS, K3_MAX, aggregate, check_clip, default_normalizer, k3_kl,  # noqa: F401 - the losses' API
                        ppo_metrics, ppo_terms, weighted)

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
    # what a loss may declare beside its function, in its one registration (``Registry.register``):
    #   step_state(params, persisted, *, entropy, response_mask, old_logprobs, advantages, loss_mask) ->
    #     (loss_state for this step's loss calls, the state to checkpoint, metrics): a loss that keeps
    #     state across steps (STARE's controller); trainers call ``loss_step_state``.
    #   observe(params, persisted, metrics) -> persisted: its update after a step from the step's
    #     reported metrics (PAEC's anchor); trainers call ``loss_observe``.
    #   resume(old_params, new_params, persisted) -> (persisted, notes): its answer to a resume whose
    #     config changed its parameters -- the state made to train what the new config says (each note
    #     says what changed), or a ValueError naming a change that cannot be applied; ``loss_resume``.
    #   check_state(persisted) -> None: its persisted state as a checkpoint holds it, checked at restore
    #     (types, finiteness, ranges); a damaged one raises CheckpointStateError naming the key and the
    #     trainer falls back to an older checkpoint; ``check_loss_state``.
    #   metrics: its own metric keys (``stare/...``) beside ``actor/...``: the actors report them per
    #     micro-batch, and every rank must know the keys up front.
    #   row_local: its value on whole rows, with the global normaliser, sums over row blocks to the whole
    #     batch's loss (each token's term depends on its own row only), so it can run inside the fused
    #     head's forward (``algos.fused.fused_token_loss``); kl_cov and clip_cov select tokens over the
    #     whole batch, so they cannot.
    hooks=("step_state", "observe", "resume", "check_state", "metrics", "row_local"),
)


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
    """``name``'s persisted state as a checkpoint holds it (its registered ``check_state``); any mapping
    for a loss without a check. Raises CheckpointStateError naming the key."""
    if not isinstance(persisted, Mapping):
        raise CheckpointStateError(f"trainer.loss_state must be a mapping, got {persisted!r}")
    entry = LOSSES.find(name)
    if persisted and entry is not None and entry.check_state is not None:
        entry.check_state(persisted)


def loss_step_state(name: str, params: dict, persisted: dict | None, **batch: Any) -> tuple[dict | None, dict, dict]:
    """Once per step, before the loss: what ``name``'s calls get as ``loss_state`` this step,
    the state to checkpoint, and metrics; (None, {}, {}) for a loss without state."""
    entry = LOSSES.get(name)
    if entry.step_state is None:
        return None, {}, {}
    return entry.step_state({**entry.defaults, **params}, persisted or {}, **batch)


def loss_observe(name: str, params: dict, persisted: dict | None, metrics: dict) -> dict:
    """After a step: ``name``'s persisted state updated from the step's metrics (unchanged
    for a loss without an observer)."""
    entry = LOSSES.get(name)
    if entry.observe is None:
        return dict(persisted or {})
    return entry.observe({**entry.defaults, **params}, persisted or {}, metrics)


def loss_resume(old_name: str | None, old_params: dict | None, name: str, params: dict,
                persisted: dict | None) -> tuple[dict, list[str]]:
    """A checkpoint's persisted loss state for a resume under (``name``, ``params``), saved under
    (``old_name``, ``old_params``): unchanged when nothing changed; a loss that changed starts
    without the old one's state; a stateful loss whose parameters changed applies them
    (its registered ``resume``) or refuses by name. Returns (state, notes naming what the resume does)."""
    persisted = dict(persisted or {})
    if old_name is not None and old_name != name:
        return {}, ([f"algorithm.loss {old_name} -> {name}: the checkpoint's {old_name} state is not used"]
                    if persisted else [])
    entry = LOSSES.get(name)
    if entry.resume is None or not persisted:
        return persisted, []
    return entry.resume({**entry.defaults, **(old_params or {})}, {**entry.defaults, **params}, persisted)


def head_signals_top_p(name: str, params: dict) -> float | None:
    """The top-p at which the heads must compute ``nucleus_entropy`` and ``top2_gap`` for
    ``name`` (its ``top_p`` parameter), or None when the loss takes neither."""
    if not {"nucleus_entropy", "top2_gap"} & LOSSES.get(name).accepts:
        return None
    return float({**LOSSES.get(name).defaults, **params}["top_p"])


def list_losses() -> list[str]:
    return LOSSES.names()


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


@LOSSES.register("ppo", validate=check_clip, row_local=True)
def ppo(
    *,
    logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
    token_weight=None, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
):
    """PPO clipped surrogate; eps_high > eps_low is DAPO's clip-higher, dual_clip bounds
    the loss of negative-advantage tokens at -A * c (Ye et al. 2020)."""
    pg, ratio, log_ratio, clipped = ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    loss = aggregate(weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    return loss, ppo_metrics(ratio, log_ratio, clipped, response_mask)


@LOSSES.register("entro_reg", validate=check_clip, row_local=True)
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
    pg, ratio, log_ratio, clipped = ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    pg_loss = aggregate(weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    ent = aggregate(entropy, response_mask, aggregation, normalizer, norm_constant)
    metrics = ppo_metrics(ratio, log_ratio, clipped, response_mask)
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
    loss = aggregate(weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    metrics = ppo_metrics(ratio, log_ratio, torch.zeros_like(chosen), response_mask)
    metrics["actor/kl_cov_frac"] = _mmean(chosen.float(), response_mask).detach()
    return loss, metrics


@LOSSES.register("clip_cov", validate=check_clip)
def clip_cov(
    *,
    logprobs, old_logprobs, advantages, response_mask, aggregation, normalizer=None, norm_constant=None,
    generator=None, token_weight=None, clip_ratio: float = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0,
    eps_low: float = 0.2, eps_high: float = 0.2,
):
    """Clip-Cov (Cui et al. 2025): PPO clip, then detach a random clip_ratio (at least one)
    of the not-already-clipped tokens whose cov(A, logp) lies in (cov_lb, cov_ub)."""
    pg, ratio, log_ratio, clipped = ppo_terms(logprobs, old_logprobs, advantages, eps_low, eps_high, None)
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
    loss = aggregate(weighted(pg, token_weight), response_mask, aggregation, normalizer, norm_constant)
    metrics = ppo_metrics(ratio, log_ratio, clipped, response_mask)
    metrics["actor/clip_cov_frac"] = _mmean(drop.float(), response_mask).detach()
    return loss, metrics
