"""``PolicyModelActor`` subclass: behaviour entropy with the old log-probs, hapo's loss.

Subclasses ``PolicyModelActor.__ray_actor_class__`` (the plain class under Ray's
decorator) and re-wraps it with ``ray.remote(num_gpus=1)`` like upstream. Ray
pickles actor classes by import path, so this module must be importable in every
worker: install the package in the same environment on every node (or ship it with
a Ray ``runtime_env``; see docs/openrlhf.md).

* ``forward`` (OpenRLHF's old-log-prob pass, called once per micro-batch by
  ``RemoteExperienceMaker.make_experience``) keeps its upstream signature and
  return value, and additionally computes the per-token entropy of the behaviour
  policy at the rollout temperature, chunked over tokens in fp32 (from the fused
  head's pass when it is installed, else from upstream's logits) and, under a top-p
  rollout, log P(nucleus) per response token (``rollout/nucleus_logmass``). Both are
  kept in a FIFO on the actor and fetched by the experience maker with
  ``pop_behaviour`` (same micro-batch dispatch, so the same order); each entry
  carries a fingerprint of its sequences and a mismatch is an error.
* rank 0's ``MASTER_PORT`` lies outside the kernel's ephemeral range (``cluster/ports.py``);
* a non-finite gradient skips the optimizer step (``nonfinite.py``), counted as
  ``actor_skipped_steps`` in ``fit``'s status;
* ``init_model_from_pretrained`` builds the upstream actor, swaps the policy
  model's forward for the fused LM head (``fused_head.py``; upstream's is kept,
  with a logged reason, where the fused head cannot serve), replaces
  ``trainer.actor_loss_fn`` with :class:`HapoPolicyLoss` and hooks the model's
  forward to hand the loss the current entropy (EntroReg) and, when dumping, the
  tokens of each row.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import deque
from typing import Optional, Union

import ray
import torch
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from ....algos.entropy import entropy_from_logits
from ....cluster.ports import OutsideEphemeralPort
from ....config import RunConfig, transported
from ....algos.nucleus import metric_due, sharded_nucleus_logmass, sharded_nucleus_stats
from .fused_head import install_fused_head
from .loss import DUMP_ENV, HapoPolicyLoss, LossStateSink
from .nonfinite import DeepSpeedGradGuard

logger = logging.getLogger(__name__)


def fingerprint(sequences: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """Order-sensitive digest of a micro-batch's unpadded token ids."""
    h = hashlib.sha1()
    for row, m in zip(sequences.cpu(), attention_mask.cpu()):
        h.update(row[m.bool()].numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def loss_from_config(cfg: RunConfig) -> HapoPolicyLoss:
    """The actors' loss for the run config ``cfg`` (``config.transported(args.hapo)``)."""
    a = cfg.algorithm
    isc = a.is_correction  # "behaviour" picks the engine's log-probs (flags.engine_logprobs_mode), not the loss
    isc = {"level": isc.level, "mode": isc.mode, "gating": isc.gating, "threshold": isc.threshold}
    return HapoPolicyLoss(a.loss, dict(a.loss_params), a.aggregation,
                          norm_constant=float(cfg.rollout.max_new_tokens), is_correction=isc)


def step_seed(seed: int, step: int) -> int:
    """The global RNG's seed for RL step ``step`` of a run seeded ``seed`` (the same after a resume)."""
    return (int(seed) * 1_000_003 + int(step)) % (2 ** 63)


class BehaviourEntropyStore:
    """The behaviour entropy of each old-log-prob micro-batch -- and, under a top-p rollout,
    its log P(nucleus) per token -- kept on the policy actor until the experience maker
    fetches them (FIFO, checked by a fingerprint of the rows)."""

    def _keep_behaviour_entropy(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                                entropy: torch.Tensor, nucleus_logmass: Optional[torch.Tensor] = None) -> None:
        if not hasattr(self, "_behaviour_entropy"):
            self._behaviour_entropy = deque()
        lm = None if nucleus_logmass is None else nucleus_logmass.cpu()
        self._behaviour_entropy.append((fingerprint(sequences, attention_mask), entropy.cpu(), lm))

    def clear_behaviour_entropy(self) -> int:
        store = getattr(self, "_behaviour_entropy", deque())
        n = len(store)
        store.clear()
        return n

    def pop_behaviour(self, fingerprint: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(entropy [B, A], log P(nucleus) [B, A] or None at top-p 1) of the next micro-batch."""
        store = getattr(self, "_behaviour_entropy", None)
        if not store:
            raise RuntimeError("pop_behaviour: no stored entropy (forward was not called for this batch)")
        fp, ent, lm = store.popleft()
        if fp != fingerprint:
            raise RuntimeError("behaviour entropy out of order: the stored micro-batch does not match the requested one")
        return ent, lm

    def pop_behaviour_entropy(self, fingerprint: str) -> torch.Tensor:
        return self.pop_behaviour(fingerprint)[0]


class HapoPolicyModelActorImpl(OutsideEphemeralPort, BehaviourEntropyStore, LossStateSink,
                               PolicyModelActor.__ray_actor_class__):
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        from ....cluster.netif import check_process_env

        check_process_env()  # a misnamed socket interface fails here, not as a hang in the first collective
        super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        cfg = transported(strategy.args.hapo)
        self._entropy_chunk = cfg.algorithm.entropy_chunk_size
        self.loss_fn = loss_from_config(cfg)
        self.trainer.actor_loss_fn = self.loss_fn
        # the token IS ratio's mean / max and a method's own metrics (stare/...) join upstream's
        step = self.trainer.training_step

        def training_step(experience, *args, **kwargs):
            self.loss_fn.info_sink = experience.info
            try:
                return step(experience, *args, **kwargs)
            finally:
                self.loss_fn.info_sink = None

        self.trainer.training_step = training_step
        self.trainer.actor.register_forward_hook(self._training_forward_hook, with_kwargs=True)
        self._install_grad_guard(cfg.optim.max_consecutive_skips)
        self._fused = False
        self._nucleus_top_p = float(cfg.rollout.top_p)
        self._nucleus_every = cfg.rollout.nucleus_metric_every
        # RL steps trained so far (the metric's cadence; a resume continues from the checkpoint's step)
        self._steps_done = int((getattr(self, "checkpoint_states", None) or {}).get("global_step", 0))
        if cfg.model.fused_head:
            why_not = install_fused_head(self.actor, self._entropy_chunk, self._nucleus_top_p)
            self._fused = why_not is None
            self.actor._hapo_signals_top_p = self.loss_fn.signals_top_p  # PAEC's head signals, training passes
            if why_not:
                logger.warning("hapo: fused LM head off, OpenRLHF's head is used: %s", why_not)

    def _install_grad_guard(self, max_consecutive: int) -> None:
        """A non-finite gradient skips the step (nonfinite.py): the strategy's optimizer step
        for the actor goes through the guard, and its grad norm is the guard's (nan / inf for a
        skipped step; upstream would report the previous step's)."""
        self.grad_guard = DeepSpeedGradGuard(self.actor.model, max_consecutive)
        step, norm = self.strategy.optimizer_step, self.strategy.get_grad_norm

        def optimizer_step(optimizer, model, scheduler, name="model", **kwargs):
            if model is self.actor or model is self.actor.model:
                return self.grad_guard.step()
            return step(optimizer, model, scheduler, name=name, **kwargs)

        def get_grad_norm(model):
            if (model is self.actor or model is self.actor.model) and self.grad_guard.norm is not None:
                return self.grad_guard.norm
            return norm(model)

        self.strategy.optimizer_step, self.strategy.get_grad_norm = optimizer_step, get_grad_norm

    def fit(self, kl_ctl: float = 0):
        # upstream's ppo_train shuffles the replay buffer from this process's global RNG, whose state a
        # resume does not restore: seeded from the run's seed and the step, the resumed step's micro-
        # batches are the uninterrupted step's (found resuming PRIME bitwise, issue 59)
        torch.manual_seed(step_seed(self.strategy.args.train.seed, self._steps_done))
        status = super().fit(kl_ctl)
        self._steps_done += 1
        status["actor_skipped_steps"] = float(self.grad_guard.skipped)  # DeepSpeed's count, checkpointed
        return status

    # ---------------------------------------------------------------- hooks
    def _training_forward_hook(self, module, args, kwargs, output):
        """Runs after every training forward of the actor (not the no-grad old-log-prob pass)."""
        if not module.training or not isinstance(output, tuple):
            return
        _, out = output
        if self.loss_fn.needs_entropy:
            self.loss_fn.pending_entropy = getattr(out, "entropy", None)
        if self.loss_fn.signals_top_p is not None:  # PAEC: the fused head's, else from upstream's logits
            seqs = args[0] if args else kwargs["sequences"]
            am = args[1] if len(args) > 1 else kwargs["action_mask"]
            self.loss_fn.pending_signals = self._head_signals(out, seqs, kwargs.get("attention_mask"), am.shape[1])
        if os.environ.get(DUMP_ENV):
            seqs = args[0] if args else kwargs["sequences"]
            mask = kwargs.get("attention_mask")
            self.loss_fn.pending_sequences = [row[m.bool()].tolist() for row, m in zip(seqs.cpu(), mask.cpu())]

    # ------------------------------------------------------ old log-probs
    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[Union[int, list[int]]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
    ) -> torch.Tensor:
        """Upstream's old-log-prob forward, plus the behaviour entropy (kept for ``pop_behaviour_entropy``)."""
        device = torch.cuda.current_device()
        mm_inputs = {}
        if mm_train_inputs_list and getattr(self.actor, "is_vlm", False):
            from openrlhf.utils.vlm_utils import merge_mm_train_inputs

            mm_inputs = merge_mm_train_inputs(mm_train_inputs_list, device)
        packed = bool(getattr(self.actor, "packing_samples", False))
        # the fused head returns the entropy with the log-probs; packed rows: OpenRLHF unpacks it to [B, T]
        entropy_out = packed or self._fused
        n_act = action_mask.shape[1]
        nucleus = metric_due(self._nucleus_top_p, self._nucleus_every, self._steps_done)
        self.actor._hapo_nucleus_top_p = self._nucleus_top_p if nucleus else 1.0  # the fused head's pass
        self.actor.eval()
        with torch.no_grad():
            action_log_probs, output = self.actor(
                sequences.to(device),
                action_mask.to(device),
                attention_mask.to(device),
                return_output=True,
                ring_attn_group=self.strategy.ring_attn_group,
                return_entropy=entropy_out,
                **mm_inputs,
            )
            if entropy_out:
                entropy = output.entropy[:, -n_act:].float()
            else:
                # logits are already divided by the rollout temperature inside Actor.forward;
                # row by row, each row's response slice is a contiguous view (no [B, A, V] copy)
                logits = output["logits"]
                T = logits.shape[1]
                entropy = torch.stack([
                    entropy_from_logits(logits[b, T - 1 - n_act: T - 1], chunk_size=self._entropy_chunk)
                    for b in range(logits.shape[0])
                ])
            am = action_mask.to(entropy.device).float()
            entropy = entropy * am
            logmass = None
            if nucleus:
                logmass = self._nucleus_logmass(output, sequences, attention_mask, n_act) * am
        self.actor.train()
        self._keep_behaviour_entropy(sequences, attention_mask, entropy, logmass)
        return action_log_probs.to("cpu")

    def _nucleus_logmass(self, output, sequences, attention_mask, n_act: int) -> torch.Tensor:
        """log P(nucleus) [B, n_act] at the response positions, from the trainer's full
        distribution at the rollout temperature: the fused head's own pass, else upstream's
        (temperature-scaled) logits."""
        if self._fused:
            return output.nucleus_logmass[:, -n_act:].float()
        top_p, chunk = self._nucleus_top_p, self._entropy_chunk
        return self._at_responses(output["logits"], sequences, attention_mask, n_act,
                                  lambda z: (sharded_nucleus_logmass(z, top_p, chunk_size=chunk),))[0]

    def _head_signals(self, output, sequences, attention_mask, n_act: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(nucleus entropy, top-two gap) [B, n_act] of a training pass, detached: the fused
        head's own, else from upstream's (temperature-scaled) logits."""
        if self._fused:
            return output.nucleus_entropy[:, -n_act:], output.top2_gap[:, -n_act:]
        top_p, chunk = self.loss_fn.signals_top_p, self._entropy_chunk

        def stats(z):
            st = sharded_nucleus_stats(z.detach(), top_p, chunk_size=chunk, entropy=True, top2_gap=True)
            return st.entropy, st.top2_gap

        return self._at_responses(output["logits"], sequences, attention_mask, n_act, stats)

    def _at_responses(self, logits, sequences, attention_mask, n_act: int, fn) -> tuple[torch.Tensor, ...]:
        """``fn`` (logit rows [..., V] -> per-row tensors) at the response positions [B, n_act];
        packed rows mapped back as upstream maps its entropy, padded rows one row at a time
        (each row's response slice is a view: no [B, A, V] copy)."""
        if getattr(self.actor, "packing_samples", False):
            from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

            group = self.strategy.ring_attn_group
            _, _, _, pad_len, indices = unpad_and_slice_tensor(sequences.to(logits.device),
                                                               attention_mask.to(logits.device), group)
            B, S = sequences.shape
            return tuple(gather_and_pad_tensor(t, group, pad_len, indices, B, S)[:, :-1][:, -n_act:] for t in fn(logits))
        T = logits.shape[1]
        rows = [fn(logits[b, T - 1 - n_act: T - 1]) for b in range(logits.shape[0])]
        return tuple(torch.stack(ts) for ts in zip(*rows))



HapoPolicyModelActor = ray.remote(num_gpus=1)(HapoPolicyModelActorImpl)
