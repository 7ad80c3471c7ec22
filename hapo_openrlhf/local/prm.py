"""PRIME's implicit process reward model on the embedded back end: a second trainable model,
its frozen reference and its own optimizer, trained online on the policy's rollouts.

One RL step (``ImplicitPRM.step``), in the order ``prm.update`` names (the recipe's
``reward_model.model.update``, verl ``recipe/prime/prime_ray_trainer.py``, ``fit``):

* ``before`` -- train on the batch (mini-batches of ``prm.mini_batch_size`` responses, one
  optimizer step each), then score it again with the updated PRM: the q the advantage reads
  (``update_rm`` then ``compute_rm_score``; two forwards);
* ``after`` -- train on the batch and return the q of the update's own forwards (each mini-batch's
  before its optimizer step: ``update_rm``'s ``rm_scores``; one forward);
* ``none`` -- score only.

q = log pi_phi(y_t) - log pi_ref(y_t) per response token at temperature 1 (a reward model's
log-probs, not the sampler's tempered ones), from the same response forward the policy's
log-probs use (``local/forward.py``); the reference's log-probs once per batch. The loss is ``algos.prime.prm_loss`` (the recipe's
``ce``) with the estimator's beta. The held-out metrics come from each mini-batch's forward
before its optimizer step: the PRM has not trained on those responses yet.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch

from ..algos import prime as prime_algo
from ..algos.losses import CheckpointStateError as _StateError
from ..config.prm import PRMConfig
from ..generation.rollout import Rollout
from .forward import policy_forward

log = logging.getLogger(__name__)


def _load(path: str, what: str, vocab: int):
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise ValueError(f"prm.{what} {path!r} does not exist (hub downloads are not used)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.vocab_size != vocab:
        raise ValueError(f"prm.{what} {path!r} has a vocabulary of {model.config.vocab_size} tokens, the policy "
                         f"{vocab}: the PRM scores the policy's tokens, so it must share its tokenizer")
    return model


class ImplicitPRM:
    """The PRM phi, its frozen reference and phi's optimizer (module docstring)."""

    def __init__(self, cfg: PRMConfig, policy, *, beta: float, chunk_size: int, fused: bool, packing: bool):
        self.cfg, self.beta = cfg, beta
        self.forward_kw = dict(temperature=1.0, chunk_size=chunk_size, fused=fused, packing=packing)
        vocab = policy.config.vocab_size
        self.model = copy.deepcopy(policy) if cfg.path is None else _load(cfg.path, "path", vocab)
        self.ref = copy.deepcopy(self.model) if cfg.ref_path is None else _load(cfg.ref_path, "ref_path", vocab)
        self.ref.eval().requires_grad_(False)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                       weight_decay=cfg.weight_decay)
        self.skipped_steps = 0

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "ref": self.ref.state_dict(), "optimizer": self.optim.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.ref.load_state_dict(state["ref"])
        self.optim.load_state_dict(state["optimizer"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        # this run's optimizer settings, not the checkpoint's (a resume with --set prm.lr=... trains at it)
        for g in self.optim.param_groups:
            g.update(lr=self.cfg.lr, betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay)

    # --------------------------------------------------------------------- forward
    def _batches(self, idx: list[int], size: int) -> list[list[int]]:
        return [idx[s:s + size] for s in range(0, len(idx), size)]

    @torch.no_grad()
    def reference_logprobs(self, ro: Rollout) -> torch.Tensor:
        """log pi_ref per response token [B, T], once per batch (the reference never changes, so the
        update and the score after it share it: the recipe runs it in both)."""
        B = ro.response_mask_BR.shape[0]
        return torch.cat([policy_forward(self.ref, ro.select(i), **self.forward_kw)[0]
                          for i in self._batches(list(range(B)), self.cfg.micro_batch_size)])

    def _q(self, ro: Rollout, ref_logp: torch.Tensor) -> torch.Tensor:
        """q [B, T] with the gradient through phi's log-probs (the caller decides no_grad)."""
        logp = policy_forward(self.model, ro, **self.forward_kw)[0]
        return prime_algo.implicit_q(logp, ref_logp, ro.response_mask_BR)

    @torch.no_grad()
    def score(self, ro: Rollout, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
        ref_logp = self.reference_logprobs(ro) if ref_logp is None else ref_logp
        self.model.eval()
        B = ro.response_mask_BR.shape[0]
        return torch.cat([self._q(ro.select(i), ref_logp[i])
                          for i in self._batches(list(range(B)), self.cfg.micro_batch_size)])

    def update(self, ro: Rollout, outcome: torch.Tensor,
               ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Train on the batch; returns the q of the update's forwards (each mini-batch's, before its
        optimizer step) and the loss, gradient norm and skipped-step count."""
        ref_logp = self.reference_logprobs(ro) if ref_logp is None else ref_logp
        B = ro.response_mask_BR.shape[0]
        self.model.train()
        qs, losses, norms = [], [], []
        for mini in self._batches(list(range(B)), self.cfg.mini_batch_size or B):
            self.optim.zero_grad(set_to_none=True)
            total = 0.0
            for idx in self._batches(mini, self.cfg.micro_batch_size):
                sub = ro.select(idx)
                q = self._q(sub, ref_logp[idx])
                loss = prime_algo.prm_loss(q, outcome[idx].float(), sub.response_mask_BR, beta=self.beta)
                (loss * (len(idx) / len(mini))).backward()
                total += float(loss.detach()) * len(idx) / len(mini)
                qs.append(q.detach())
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
            if not math.isfinite(norm):  # a NaN norm would not clip: the step is skipped, the weights kept
                self.optim.zero_grad(set_to_none=True)
                self.skipped_steps += 1
                log.warning("implicit PRM: non-finite gradient norm (%s); optimizer step skipped", norm)
            else:
                self.optim.step()
            losses.append(total)
            norms.append(norm)
        return torch.cat(qs), {"prm/loss": sum(losses) / len(losses), "prm/grad_norm": norms[-1],
                               "prm/skipped_steps": float(self.skipped_steps)}

    def step(self, ro: Rollout, outcome: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One RL step's q for the advantage, in ``prm.update``'s order, and the PRM's metrics."""
        mask = ro.response_mask_BR
        metrics: dict[str, float] = {}
        ref_logp = self.reference_logprobs(ro)
        if self.cfg.update == "none":
            q = seen = self.score(ro, ref_logp)
        else:
            seen, metrics = self.update(ro, outcome, ref_logp)
            q = self.score(ro, ref_logp) if self.cfg.update == "before" else seen
        # seen: the responses as the PRM scored them before training on them (held out)
        metrics.update(prime_algo.prm_metrics(seen, q, outcome, mask, group_index, beta=self.beta))
        return q, metrics


def check_prm_state(prm: Any) -> None:
    """An implicit PRM's checkpointed state (``local/prm.py``), when there is one: the three state dicts
    and the skip count, each of the right kind; a damaged one is a :class:`_StateError`."""
    if prm == {}:
        return
    if not isinstance(prm, dict) or not {"model", "ref", "optimizer"} <= set(prm):
        raise _StateError(f"its implicit PRM state must hold model, ref and optimizer, got "
                                   f"{sorted(prm) if isinstance(prm, dict) else type(prm).__name__}")
    for key in ("model", "ref"):
        if not (isinstance(prm[key], dict) and prm[key]
                and all(isinstance(v, torch.Tensor) and bool(torch.isfinite(v).all()) for v in prm[key].values())):
            raise _StateError(f"its implicit PRM's {key} weights are not a mapping of finite tensors")
    if not (isinstance(prm["optimizer"], dict) and {"state", "param_groups"} <= set(prm["optimizer"])):
        raise _StateError("its implicit PRM's optimizer state is damaged (no state / param_groups)")
    skipped = prm.get("skipped_steps", 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise _StateError(f"its implicit PRM's skipped_steps must be an integer >= 0, got {skipped!r}")
