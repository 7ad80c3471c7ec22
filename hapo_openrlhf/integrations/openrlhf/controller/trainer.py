"""``PPOTrainer`` subclass (the Ray controller) that uses :class:`HapoExperienceMaker`.

Upstream's ``BasePPOTrainer.__init__`` builds ``RemoteExperienceMaker`` directly;
:class:`HapoControllerMixin` replaces it with the hapo subclass constructed with the
same arguments and adds ``metrics.jsonl``, the step limit and preemption. The mixin
serves the synchronous controller here and the asynchronous trainer's training actor
(``trainer_async.py``). Everything else -- the fit loop, dynamic filtering,
checkpoints, resume, evaluation, weight sync to vLLM -- is OpenRLHF's own.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch
from openrlhf.trainer.ppo_trainer import PPOTrainer

from ....algos.losses import CheckpointStateError, check_loss_state, loss_resume
from ....algos.step import after_update
from ....config import RunConfig, to_plain, transported
from ....rundir.logger import read_jsonl_records, record_line
from ....rundir.preemption import Preempted, request_flag
from ..actors import routes
from .experience import HapoExperienceMaker, optimizer_steps_per_step


def seed_prompt_order(loader, seed: int) -> None:
    """The prompts' shuffle from the run's seed. OpenRLHF's controller builds its prompt loader with
    torchdata's ``RandomSampler``, which seeds its own generator from the controller process's global
    torch RNG -- which nothing seeds there, so two launches of one config drew different prompts
    (found comparing a launch at context parallelism 2 with one at 1, issue 58). Seeded here, before
    the first batch; a resume then loads the sampler's state over it (``data_loader_state_dict``)."""
    generator = getattr(getattr(loader, "sampler", None), "generator", None)
    if not isinstance(generator, torch.Generator):
        raise RuntimeError(f"OpenRLHF's prompt loader samples with {type(getattr(loader, 'sampler', None)).__name__}, "
                           f"which has no generator to seed: the prompt order would not follow train.seed")
    generator.manual_seed(int(seed))


def dispatch_order(generator) -> None:
    """A ``SamplesGenerator``'s rollout in the order its prompts were sent, not the order the
    engines finished them. OpenRLHF's ``_generate_vllm`` collects each prompt's responses as its
    request completes (``ray.wait(..., num_returns=1)``), so the batch's row order -- which rows
    share a micro-batch, the order gradients are summed in, the order of a group's responses that
    LESS's clustering reads -- changed from launch to launch, and a resumed step could not equal
    the uninterrupted one (found resuming PRIME, issue 59). Each call's accepted responses are
    sorted, stably, by their prompt's place in the calls' dispatch order (replacements sent by
    dynamic filtering come after the batch's prompts, in the order they were sent); a prompt's own
    responses keep the order its engine returned them in. A prompt sent twice in one call keeps
    its groups in completion order (they cannot be told apart)."""
    dispatch, generate = generator._dispatch_prompts_to_vllm, generator._generate_vllm
    sent: list = []

    def dispatch_recorded(prompts, labels, **kwargs):
        sent.extend(prompts)
        return dispatch(prompts, labels, **kwargs)

    def generate_in_dispatch_order(*args, **kwargs):
        sent.clear()
        experiences, consumed, exhausted = generate(*args, **kwargs)
        place: dict = {}
        for i, prompt in enumerate(sent):
            place.setdefault(prompt, i)
        experiences = sorted(experiences, key=lambda e: place.get(e.prompts[0], len(sent)))
        return experiences, consumed, exhausted

    generator._dispatch_prompts_to_vllm, generator._generate_vllm = dispatch_recorded, generate_in_dispatch_order


class StepLimit:
    """``trainer.steps`` for OpenRLHF's loop, which has no max-steps flag: once ``step``
    (the global step, one per rollout batch) reaches ``limit``, the wrapped
    ``generate_samples`` reports an exhausted loader without generating, so every
    remaining episode ends at once and OpenRLHF's ``train`` saves the final model."""

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"trainer.steps must be >= 0, got {limit}")
        self.limit, self.step = limit, 0

    @property
    def reached(self) -> bool:
        return self.step >= self.limit

    def wrap(self, generate_samples):
        def generate(**kwargs):
            if self.reached:
                return [], None, 0, True  # (samples, filter pass rate, prompts consumed, exhausted)
            return generate_samples(**kwargs)

        return generate


class HapoControllerMixin:
    """What hapo adds to OpenRLHF's controller, shared by the synchronous ``PPOTrainer``
    and the asynchronous ``TrainingActor`` (trainer_async.py): hapo's experience maker,
    ``metrics.jsonl``, the step limit, and preemption (a stop flag forces this step's
    checkpoint and ends the loop)."""

    @property
    def cfg(self) -> RunConfig:
        """The run config, typed (rebuilt once in this process from ``args.hapo``, its transport)."""
        return transported(self.args.hapo)

    def _hapo_setup(self) -> None:
        self.experience_maker = HapoExperienceMaker(
            self.actor_model_group,
            self.critic_model_group,
            self.reward_model_group,
            self.reference_model_group,
            self.kl_ctl,
            self.strategy,
            self.tokenizer,
        )
        self._metrics_path = Path(self.cfg.output_dir) / "metrics.jsonl"
        self._metrics_started = False
        self.step_limit = StepLimit(self.cfg.trainer.steps)
        self._last_client_states: dict | None = None  # what the last step passed to save_logs_and_checkpoints
        self._last_saved_step = 0
        self._optimizer_steps = 0  # optimizer steps trained (checkpointed: eapo_entropic's schedule)

    def _send_routes(self, rollout_samples) -> None:
        """Rollout routing replay (routes.py): every policy actor gets this step's table of row
        fingerprint -> routes reference before the step's first forward."""
        if not routes.enabled(self.cfg):
            return
        table = routes.route_table(rollout_samples)
        ray.get(self.actor_model_group.async_run_method(method_name="set_routes", routes=table))

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        self.step_limit.step = int(states["global_step"])  # a resumed run counts from its checkpoint
        # a stateful loss's controller (STARE) continues from the checkpoint's state, made to train what
        # this run's config says when the resume changed the loss's parameters (or refused by name)
        a = self.cfg.algorithm
        saved = states.get("hapo_loss") or {}
        try:  # the persisted state, checked before it trains (OpenRLHF chose the checkpoint: no fallback here)
            check_loss_state(saved.get("name", a.loss), states.get("hapo_loss_state") or {})
        except CheckpointStateError as e:
            raise ValueError(f"the checkpoint of global step {states.get('global_step')} under {self.args.ckpt.path}: "
                             f"{e}; move that checkpoint aside to resume from an older one") from None
        self.experience_maker.loss_state, notes = loss_resume(
            saved.get("name"), saved.get("params"), a.loss, to_plain(a.loss_params),
            dict(states.get("hapo_loss_state") or {}))
        for note in notes:
            print(f"hapo: resuming: {note}", flush=True)
        # ... and counts RL steps and optimizer steps from it (eapo_entropic's kappa decay is keyed to
        # the optimizer steps taken; a checkpoint from before the count: its steps at this config's rate)
        self.experience_maker._step = self.step_limit.step
        per_step = optimizer_steps_per_step(self.cfg)
        self._optimizer_steps = int(states.get("hapo_optimizer_steps", self.step_limit.step * per_step))
        self.experience_maker._optimizer_steps = self._optimizer_steps
        self._last_saved_step = self.step_limit.step  # that state is on disk already
        return states

    def _stop_before_update(self) -> None:
        """The stop flag appeared before this process's next update: checkpoint the state the
        last step left (unless it is on disk) and stop. A no-op before the first step of this
        process (nothing of its own is unsaved; the stop is honoured after the step as usual)."""
        if self._last_client_states is None or not request_flag(self.cfg.output_dir).exists():
            return
        step = self.step_limit.step
        if step != self._last_saved_step:
            self._save_forced(step, {}, dict(self._last_client_states))
        raise Preempted(step)

    def _save_forced(self, global_step: int, logs_dict, client_states) -> None:
        every = self.args.ckpt.save_steps
        self.args.ckpt.save_steps = 1
        try:
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        finally:
            self.args.ckpt.save_steps = every
        self._last_saved_step = global_step

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        """Upstream's, plus preemption: when the Slurm job has written the stop flag, this
        step's checkpoint is forced (save_steps=1 for this call) and the fit loop stops.
        The step limit's last step is checkpointed too (a requeue after it trains no more)."""
        stop = request_flag(self.cfg.output_dir).exists()
        if logs_dict:  # a loss that learns from the step it trained (PAEC's anchor), before the checkpoint
            self.experience_maker.loss_state = after_update(self.cfg.algorithm, self.experience_maker.loss_state,
                                                            logs_dict)
        if logs_dict:  # this step's optimizer steps are taken
            self._optimizer_steps += optimizer_steps_per_step(self.cfg)
        if client_states is not None and self.experience_maker.loss_state:  # STARE's controller, checkpointed
            client_states["hapo_loss_state"] = dict(self.experience_maker.loss_state)
        if client_states is not None:  # what a resume compares its config with, and the steps taken
            a = self.cfg.algorithm
            client_states["hapo_loss"] = {"name": a.loss, "params": to_plain(a.loss_params)}
            client_states["hapo_optimizer_steps"] = self._optimizer_steps
        if client_states is not None:  # upstream adds its eval keys to the dict it is given
            self._last_client_states = dict(client_states)
        if stop or self.step_limit.reached:
            self._save_forced(global_step, logs_dict, client_states)
        else:
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
            if global_step % self.args.ckpt.save_steps == 0:
                self._last_saved_step = global_step
        if stop:
            raise Preempted(global_step)

    def _log_metrics(self, step: int, status: dict) -> None:
        """hapo's ``metrics.jsonl`` (what ``hapo report`` reads), one line per global step.
        On the first step of a (resumed) process, lines past the resumed step are dropped."""
        if not self.strategy.is_rank_0():
            return
        path = self._metrics_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self._metrics_started and path.exists():
            keep = [r for r in read_jsonl_records(path) if r.get("step", 0) < step]
            path.write_text("".join(record_line(r) for r in keep))
        self._metrics_started = True
        row = {"step": step}
        for k, v in status.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                # a non-finite value (the grad norm of a skipped step) is logged, as "nan" / "inf"
                row[k] = float(v)
                if k in HAPO_NAMES:  # under hapo's metric names too
                    row[HAPO_NAMES[k]] = row[k]
        with open(path, "a") as f:
            f.write(record_line(row))
            f.flush()
            os.fsync(f.fileno())


class HapoPPOTrainerImpl(HapoControllerMixin, PPOTrainer.__ray_actor_class__):
    def __init__(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                 reference_model_group, vllm_engines, **generate_kwargs) -> None:
        super().__init__(pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                         reference_model_group, vllm_engines, **generate_kwargs)
        seed_prompt_order(self.prompts_dataloader, self.args.train.seed)
        dispatch_order(self.samples_generator)
        self._hapo_setup()
        if routes.enabled(self.cfg):
            routes.carry_routes(self.samples_generator)
        self.samples_generator.generate_samples = self._stop_after_generation(
            self.step_limit.wrap(self.samples_generator.generate_samples))

    def _stop_after_generation(self, generate):
        """A step at 24k tokens is generation (most of it) then training. A stop flag that
        appears during generation is honoured before the update: the state the step started
        from -- the previous step's weights, and the data loader *before* this generation --
        is checkpointed (unless it already is) and the loop stops; the requeued job
        regenerates this step's prompts. On the first step after a (re)start nothing of this
        process's is unsaved, and the stop is honoured after the step as usual."""
        def generate_then_check(**kwargs):
            out = generate(**kwargs)
            if out[0]:
                self._stop_before_update()
            return out

        return generate_then_check

    def train_step(self, rollout_samples, global_step: int):
        self._send_routes(rollout_samples)
        status, step = super().train_step(rollout_samples, global_step)
        self.step_limit.step = step
        self._log_metrics(step, status)
        return status, step


# upstream's status keys of the rollout/training mismatch correction -> hapo's names (docs/method.md)
MISMATCH_METRICS = {"vllm_kl": "actor/vllm_kl", "is_filter_ratio": "actor/is_filter_frac",
                    "is_ratio_mean": "actor/is_ratio_mean", "is_ratio_max": "actor/is_ratio_max"}
# the mismatch correction and the non-finite-gradient guard (algos/grad_guard.py), under hapo's names
HAPO_NAMES = {**MISMATCH_METRICS, "actor_grad_norm": "actor/grad_norm", "actor_skipped_steps": "actor/skipped_steps"}


HapoPPOTrainer = ray.remote(HapoPPOTrainerImpl)
