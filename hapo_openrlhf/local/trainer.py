"""The embedded single-process RLVR trainer (CPU): the same ``algos`` registry,
reward and data code the cluster back ends use, driven by one small loop.

Per step: prompts -> G samples each -> reward -> behaviour log-probs + entropy ->
registry advantages -> registry loss -> update -> quadrant entropy change ->
metrics -> (atomic) checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import algos
from ..algos.advantages import grpo_sequence_advantage
from ..algos.prime import prm_beta as prime_beta
from ..algos.step import after_update, before_update
from ..algos.entropy import check_finite
from ..algos.nucleus import metric_due
from ..rundir import runlock
from ..rundir.checkpoint import list_complete, load_checkpoint, resumable_checkpoints, rng_state, save_checkpoint, set_rng_state
from ..config import RunConfig, dump_config
from ..data.templates import apply_template
from ..algos.grad_guard import SkipGuard
from ..rundir.preemption import Preempted
from ..rewards import MathVerifier, RewardStats
from . import eval_cache
from ..data.datasets import make_datasets
from .evaluate import evaluate
from ..rundir.logger import MetricsLogger
from .model import load_or_build, save_hf
from .prm import ImplicitPRM, check_prm_state
from ..generation.rollout import Rollout, concat_rollouts, generate
from .forward import fused_policy_loss, policy_forward
from .samples import dump_token_samples
from .sft import warmup

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    consumed_prompts: int = 0
    warmup_done: bool = False
    eval_before: dict = field(default_factory=dict)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient (algos/grad_guard.py)
    consecutive_skips: int = 0
    loss_state: dict = field(default_factory=dict)  # a stateful loss's controller (STARE), checkpointed
    # optimizer steps taken (one per PPO epoch of each RL step): eapo_entropic's kappa schedule reads it,
    # so a resume that changes optim.ppo_epochs continues the schedule from the steps actually taken
    optimizer_steps: int = 0


CheckpointStateError = algos.CheckpointStateError  # a damaged state: the resume falls back to an older checkpoint


def checked_train_state(trainer: Any, ckpt: Path, config: dict) -> TrainState:
    """The trainer state a checkpoint holds, every field checked -- types, finiteness, ranges, the
    step against the checkpoint's own step -- before anything is restored from it; a damaged one
    raises :class:`CheckpointStateError` naming the key (the resume then tries an older checkpoint).
    A checkpoint from before ``optimizer_steps`` gets its steps x its own config's PPO epochs."""
    if not isinstance(trainer, dict):
        raise CheckpointStateError(f"its trainer state is {type(trainer).__name__}, not a mapping")
    t = dict(trainer)
    if "optimizer_steps" not in t and isinstance(t.get("step"), int):
        t["optimizer_steps"] = t["step"] * int(config.get("optim", {}).get("ppo_epochs", 1))
    known = {f.name for f in dataclasses.fields(TrainState)}
    unknown = sorted(set(t) - known)
    if unknown:
        raise CheckpointStateError(f"trainer state has unknown key(s) {unknown}")
    for key in ("step", "consumed_prompts", "skipped_steps", "consecutive_skips", "optimizer_steps"):
        v = t.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointStateError(f"trainer.{key} must be an integer >= 0, got {v!r}")
    if not isinstance(t.get("warmup_done", False), bool):
        raise CheckpointStateError(f"trainer.warmup_done must be true or false, got {t['warmup_done']!r}")
    for key in ("eval_before", "loss_state"):
        if not isinstance(t.get(key, {}), dict):
            raise CheckpointStateError(f"trainer.{key} must be a mapping, got {t[key]!r}")
    for k, v in t.get("eval_before", {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CheckpointStateError(f"trainer.eval_before.{k} must be a finite number, got {v!r}")
    m = re.fullmatch(r"step_(\d+)", Path(ckpt).name)
    if m and int(m.group(1)) != t["step"]:
        raise CheckpointStateError(f"trainer.step {t['step']} is not the checkpoint's own step {int(m.group(1))}")
    return TrainState(**t)


@dataclass
class Batch:
    rollout: Rollout
    rewards: torch.Tensor  # [B]
    correct: torch.Tensor  # [B] bool
    group_index: torch.Tensor  # [B]


class LocalTrainer:
    def __init__(self, cfg: RunConfig, output_dir: str | Path | None = None, resume: bool = False):
        self.stop_requested = False  # set by a signal handler (see cli.py); checked at step boundaries
        self.cfg = cfg
        self.out = Path(output_dir or cfg.output_dir)
        runlock.acquire(self.out)  # one owner per run directory, before anything is written
        self.ckpt_root = self.out / "checkpoints"
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        self.state = TrainState()
        self._seed_everything(cfg.seed)
        self.model, self.tok = load_or_build(cfg.model, cfg.seed)
        self.task, self.train_problems, self.eval_problems = make_datasets(cfg)
        self.optim = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
        )
        warm = max(cfg.optim.lr_warmup_steps, 1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / warm))
        self.verifier = MathVerifier(timeout_s=cfg.algorithm.reward_timeout_s, wrong_value=cfg.algorithm.reward_wrong)
        self.loss_rng = torch.Generator().manual_seed(cfg.seed + 7)
        # PRIME's implicit PRM (an estimator that trains_prm): built from the policy when RL starts
        # (after any warm-up), or restored from the checkpoint
        self.prm: ImplicitPRM | None = None
        self.resumed_from = resumed_from = self._maybe_resume() if resume else None
        if not resume and list_complete(self.ckpt_root):
            raise ValueError(
                f"{str(self.ckpt_root)!r} already holds checkpoints; pass --resume to continue "
                f"or choose another --output-dir"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(dump_config(cfg))
        self.logger = MetricsLogger(self.out, resume_step=self.state.step if resumed_from else None)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _maybe_resume(self) -> Path | None:
        """Load the newest checkpoint that verifies (sizes and CRC-32 of its shards) and loads;
        newer ones that do not are skipped with a warning naming the reason."""
        good, bad = resumable_checkpoints(self.ckpt_root)
        for line in bad:
            log.warning("skipping checkpoint %s", line)
        tried = list(bad)
        for ckpt in good:
            try:
                shard, meta = load_checkpoint(ckpt)
            except Exception as e:  # noqa: BLE001 - an unreadable shard: fall back to an older one
                log.warning("skipping checkpoint %s: cannot be loaded (%s)", ckpt, e)
                tried.append(f"{ckpt}: cannot be loaded ({e})")
                continue
            try:  # its trainer and method state, before anything is restored from it
                state = checked_train_state(shard.get("trainer"), ckpt, meta.get("config", {}))
                algos.check_loss_state(self._saved_loss(meta), state.loss_state)
                check_prm_state(shard.get("prm", {}))
            except CheckpointStateError as e:
                log.warning("skipping checkpoint %s: %s", ckpt, e)
                tried.append(f"{ckpt}: {e}")
                continue
            self._restore(ckpt, shard, meta, state)
            return ckpt
        if tried:
            raise ValueError("--resume: no checkpoint under " + str(self.ckpt_root) + " can be used; tried, newest "
                             "first:\n  " + "\n  ".join(tried))
        log.warning("--resume: no complete checkpoint under %s; starting fresh", self.ckpt_root)
        return None

    @staticmethod
    def _saved_loss(meta: dict) -> str | None:
        return meta.get("config", {}).get("algorithm", {}).get("loss")

    def _restore(self, ckpt: Path, shard: dict, meta: dict, state: "TrainState") -> None:
        changed = _config_diff(meta.get("config", {}), self.cfg.to_dict())
        if changed:
            log.warning("resuming %s with a changed config (applied from here on): %s", ckpt, ", ".join(changed))
        try:
            self.model.load_state_dict(shard["model"])
        except RuntimeError as e:
            shape = [c for c in changed if c.startswith("model.")]
            raise ValueError(f"checkpoint {ckpt} holds a model of another shape ({', '.join(shape) or 'model.*'} "
                             f"changed); resume with the config it was saved with, or start a new --output-dir"
                             ) from e
        self.optim.load_state_dict(shard["optimizer"])
        self.sched.load_state_dict(shard["scheduler"])
        self._apply_optim_config()
        self.loss_rng.set_state(shard["loss_rng"])
        old = meta.get("config", {})
        self.state = state
        # a stateful loss's state trains what this run's config says (applied, or refused by name)
        a, old_a = self.cfg.algorithm, old.get("algorithm", {})
        self.state.loss_state, notes = algos.loss_resume(old_a.get("loss"), old_a.get("loss_params"), a.loss,
                                                         dict(a.loss_params), self.state.loss_state)
        for note in notes:
            log.warning("resuming %s: %s", ckpt, note)
        self._restore_prm(ckpt, shard, old)
        set_rng_state(shard["rng"])
        log.info("resumed from %s (step %d)", ckpt, self.state.step)

    def _build_prm(self) -> ImplicitPRM:
        a, m = self.cfg.algorithm, self.cfg.model
        return ImplicitPRM(self.cfg.prm, self.model, beta=prime_beta(a.estimator, a.estimator_params),
                           chunk_size=a.entropy_chunk_size, fused=m.fused_head, packing=m.packing)

    def _restore_prm(self, ckpt: Path, shard: dict, old: dict) -> None:
        """The implicit PRM a checkpoint holds, for a run whose estimator trains one; each other case named."""
        held = "prm" in shard
        if held and self.cfg.trains_prm:
            moved = [f"prm.{k}: {old.get('prm', {}).get(k)!r} -> {getattr(self.cfg.prm, k)!r}"
                     for k in ("path", "ref_path") if old.get("prm", {}).get(k) != getattr(self.cfg.prm, k)]
            if moved:
                raise ValueError(f"--resume: {ckpt} holds the implicit PRM trained from its own starting weights and "
                                 f"reference; this config names others ({', '.join(moved)}), which a resume would not "
                                 f"train: resume with the checkpoint's, or start a new --output-dir")
            self.prm = self._build_prm()
            self.prm.load_state_dict(shard["prm"])
        elif held:
            log.warning("resuming %s: it holds an implicit PRM, which algorithm.estimator %s does not use: dropped",
                        ckpt, self.cfg.algorithm.estimator)
        elif self.cfg.trains_prm and self.state.step > 0:
            log.warning("resuming %s: it holds no implicit PRM (saved under algorithm.estimator %s); the PRM starts "
                        "from the policy's weights at step %d", ckpt, old.get("algorithm", {}).get("estimator"),
                        self.state.step)

    def _apply_optim_config(self) -> None:
        """A resume trains at this run's optimizer settings, not the checkpoint's: the
        loaded param groups and scheduler carry the old lr / betas / weight decay, so an
        override such as ``--resume --set optim.lr=...`` is applied here (the moments and
        the schedule's position are the checkpoint's)."""
        o = self.cfg.optim
        self.sched.base_lrs = [o.lr for _ in self.optim.param_groups]
        for g, fn in zip(self.optim.param_groups, self.sched.lr_lambdas, strict=True):
            g.update(initial_lr=o.lr, lr=o.lr * fn(self.sched.last_epoch), betas=tuple(o.betas),
                     weight_decay=o.weight_decay)
        self.sched._last_lr = [g["lr"] for g in self.optim.param_groups]

    def save(self) -> Path:
        shard = {
            "model": self.model.state_dict(),
            "optimizer": self.optim.state_dict(),
            "scheduler": self.sched.state_dict(),
            "trainer": vars(self.state),
            "rng": rng_state(),
            "loss_rng": self.loss_rng.get_state(),
        }
        if self.prm is not None:
            shard["prm"] = self.prm.state_dict()
        meta = {"config": self.cfg.to_dict(), "consumed_prompts": self.state.consumed_prompts}
        return save_checkpoint(self.ckpt_root, self.state.step, {0: shard}, meta, self.cfg.trainer.keep_last)

    # ---------------------------------------------------------------- phases
    def run_warmup(self, on_step=None) -> float:
        w = self.cfg.warmup
        loss = warmup(self.model, self.tok, self.task, self.cfg.data.template, steps=w.steps,
                      batch_size=w.batch_size, lr=w.lr, seed=self.cfg.seed + 1, on_step=on_step)
        self.state.warmup_done = True
        return loss

    def evaluate(self) -> dict[str, float]:
        e = self.cfg.eval
        return evaluate(self.model, self.tok, self.eval_problems, template=self.cfg.data.template, n=e.n_samples,
                        temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens,
                        seed=self.eval_seed)

    @property
    def eval_seed(self) -> int:
        return self.cfg.seed + 99 if self.cfg.eval.seed is None else self.cfg.eval.seed

    def _evaluate_start(self) -> dict[str, float]:
        """The held-out evaluation before RL: reused from the starting model's ``eval.json``
        when this run starts from a saved model with no warm-up and nothing that evaluation
        depends on differs (local/eval_cache.py); evaluated otherwise."""
        saved = Path(self.cfg.model.path or ".") / eval_cache.FILE
        if self.cfg.model.path and self.cfg.warmup.steps == 0 and (saved.exists() or saved.is_symlink()):
            # the key hashes the weights and the model's files: only worth it when there is a file to match
            key = eval_cache.eval_key(self.model, self.cfg, self.eval_problems, self.eval_seed, self.cfg.model.path)
            cached = eval_cache.lookup(self.cfg.model.path, key)
            if cached is not None:
                return cached
        return self.evaluate()

    def next_prompts(self, n: int):
        """The next ``n`` training problems: a fixed per-epoch permutation, so the data
        position is just ``consumed_prompts`` (saved in every checkpoint)."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.state.consumed_prompts, len(self.train_problems))
            out.append(self.train_problems[self._permutation(epoch)[i]])
            self.state.consumed_prompts += 1
        return out

    def _permutation(self, epoch: int) -> list[int]:
        if getattr(self, "_perm_epoch", None) != epoch:
            perm = list(range(len(self.train_problems)))
            random.Random(self.cfg.seed * 100_003 + epoch).shuffle(perm)
            self._perm_epoch, self._perm = epoch, perm
        return self._perm

    # ------------------------------------------------------------------ rollout
    def _sample(self, problems) -> Batch:
        r, a = self.cfg.rollout, self.cfg.algorithm
        prompts = [apply_template(self.cfg.data.template, p.problem) for p in problems]
        ro = generate(self.model, self.tok, prompts, n=r.samples_per_prompt, temperature=r.temperature,
                      top_p=r.top_p, max_new_tokens=r.max_new_tokens, check_positions=True)
        answers = [p.answer for p in problems for _ in range(r.samples_per_prompt)]
        scores = torch.tensor(self.verifier.score_batch(ro.responses, answers), dtype=torch.float32)
        rewards = scores.clone()
        if a.overlong.enable:
            lengths = ro.response_mask_BR.sum(-1)
            rewards += algos.overlong_penalty(lengths, r.max_new_tokens, a.overlong.cache_len)
        group = torch.arange(len(problems)).repeat_interleave(r.samples_per_prompt)
        return Batch(ro, rewards, scores > 0.5, group)

    def collect(self) -> tuple[Batch, dict[str, float]]:
        """One step's batch; with dynamic sampling, refill until every group is informative."""
        r, a = self.cfg.rollout, self.cfg.algorithm
        self.verifier.stats = RewardStats()  # reward outcome counts are per step
        if a.accuracy_filter.enable:
            return self._accuracy_filtered()
        if not a.dynamic_sampling:
            return self._sample(self.next_prompts(r.prompts_per_step)), {}
        buf = algos.DynamicSamplingBuffer(r.prompts_per_step, a.max_gen_rounds)
        while not buf.ready and not buf.exhausted:
            b = self._sample(self.next_prompts(r.prompts_per_step))
            # DAPO filters on accuracy: a group whose answers are all right or all wrong
            # carries no signal even if the overlong penalty makes its rewards differ
            ok = algos.informative_groups(b.correct.float(), b.group_index)
            G = r.samples_per_prompt
            groups = [(b, list(range(j * G, (j + 1) * G))) for j in range(r.prompts_per_step)]
            buf.add(groups, [bool(ok[j * G]) for j in range(r.prompts_per_step)])
        kept = buf.take()
        if not kept:  # every group degenerate for max_gen_rounds: train on the last batch
            log.warning("dynamic sampling: no informative group in %d rounds; using the last batch", buf.rounds)
            return b, buf.metrics()
        return _merge_groups(kept, self.tok.pad_token_id), buf.metrics()

    def _accuracy_filtered(self) -> tuple[Batch, dict[str, float]]:
        """PRIME's filter (``algorithm.accuracy_filter``; the recipe's ``filter_and_downsample``): sample
        ``oversample`` x the step's prompts at once; the groups whose accuracy is in [lower, upper] (and, with
        ``drop_truncated``, whose longest response is under max_new_tokens - 1 tokens) come first, each part
        in sampled order (a stable sort, where the recipe's ``argsort`` leaves ties' order to the kernel);
        the first ``prompts_per_step`` groups are the batch."""
        r, f = self.cfg.rollout, self.cfg.algorithm.accuracy_filter
        P, G = r.prompts_per_step, r.samples_per_prompt
        n = max(P, math.ceil(P * f.oversample - 1e-9))
        b = self._sample(self.next_prompts(n))
        acc = b.correct.float().view(n, G).mean(-1)
        ok = (acc >= f.lower) & (acc <= f.upper)
        if f.drop_truncated:
            ok &= b.rollout.response_mask_BR.sum(-1).view(n, G).max(-1).values < r.max_new_tokens - 1
        order = torch.argsort(ok.to(torch.int8), descending=True, stable=True)[:P].tolist()
        kept = [(b, list(range(j * G, (j + 1) * G))) for j in order]
        metrics = {"filter/rejected_frac": float(1 - ok.float().mean()),
                   "filter/failing_kept_frac": float((~ok[order]).float().mean())}
        return _merge_groups(kept, self.tok.pad_token_id), metrics

    # ------------------------------------------------------------------- update
    def _behaviour(self, ro: Rollout, nucleus: bool = False, sampler: bool = False):
        """(log-probs, entropy) at the rollout temperature; with ``nucleus`` and top-p < 1 a
        third tensor, log P(nucleus) per token (``rollout/nucleus_logmass``). ``sampler``:
        the sampler's own values when it recorded them (``rollout.old_logprobs``), else a
        no-grad forward."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        top_p = r.top_p if nucleus and r.top_p < 1.0 else None
        if sampler and ro.logprobs_BR is not None:
            check_finite("log-probs", ro.logprobs_BR, ro.response_mask_BR)  # as the scoring forward checks them
            return (ro.logprobs_BR, ro.entropy_BR) + ((ro.logmass_BR,) if top_p is not None else ())
        with torch.no_grad():
            return policy_forward(self.model, ro, temperature=r.temperature, chunk_size=a.entropy_chunk_size,
                                  fused=self.cfg.model.fused_head, packing=self.cfg.model.packing,
                                  nucleus_top_p=top_p)

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg, a = self.cfg, self.cfg.algorithm
        batch, metrics = self.collect()
        ro = batch.rollout
        mask = ro.response_mask_BR
        due = metric_due(cfg.rollout.top_p, cfg.rollout.nucleus_metric_every, self.state.step)
        old_logp, ent, *logmass = self._behaviour(ro, nucleus=due, sampler=cfg.rollout.old_logprobs != "forward")
        if logmass:  # top-p rollouts: the mean log P(nucleus) over response tokens (docs/method.md 6b)
            metrics["rollout/nucleus_logmass"] = float(logmass[0].sum() / mask.sum().clamp(min=1))
        process_q = None
        if self.cfg.trains_prm:  # PRIME: the implicit PRM's update and q, in prm.update's order (local/prm.py)
            if self.prm is None:
                self.prm = self._build_prm()
            process_q, prm_metrics = self.prm.step(ro, batch.correct, batch.group_index)
            metrics.update(prm_metrics)
        inputs = algos.AdvantageInputs(
            rewards=batch.rewards, response_mask=mask, entropy=ent, group_index=batch.group_index,
            old_logprobs=old_logp, correct=batch.correct,
            step=self.state.optimizer_steps,  # optimizer steps taken so far (one per PPO epoch)
            response_ids=ro.response_ids_BR, process_q=process_q,
        )
        # the algorithm's step, as on every back end (algos/step.py): advantages, loss mask, quadrants
        # and their metrics, and a stateful loss's state (STARE's controller) for this step
        step = before_update(a, inputs, self.state.loss_state, old_logprobs=old_logp)
        self.state.loss_state = step.persisted
        metrics.update(step.metrics)
        seq_adv = grpo_sequence_advantage(inputs)
        qmasks = step.quadrant_masks
        update = self._update(ro, old_logp, step.advantages, step.loss_mask, step.loss_state)
        self.state.optimizer_steps += cfg.optim.ppo_epochs
        metrics.update(update)
        # ... and after the update, a loss that learns from it (PAEC's anchor) records what it saw
        self.state.loss_state = after_update(a, self.state.loss_state, update)
        every = cfg.trainer.entropy_change_every  # the re-scoring after the update, on steps 1, 1 + N, ...
        ent_after = None
        if every and self.state.step % every == 0:
            _, ent_after = self._behaviour(ro)
            metrics.update(algos.quadrant_entropy_change(qmasks, ent, ent_after))
        metrics.update(self._rollout_metrics(batch, ent, ent_after, step.advantages))
        self.state.step += 1
        t = cfg.trainer
        if t.sample_every and (self.state.step % t.sample_every == 0 or self.state.step == 1):
            dump_token_samples(self.out / "samples" / f"step_{self.state.step:08d}.jsonl", self.tok, ro,
                               batch.rewards, ent, step.advantages, seq_adv.unsqueeze(-1) * mask, qmasks,
                               t.sample_count)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _update(self, ro: Rollout, old_logp, adv, loss_mask, loss_state=None) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algorithm
        B = adv.shape[0]
        normalizer = algos.default_normalizer(loss_mask, a.aggregation)
        # losses that take `entropy` (EntroReg) need the current policy's entropy with grad
        needs_entropy = "entropy" in algos.LOSSES.get(a.loss).accepts
        signals_top_p = algos.head_signals_top_p(a.loss, a.loss_params)  # PAEC's nucleus entropy, top-two gap
        in_forward = cfg.model.fused_head and cfg.model.fused_loss_in_forward and algos.LOSSES.get(a.loss).row_local
        self.model.train()
        sums: dict[str, float] = {}
        epochs, total = cfg.optim.ppo_epochs, 0.0
        for epoch in range(epochs):
            self.optim.zero_grad(set_to_none=True)
            for s in range(0, B, cfg.optim.micro_batch_size):
                idx = list(range(s, min(B, s + cfg.optim.micro_batch_size)))
                mro = ro.select(idx)
                kw = dict(aggregation=a.aggregation, normalizer=normalizer, generator=self.loss_rng,
                          loss_state=loss_state, **a.loss_params)
                if in_forward:
                    def loss_of(lp, en, rows, idx=idx):
                        i = idx[rows]
                        return algos.compute_policy_loss(a.loss, lp, old_logp[i], adv[i], loss_mask[i], entropy=en,
                                                         **kw)[0]

                    loss, logp, ent = fused_policy_loss(self.model, mro, loss_of, temperature=cfg.rollout.temperature,
                                                        chunk_size=a.entropy_chunk_size, packing=cfg.model.packing)
                    # metrics (clip fraction, KL, ...) from the whole micro-batch's detached values
                    _, m = algos.compute_policy_loss(a.loss, logp, old_logp[idx], adv[idx], loss_mask[idx],
                                                     entropy=ent, **kw)
                else:
                    logp, ent, *sig = policy_forward(self.model, mro, temperature=cfg.rollout.temperature,
                                                     chunk_size=a.entropy_chunk_size, with_entropy_grad=needs_entropy,
                                                     fused=cfg.model.fused_head, packing=cfg.model.packing,
                                                     signals_top_p=signals_top_p)
                    if sig:
                        kw = dict(kw, nucleus_entropy=sig[0], top2_gap=sig[1])
                    loss, m = algos.compute_policy_loss(a.loss, logp, old_logp[idx], adv[idx], loss_mask[idx],
                                                        entropy=ent, **kw)
                loss.backward()
                total += float(loss.detach()) / epochs
                w = len(idx) / B
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + w * v / epochs
            # the norm before clipping; a NaN norm would not clip (nan < max_norm is False): skip instead
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip))
            if self._skip_update(grad_norm, optimizer_step=self.state.step * epochs + epoch + 1):
                self.optim.zero_grad(set_to_none=True)  # weights, moments, step count and schedule untouched
                continue
            self.optim.step()
            self.sched.step()
        sums.update({"actor/loss": total, "actor/grad_norm": grad_norm, "actor/lr": self.sched.get_last_lr()[0],
                     "actor/skipped_steps": float(self.state.skipped_steps)})
        return sums

    def _skip_update(self, grad_norm: float, optimizer_step: int) -> bool:
        """The shared rule (algos/grad_guard.py); its counters live in the checkpointed TrainState."""
        g = SkipGuard(self.cfg.optim.max_consecutive_skips, "the embedded trainer")
        g.load_state_dict({"skipped": self.state.skipped_steps, "consecutive": self.state.consecutive_skips})
        try:
            return g.update(grad_norm, step=optimizer_step)
        finally:
            self.state.skipped_steps, self.state.consecutive_skips = g.skipped, g.consecutive

    def _rollout_metrics(self, batch: Batch, ent, ent_after, adv) -> dict[str, float]:
        mask = batch.rollout.response_mask_BR.bool()
        lengths = mask.sum(-1).float()
        return {
            "reward/mean": float(batch.rewards.mean()),
            "reward/accuracy": float(batch.correct.float().mean()),
            **self.verifier.stats.metrics(),
            "response/length_mean": float(lengths.mean()),
            "response/tokens": float(lengths.sum()),
            "response/truncated_frac": float(batch.rollout.truncated_B.float().mean()),
            "actor/entropy": float(ent[mask].mean()),
            **({} if ent_after is None else {"actor/entropy_after": float(ent_after[mask].mean())}),
            "adv/abs_mean": float(adv.abs()[mask].mean()),
            "adv/nonzero_frac": float((adv[mask] != 0).float().mean()),
        }

    # --------------------------------------------------------------------- run
    def fit(self, progress=None) -> dict[str, float]:
        cfg = self.cfg
        if not self.state.warmup_done:
            self.run_warmup(on_step=progress.warmup if progress else None)
            self.state.eval_before = self._evaluate_start()
            self.logger.log(0, self.state.eval_before)
            if cfg.trainer.save_every:
                self.save()
        while self.state.step < cfg.trainer.steps:
            metrics = self.train_step()
            s = self.state.step
            if cfg.trainer.eval_every and s % cfg.trainer.eval_every == 0 and s < cfg.trainer.steps:
                metrics.update(self.evaluate())
            self.logger.log(s, metrics)
            if progress:
                progress.step(s, metrics)
            saved = False
            if cfg.trainer.save_every and (s % cfg.trainer.save_every == 0 or s == cfg.trainer.steps):
                self.save()
                saved = True
            if self.stop_requested and s < cfg.trainer.steps:
                # preemption / time limit (SIGUSR1 or SIGTERM): a complete checkpoint at this
                # step boundary, then stop; `--resume` continues exactly from here
                if not saved:
                    self.save()
                log.warning("stop requested: checkpointed step %d, exiting for requeue", s)
                self.close()
                raise Preempted(s)
        # no RL step (a warm start): the model is the one evaluated before, so that evaluation is final
        final = dict(self.state.eval_before) if cfg.trainer.steps == 0 and self.state.eval_before else self.evaluate()
        self.logger.log(self.state.step, {**final, "final": 1})
        # hapo.json lets `hapo eval --template auto` pick the prompt format this model was trained on;
        # eval.json lets a run that starts from this model reuse ``final`` (local/eval_cache.py)
        save_hf(self.model, self.tok, self.out / "final_model",
                extra_files={"hapo.json": json.dumps({"template": cfg.data.template})},
                finalize=lambda d: {eval_cache.FILE: eval_cache.dumps(
                    eval_cache.eval_key(self.model, cfg, self.eval_problems, self.eval_seed, d), final)})
        summary = {"before": self.state.eval_before, "after": final}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()
        return summary

    def close(self) -> None:
        """Close the logs and the grader, and give up the run directory's lock."""
        self.logger.close()
        self.verifier.close()
        runlock.release(self.out)


def _merge_groups(kept, pad_id: int) -> Batch:
    parts, rewards, correct, group = [], [], [], []
    for g, (b, idx) in enumerate(kept):
        parts.append(b.rollout.select(idx))
        rewards.append(b.rewards[idx])
        correct.append(b.correct[idx])
        group.append(torch.full((len(idx),), g, dtype=torch.long))
    return Batch(concat_rollouts(parts, pad_id), torch.cat(rewards), torch.cat(correct), torch.cat(group))


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b, key = old.get(k), new.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, key + ".")
        elif a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out
