"""``RemoteExperienceMaker`` subclass: advantages from hapo's registry.

OpenRLHF 0.11.2 computes advantages in an if/elif chain inside
``RemoteExperienceMaker.compute_advantages_and_returns``. This subclass

* ``make_experience``: runs upstream's (reward, old log-probs, reference), then fetches
  the behaviour entropy (and, under top-p, log P(nucleus)) each policy actor computed in
  the same forward (``HapoPolicyModelActor.pop_behaviour``) and attaches them to each
  experience;
* ``compute_advantages_and_returns``: replaces the chain with
  :func:`registry_advantages` -- the DAPO overlong penalty, then *any* registered
  estimator over the whole rollout batch at once (group statistics and HAPO's group
  entropy normalisation need every member of a group, which OpenRLHF spreads over
  micro-batches), quadrant masks folded into ``action_mask`` (so OpenRLHF's global
  token normaliser shrinks with them, as in the local trainer), and the Four
  Quadrant metrics in ``experience.info`` (OpenRLHF logs every ``info`` entry).
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Sequence

import ray
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from .... import algos
from ....algos.dapo import overlong_penalty
from ....algos.step import before_update
from ....config import RunConfig, transported
from ..actors.deepspeed_actor import fingerprint
from ..actors.loss import DUMP_ENV


def _pad_cat(tensors: Sequence[torch.Tensor], width: int, dtype=None) -> torch.Tensor:
    out = []
    for t in tensors:
        t = t if dtype is None else t.to(dtype)
        out.append(torch.nn.functional.pad(t, (0, width - t.shape[1])))
    return torch.cat(out, 0)


def optimizer_steps_per_step(cfg: RunConfig) -> int:
    """Optimizer steps one RL step takes on the policy actors: its samples over
    ``openrlhf.train_batch_size`` (which divides them, ``flags.build_argv`` checks), times
    ``optim.ppo_epochs`` -- DeepSpeed's gradient-accumulation boundary, the Megatron actor's
    window; OpenRLHF's dynamic batch keeps one optimizer step per train batch too."""
    r = cfg.rollout
    return r.prompts_per_step * r.samples_per_prompt // cfg.openrlhf.train_batch_size * cfg.optim.ppo_epochs


def gather_inputs(experiences: Sequence[Any], cfg: RunConfig, n_samples: int, optimizer_step: int | None):
    """The whole rollout batch as the algorithm's inputs, from OpenRLHF's micro-batches of
    experiences (each padded to its own width): ``AdvantageInputs`` with the rewards after the
    overlong penalty (the outcome, the quadrants' polarity, before it), the rows' rollout
    positions, and the behaviour log-probs [B, T] (None where some experience lacks them)."""
    algorithm = cfg.algorithm
    if not experiences:
        raise ValueError("no experiences to compute advantages for")
    widths = [e.action_mask.shape[1] for e in experiences]
    W = max(widths)
    index = torch.tensor(list(itertools.chain.from_iterable(e.index for e in experiences)))
    for e in experiences:
        if getattr(e, "behaviour_entropy", None) is None:
            raise RuntimeError("experience has no behaviour entropy (was the HAPO policy actor used?)")
        if e.behaviour_entropy.shape != e.action_mask.shape:
            raise RuntimeError(f"behaviour entropy {tuple(e.behaviour_entropy.shape)} does not match "
                               f"action_mask {tuple(e.action_mask.shape)}")
    rewards = torch.cat([e.rewards.float().reshape(-1) for e in experiences])
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("non-finite reward in the rollout batch (reward function error?)")
    # the outcome (the quadrants' polarity) is the verifier's, before the overlong penalty
    correct = rewards > 0.5
    lengths = torch.cat([e.response_length.reshape(-1) for e in experiences])
    ov = algorithm.overlong
    if ov.enable:
        rewards = rewards + overlong_penalty(lengths, cfg.rollout.max_new_tokens, ov.cache_len)
    mask = _pad_cat([e.action_mask for e in experiences], W, torch.bool)
    entropy = _pad_cat([e.behaviour_entropy.float() for e in experiences], W)
    if int(index.max()) + 1 != len(index) or len(index) % n_samples:
        raise ValueError(f"rollout batch of {len(index)} rows is not whole groups of {n_samples}")
    # the response tokens: OpenRLHF's action_mask covers the last A_i positions of each row's sequences
    response_ids = _pad_cat([e.sequences[:, e.sequences.shape[1] - e.action_mask.shape[1]:] for e in experiences], W)
    # PRIME: the implicit PRM's q per response token (controller/prm.py)
    process_q = (_pad_cat([e.process_q.float() for e in experiences], W)
                 if all(getattr(e, "process_q", None) is not None for e in experiences) else None)
    inputs = algos.AdvantageInputs(rewards=rewards, response_mask=mask, entropy=entropy,
                                   group_index=torch.div(index, n_samples, rounding_mode="floor"),
                                   correct=correct, response_ids=response_ids, step=optimizer_step,
                                   process_q=process_q)
    has_old = all(getattr(e, "action_log_probs", None) is not None for e in experiences)
    old = _pad_cat([e.action_log_probs.float() for e in experiences], W) if has_old else None
    if old is None and algos.LOSSES.get(algorithm.loss).stateful:
        raise RuntimeError(f"loss {algorithm.loss!r} steps its state from the behaviour log-probs, which some "
                           f"experiences lack (action_log_probs)")
    return inputs, index, old


def registry_advantages(experiences: Sequence[Any], cfg: RunConfig, n_samples: int,
                        optimizer_step: int | None = None, persisted: dict | None = None,
                        prm_status: dict | None = None) -> dict[str, Any]:
    """Fill ``advantages``/``returns`` (and narrow ``action_mask``) of OpenRLHF experiences in place.

    Each experience needs ``rewards`` [b], ``action_mask`` [b, A_i], ``index`` (the rollout
    position of each row; rows ``k*n .. k*n+n-1`` are one prompt's group, as OpenRLHF
    generates them), ``response_length`` [b] and ``behaviour_entropy`` [b, A_i]; with
    ``nucleus_logmass`` [b, A_i] (a top-p rollout) the metrics get ``rollout/nucleus_logmass``.
    ``optimizer_step``: the optimizer steps taken before this batch (eapo_entropic's kappa
    decay, ``AdvantageInputs.step``). ``persisted``: a stateful loss's checkpointed state. PRIME:
    each experience's ``process_q`` and ``prm_seen`` (controller/prm.py) and the PRM update's
    ``prm_status`` join the metrics (``algos.prime.prm_metrics``).
    The algorithm itself is ``algos.step.before_update``, as on every back end: this function
    gathers its inputs from the experiences and spreads its output back over them. Returns the
    estimator inputs and outputs (for dumps and tests), the batch metrics, and the loss state
    for the actors (``loss_state``, None for a loss without one) and to checkpoint (``persisted``).
    """
    algorithm = cfg.algorithm
    inputs, index, old = gather_inputs(experiences, cfg, n_samples, optimizer_step)
    W, rows, widths = inputs.response_mask.shape[1], [len(e.index) for e in experiences], \
        [e.action_mask.shape[1] for e in experiences]
    rewards, mask, entropy = inputs.rewards, inputs.response_mask, inputs.entropy
    # the estimator sees the rows in rollout order (the order the embedded trainer and verl
    # give it): LESS's clustering depends on the order of a group's responses
    step = before_update(algorithm, inputs, persisted, old_logprobs=old, estimator_order=torch.argsort(index))
    metrics = step.metrics
    metrics["entropy/behaviour_mean"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    if inputs.process_q is not None:  # PRIME: the PRM's update status and its held-out metrics
        from ....algos.prime import prm_beta, prm_metrics

        prm_seen = _pad_cat([e.prm_seen.float() for e in experiences], W)
        metrics.update(prm_status or {})
        metrics.update(prm_metrics(prm_seen, inputs.process_q, inputs.correct, mask, inputs.group_index,
                                   beta=prm_beta(algorithm.estimator, algorithm.estimator_params)))
    if all(getattr(e, "rollout_log_probs", None) is not None for e in experiences):  # the correction is on
        from ....algos.is_correction import mismatch_by_entropy

        rollout = _pad_cat([e.rollout_log_probs.float() for e in experiences], W)
        metrics.update(mismatch_by_entropy(old, rollout, mask, entropy, step.threshold))
    lms = [getattr(e, "nucleus_logmass", None) for e in experiences]
    if any(lm is not None for lm in lms):  # a top-p rollout: the mean log P(nucleus) over response tokens
        if any(lm is None or lm.shape != e.action_mask.shape for lm, e in zip(lms, experiences)):
            raise RuntimeError("nucleus log-mass missing for, or shaped unlike, some experiences' action_mask")
        lm = _pad_cat([x.float() for x in lms], W)
        metrics["rollout/nucleus_logmass"] = float((lm * mask).sum() / mask.sum().clamp(min=1))

    adv_rows = step.advantages.split(rows)
    lm_rows = step.loss_mask.split(rows)
    for e, w, adv, lm in zip(experiences, widths, adv_rows, lm_rows, strict=True):
        e.advantages = adv[:, :w].to(torch.float32).contiguous()
        e.returns = e.advantages.clone()
        e.action_mask = (e.action_mask.bool() & lm[:, :w].bool()).to(e.action_mask.dtype)
        b = len(e.index)
        for k, v in metrics.items():
            e.info[k] = torch.full((b,), float(v))
    for e, r in zip(experiences, rewards.split(rows), strict=True):
        e.rewards = r
        e.info["return"] = r.clone()
        e.kl = None
    return {"inputs": inputs, "advantages": step.advantages, "loss_mask": step.loss_mask, "metrics": metrics,
            "loss_state": step.loss_state, "persisted": step.persisted,
            "prm_seen": prm_seen if inputs.process_q is not None else None}


class HapoExperienceMaker(RemoteExperienceMaker):
    """Upstream experience maker with the registry in place of the estimator chain."""

    _step = 0  # RL steps whose experience was made (a resumed run's controller restores it)
    # optimizer steps before the next batch (eapo_entropic's kappa schedule): the steps trained so far,
    # restored from the checkpoint on a resume, plus each batch made since at its own steps per RL step
    _optimizer_steps = 0
    loss_state: dict = {}  # a stateful loss's controller (checkpointed by HapoControllerMixin)
    # PRIME's implicit PRM group (OpenRLHF's critic group; controller/prm.py), hidden from upstream's
    # make_experience, which would score with it before its update
    prm_group = None
    _prm_status: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.critic_model_group is not None and transported(self.args.hapo).trains_prm:
            self.prm_group, self.critic_model_group = self.critic_model_group, None

    def make_experience(self, samples_list):
        group = self.actor_model_group
        ray.get(group.async_run_method(method_name="clear_behaviour_entropy"))
        experiences = super().make_experience(samples_list)
        if self.prm_group is not None:
            from . import prm

            self._prm_status = prm.run(self, self.prm_group, experiences, transported(self.args.hapo))
        fps = [fingerprint(e.sequences, e.attention_mask) for e in experiences]
        dup = self.args.ds.ring_attn_size * self.args.ds.tensor_parallel_size
        refs = group.async_run_method_batch(method_name="pop_behaviour", fingerprint=fps)
        got = self._flatten_results(refs, dup)
        if len(got) != len(experiences):
            raise RuntimeError(f"got {len(got)} behaviour-entropy batches for {len(experiences)} micro-batches")
        for e, (ent, logmass) in zip(experiences, got, strict=True):
            e.behaviour_entropy = ent
            e.nucleus_logmass = logmass
        return experiences

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences):
        args = self.strategy.args
        # the optimizer steps before this batch (a resume restores the count of those taken)
        cfg = transported(args.hapo)
        result = registry_advantages(experiences, cfg, args.rollout.n_samples_per_prompt,
                                     optimizer_step=self._optimizer_steps, persisted=self.loss_state,
                                     prm_status=self._prm_status)
        self.loss_state = result["persisted"]
        if result["loss_state"] is not None:  # every policy actor (every DP / TP / PP rank) trains this step with it
            ray.get(self.actor_model_group.async_run_method(method_name="set_loss_state", state=result["loss_state"]))
        self._step += 1
        self._optimizer_steps += optimizer_steps_per_step(cfg)
        d = os.environ.get(DUMP_ENV)
        if d:
            os.makedirs(d, exist_ok=True)
            inp = result["inputs"]
            torch.save({"rewards": inp.rewards, "response_mask": inp.response_mask, "entropy": inp.entropy,
                        "group_index": inp.group_index, "advantages": result["advantages"],
                        "process_q": inp.process_q, "prm_seen": result.get("prm_seen")},
                       os.path.join(d, f"advantages_step{self._step}.pt"))
            with open(os.path.join(d, f"experiences_step{self._step}.jsonl"), "w") as f:
                for e in experiences:
                    for i in range(e.sequences.shape[0]):
                        m = e.action_mask[i].bool()
                        f.write(json.dumps({"tokens": e.sequences[i][e.attention_mask[i].bool()].tolist(),
                                            "advantages": e.advantages[i][m].tolist()}) + "\n")
            with open(os.path.join(d, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": self._step, **result["metrics"]}) + "\n")
            if result["loss_state"] is not None:  # what the actors trained this step with
                with open(os.path.join(d, "loss_state.jsonl"), "a") as f:
                    f.write(json.dumps({"step": self._step, **result["loss_state"]}) + "\n")
        for e in experiences:
            for name in ("behaviour_entropy", "nucleus_logmass", "process_q", "prm_seen"):
                if hasattr(e, name):
                    delattr(e, name)
        return experiences
