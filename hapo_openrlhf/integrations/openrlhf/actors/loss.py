"""A ``PolicyLoss``-compatible actor loss that dispatches to hapo's loss registry.

OpenRLHF 0.11.2's ``ActorPPOTrainer.training_step`` calls::

    loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = self.actor_loss_fn(
        action_log_probs, old_action_log_probs, advantages,
        action_mask=..., rollout_log_probs=..., dp_size=..., batch_num_tokens=..., global_batch_size=...)

``HapoPolicyLoss.forward`` has exactly that signature and return tuple (a test
compares it with ``inspect.signature`` of the pinned ``PolicyLoss.forward``), so it
is swapped in for ``trainer.actor_loss_fn`` inside the actor worker (see actor.py).

Normalisers: OpenRLHF hands each micro-batch the *global* token count (or sequence
count) of its optimizer step, already divided by the gradient-accumulation steps,
and multiplies by ``dp_size`` to undo DeepSpeed's data-parallel gradient average.
hapo's ``aggregate`` divides by its ``normalizer``, so ``normalizer = count / dp_size``
gives the same scalar as OpenRLHF's ``aggregate_loss``.

The importance-sampling correction between vLLM and the trainer
(``algorithm.is_correction``, emitted as OpenRLHF's ``--algo.advantage.is_correction_*``
so the engines return log-probs) is applied by hapo's loss core to whichever registry
loss runs (``algos.is_correction``): ``rollout_log_probs`` go in, and ``vllm_kl`` /
``is_filter_ratio`` come back as upstream's ``PolicyLoss`` returns them (None when off).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from torch import nn

from ....algos.losses import LOSSES, compute_policy_loss, head_signals_top_p

DUMP_ENV = "HAPO_OPENRLHF_DUMP_DIR"


class HapoPolicyLoss(nn.Module):
    """``PolicyLoss`` stand-in: ``name`` and ``params`` select a registry loss."""

    def __init__(self, name: str, params: dict[str, Any] | None = None, aggregation: str = "token-mean",
                 norm_constant: float | None = None, is_correction: Any = None) -> None:
        super().__init__()
        from ....algos.is_correction import ISCorrection

        self.name = name
        self.is_correction = ISCorrection.of(is_correction)
        self.params = dict(params or {})
        self.aggregation = aggregation
        self.norm_constant = norm_constant
        # the losses that take the current policy's entropy (entro_reg with its gradient, rsi_s's index)
        self.needs_entropy = "entropy" in LOSSES.get(name).accepts
        # the top-p of the head signals the loss takes (PAEC's nucleus entropy and top-two gap), or None
        self.signals_top_p = head_signals_top_p(name, self.params)
        # Set by the actor's forward hook just before each call (current policy, with grad)
        self.pending_entropy: torch.Tensor | None = None
        self.pending_signals: tuple[torch.Tensor, torch.Tensor] | None = None  # (nucleus entropy, top-two gap), detached
        self.pending_sequences: list[list[int]] | None = None  # unpadded token ids per row (dump only)
        self.last_metrics: dict[str, float] = {}
        # set by the DeepSpeed actor around each training step: the experience's info dict, where
        # upstream's training_step collects per-micro-batch metrics (token-weighted 0-d tensors)
        self.info_sink: dict | None = None
        # a stateful loss's state for this step (STARE's controller: its registered step_state),
        # stepped once per step by the experience maker and sent with set_loss_state
        self.loss_state: dict | None = None
        self._calls = 0

    def method_metrics(self) -> dict[str, Any]:
        """The last call's method-specific metrics (``stare/...``), beside upstream's."""
        return {k: self.last_metrics[k] for k in LOSSES.get(self.name).metrics}

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        if action_mask is None:
            action_mask = torch.ones_like(log_probs, dtype=torch.bool)
        count = batch_num_tokens if self.aggregation == "token-mean" else global_batch_size
        # kept a tensor when upstream hands one (on the device): float() would wait for the GPU
        normalizer = None if count is None else count / float(dp_size)
        extra: dict[str, Any] = {}
        if self.needs_entropy:
            ent = self.pending_entropy
            if ent is None:
                raise RuntimeError(f"{self.name} needs the current-policy entropy; the actor hook did not provide it "
                                   "(is --actor.entropy_coef set?)")
            extra["entropy"] = ent[:, -action_mask.shape[1]:]
        if self.signals_top_p is not None:
            if self.pending_signals is None:
                raise RuntimeError(f"{self.name} needs the head's nucleus entropy and top-two gap; the actor hook did "
                                   "not provide them")
            n = action_mask.shape[1]
            extra["nucleus_entropy"], extra["top2_gap"] = (t[:, -n:] for t in self.pending_signals)
        if LOSSES.get(self.name).stateful:
            if self.loss_state is None:
                raise RuntimeError(f"loss {self.name!r}: this step's controller state has not reached the actor "
                                   f"(the experience maker sends it with set_loss_state before training)")
            extra["loss_state"] = self.loss_state
        if self.is_correction.enabled:
            extra["is_correction"] = self.is_correction
            extra["rollout_logprobs"] = None if rollout_log_probs is None else rollout_log_probs.float()
            self._dump_rollout(rollout_log_probs, action_mask)
        loss, metrics = compute_policy_loss(
            self.name, log_probs.float(), old_log_probs.float(), advantages.float(), action_mask,
            aggregation=self.aggregation, normalizer=normalizer, norm_constant=self.norm_constant,
            sync=False, **extra, **self.params,
        )
        self.pending_entropy = self.pending_signals = None
        self.last_metrics = metrics
        self._dump(advantages, action_mask, old_log_probs)
        dev = log_probs.device
        if self.info_sink is not None:  # upstream's training_step: per micro-batch, token-weighted
            self.info_sink.update(self.method_metrics())
        # the metrics are 0-d tensors on the device (sync=False): no host sync per micro-batch
        clip_ratio = torch.as_tensor(metrics.get("actor/clip_frac", 0.0), device=dev)
        ppo_kl = torch.as_tensor(metrics.get("actor/approx_kl", 0.0), device=dev)
        if not self.is_correction.enabled:
            return loss, clip_ratio, ppo_kl, None, None
        vllm_kl = metrics["actor/vllm_kl"]
        is_filter = metrics["actor/is_filter_frac"]
        if self.info_sink is not None:
            self.info_sink["is_ratio_mean"] = metrics["actor/is_ratio_mean"]
            self.info_sink["is_ratio_max"] = metrics["actor/is_ratio_max"]
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter

    def _dump_rollout(self, rollout_log_probs, action_mask) -> None:
        """With ``HAPO_OPENRLHF_DUMP_DIR`` set: the rollout log-probs that reached the loss,
        per row with its tokens (the e2e test compares them with vLLM's own)."""
        d = os.environ.get(DUMP_ENV)
        if not d or self.pending_sequences is None or rollout_log_probs is None:
            return
        rank = int(os.environ.get("RANK", "0"))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"rollout_logprobs_rank{rank}.jsonl"), "a") as f:
            for i, toks in enumerate(self.pending_sequences):
                m = action_mask[i].bool().cpu()
                f.write(json.dumps({"tokens": toks, "rollout": rollout_log_probs[i].detach().float().cpu()[m].tolist()})
                        + "\n")

    def _dump(self, advantages: torch.Tensor, action_mask: torch.Tensor, old_log_probs: torch.Tensor) -> None:
        """With ``HAPO_OPENRLHF_DUMP_DIR`` set: record, per row, the tokens, the advantages
        (the e2e test matches them to the registry) and the old log-probs that reached the loss."""
        d = os.environ.get(DUMP_ENV)
        if not d or self.pending_sequences is None:
            return
        seqs, self.pending_sequences = self.pending_sequences, None
        rank = int(os.environ.get("RANK", "0"))
        rows = []
        for i in range(len(seqs)):
            m = action_mask[i].bool().cpu()
            rows.append({"tokens": seqs[i], "advantages": advantages[i].detach().float().cpu()[m].tolist(),
                         "old": old_log_probs[i].detach().float().cpu()[m].tolist()})
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"loss_rank{rank}.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self._calls += 1


class LossStateSink:
    """Policy actors (DeepSpeed and Megatron): receive a stateful loss's state for the step."""

    def set_loss_state(self, state: dict) -> None:
        self.loss_fn.loss_state = dict(state)
