"""PRIME's implicit process reward model on OpenRLHF: its own Ray actor group (issue 59).

The group sits in OpenRLHF's critic slot (``train_ppo_ray`` builds it as it builds a critic:
``--critic.num_nodes`` x ``--critic.num_gpus_per_node`` actors, placed and, with
``--train.colocate_critic_reward`` / ``colocate_all``, colocated the same way, DeepSpeed ZeRO,
its checkpoint under ``<ckpt.path>/_critic`` written and loaded by OpenRLHF's own save and
resume). Each actor holds, as the recipe's PRM worker does (verl ``recipe/prime/prime_dp_rm.py``:
``DataParallelPRIMERewardModel(reward_module, ref_module)``):

* phi, the trainable PRM (an OpenRLHF ``Actor``: the policy's packing and masking, log-probs at
  temperature 1 -- a reward model's, not the sampler's tempered ones), with its own AdamW at
  ``prm.lr`` (constant), ``prm.weight_decay``, ``prm.betas``, clipped at ``prm.grad_clip``; one
  optimizer step per ``prm.mini_batch_size`` responses (null: the whole rollout batch) through
  DeepSpeed's gradient accumulation over the experience maker's micro-batches
  (``openrlhf.micro_rollout_batch_size`` rows: the PRM trains on the micro-batches it scores;
  ``prm.micro_batch_size`` is the embedded trainer's); a non-finite gradient skips the step (the
  policy's guard, ``nonfinite.py``: weights, moments and schedule untouched, ``prm/skipped_steps``,
  ``optim.max_consecutive_skips`` in a row stop the run), as the embedded PRM skips it;
* its frozen reference (``prm.ref_path``, null: phi's starting weights), a DeepSpeed eval engine.

q = log pi_phi(y_t) - log pi_ref(y_t) per response token (``algos.prime.implicit_q``); the loss is
``algos.prime.prm_loss`` (the recipe's ``ce``) with the estimator's beta. The experience maker
calls ``prm_append`` + ``prm_update`` and ``forward`` (the score) in ``prm.update``'s order
(``controller/prm.py``); OpenRLHF's own critic calls in its PPO step (``append``, ``fit``) do
nothing here: PRIME trains its PRM while the experience is made, as the recipe does.
"""

from __future__ import annotations

import os
from typing import Optional

import ray
import torch
from openrlhf.models import Actor
from openrlhf.trainer.ray.launcher import BaseModelActor
from openrlhf.utils.deepspeed.deepspeed_utils import offload_deepspeed_states, reload_deepspeed_states

from ....algos import prime as prime_algo
from ....cluster.ports import OutsideEphemeralPort
from ....config import transported
from ....config.prm import openrlhf_prm_batches
from .nonfinite import DeepSpeedGradGuard

CKPT_DIR = "_critic"  # OpenRLHF's critic checkpoint directory: its save and resume paths, unchanged


def resume_tag(ckpt_root: str) -> str:
    """The checkpoint the PRM resumes from: the policy's (``<ckpt_root>/_actor/latest``, the tag
    OpenRLHF's policy actor loads), never the PRM's own newest -- a run killed between the two saves
    would otherwise pair a policy of step N with a PRM of another step. One named line when the
    PRM has no checkpoint of that step, or the policy none at all."""
    latest = os.path.join(ckpt_root, "_actor", "latest")
    if not os.path.isfile(latest):
        raise ValueError(f"the PRM has a checkpoint in {os.path.join(ckpt_root, CKPT_DIR)} but the policy has none "
                         f"({latest} is missing): the two resume together or not at all")
    with open(latest) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(ckpt_root, CKPT_DIR, tag)):
        have = sorted(d for d in os.listdir(os.path.join(ckpt_root, CKPT_DIR))
                      if os.path.isdir(os.path.join(ckpt_root, CKPT_DIR, d)))
        raise ValueError(f"the policy resumes from {tag} but the PRM has no checkpoint of it (it has {have}): the "
                         f"two were not saved together (a run stopped between the two saves?)")
    return tag


@ray.remote(num_gpus=1)
class HapoPRMActor(OutsideEphemeralPort, BaseModelActor):
    """phi, its reference and its optimizer on one rank of the PRM group (module docstring)."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None):
        args = strategy.args
        cfg = transported(args.hapo)
        self.beta = prime_algo.prm_beta(cfg.algorithm.estimator, cfg.algorithm.estimator_params)
        self.disable_ds_ckpt = args.ckpt.disable_ds
        # DeepSpeed's accumulation boundary is the PRM's own mini-batch, not the policy's train batch
        # (set before the process group: DeepSpeed's accumulation steps are derived from them there)
        dup = strategy.ring_attn_size * strategy.ds_tensor_parallel_size  # actors handed the same micro-batches
        mini, micro = openrlhf_prm_batches(cfg, self._world_size // dup)
        strategy.train_batch_size, strategy.micro_train_batch_size = mini, micro
        if cfg.backend == "megatron":
            # beside the Megatron policy, ds.tensor_parallel_size carries its TP x PP (so the controller
            # hands a replica's micro-batches to all its ranks, and this group's too): the PRM itself is
            # pure data parallelism over every actor, each micro-batch trained on by its `dup` actors alike
            # -- their gradients averaged, as one -- so DeepSpeed's batch counts each row `dup` times
            strategy.ds_tensor_parallel_size, strategy.train_batch_size = 1, mini * dup
        self._setup_distributed(strategy)

        def build(path, ds_config):
            return Actor(path, attn_implementation=args.ds.attn_implementation,
                         experts_implementation=args.ds.experts_implementation, param_dtype=args.ds.param_dtype,
                         ds_config=ds_config, packing_samples=args.ds.packing_samples, temperature=1.0)

        phi = build(cfg.prm.path or pretrain, strategy.get_ds_train_config())
        if args.actor.gradient_checkpointing_enable:
            phi.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": args.actor.gradient_checkpointing_reentrant})
        p = cfg.prm
        optim = dict(optim="adam", muon={}, adam={"lr": p.lr, "betas": tuple(p.betas), "eps": 1e-8,
                                                  "weight_decay": p.weight_decay},
                     lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=1.0, max_norm=p.grad_clip,
                     scheduler_steps=max_steps)
        self.model, self.optim, self.scheduler = strategy.prepare((phi, optim))
        # a non-finite gradient skips the PRM's step, as the policy's (nonfinite.py) and the embedded PRM's
        self.grad_guard = DeepSpeedGradGuard(self.model.model, cfg.optim.max_consecutive_skips)
        self.ref = strategy.prepare(build(p.ref_path or cfg.prm.path or pretrain,
                                          strategy.get_ds_eval_config(offload=args.ref.offload)))
        self.ref.eval()
        ckpt = os.path.join(args.ckpt.path, CKPT_DIR)
        if args.ckpt.load_enable and os.path.exists(ckpt):
            tag = resume_tag(args.ckpt.path)
            strategy.print(f"Loading the PRM checkpoint: {ckpt} ({tag}, the policy's)")
            strategy.load_ckpt(self.model.model, ckpt, tag=tag)
        self.buffer: list = []
        if args.ds.enable_sleep:  # colocated: off the GPU until the experience maker needs it
            self.offload_states()

    # ------------------------------------------------------------------ scoring
    def _q(self, sequences, action_mask, attention_mask, *, grad: bool) -> torch.Tensor:
        """q [b, A] (zero off the response); the gradient through phi's log-probs when ``grad``."""
        device = torch.cuda.current_device()
        sequences, action_mask, attention_mask = (t.to(device) for t in (sequences, action_mask, attention_mask))
        with torch.no_grad():
            ref = self.ref(sequences, action_mask, attention_mask, ring_attn_group=self.strategy.ring_attn_group)
        with torch.set_grad_enabled(grad):
            logp = self.model(sequences, action_mask, attention_mask, ring_attn_group=self.strategy.ring_attn_group)
        return prime_algo.implicit_q(logp.float(), ref.float(), action_mask.bool())

    def forward(self, sequences: torch.LongTensor, action_mask: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, packed_seq_lens=None) -> torch.Tensor:
        """The score: q per response token of a micro-batch, [b, A] on the CPU."""
        self.model.eval()
        q = self._q(sequences, action_mask, attention_mask, grad=False)
        self.model.train()
        return q.cpu()

    # ------------------------------------------------------------------ training
    def prm_append(self, experience, outcome: torch.Tensor) -> None:
        """One micro-batch of this rank's share of the rollout batch and its rows' outcomes (the
        verifier's 0/1, before any length penalty); ``experience.index``: its rows' rollout positions."""
        if outcome.shape != (experience.sequences.shape[0],) or len(experience.index) != outcome.numel():
            raise ValueError(f"PRM: {tuple(outcome.shape)} outcomes for a micro-batch of "
                             f"{experience.sequences.shape[0]} rows ({len(experience.index)} positions)")
        self.buffer.append((experience, outcome.float()))

    def prm_update(self) -> dict:
        """Train on the appended micro-batches in their order, DeepSpeed stepping at each mini-batch's
        boundary; returns the mean loss and the last step's gradient norm, and each row's q from the
        forward before its mini-batch's optimizer step (``rows``: rollout position -> q on the row's
        response tokens), as the recipe's ``update_rm`` returns its ``rm_scores``."""
        device = torch.cuda.current_device()
        self.model.train()
        losses, norms, seen = [], [], {}
        gas = self.strategy.accumulated_gradient
        for n, (e, outcome) in enumerate(self.buffer):
            q = self._q(e.sequences, e.action_mask, e.attention_mask, grad=True)
            outcome = outcome.to(device)
            mask = e.action_mask.to(device).bool()
            loss = prime_algo.prm_loss(q, outcome, mask, beta=self.beta)
            self.strategy.backward(loss, self.model, self.optim)
            self.grad_guard.step()  # the strategy's optimizer_step (engine.step()), skipping a non-finite one
            if (n + 1) % gas == 0:
                norms.append(self.grad_guard.norm)
            losses.append(float(loss.detach()))
            q_host, mask_host = q.detach().float().cpu(), mask.cpu()  # one copy per micro-batch, not per row
            for j, row in enumerate(e.index):
                seen[int(row)] = q_host[j][mask_host[j]]
        self.buffer = []
        status = {"prm/loss": sum(losses) / max(len(losses), 1), "prm/grad_norm": norms[-1] if norms else 0.0}
        status = self.strategy.all_reduce(status)
        status["prm/skipped_steps"] = float(self.grad_guard.skipped)  # DeepSpeed's count: in the PRM's checkpoint
        return {"status": status, "rows": seen}

    # OpenRLHF's PPO step calls the critic's append and fit after the experience is made: PRIME's PRM
    # has trained by then (prm.update before / after) or never trains (none)
    def append(self, experience) -> None:
        return None

    def fit(self) -> dict:
        return {}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        args = self.strategy.args
        if not self.disable_ds_ckpt:
            self.strategy.save_ckpt(self.model.model, os.path.join(args.ckpt.path, CKPT_DIR), tag, args.ckpt.max_num,
                                    args.ckpt.max_mem, client_states or {}, metric_value=metric_value,
                                    metric_key=metric_key)

    def save_model(self):
        return None  # the PRM's weights live in its DeepSpeed checkpoint; the run's model is the policy's

    def reload_states(self):
        reload_deepspeed_states(self.model.model)

    def offload_states(self):
        offload_deepspeed_states(self.model.model)
