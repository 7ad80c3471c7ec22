"""trainer.steps under OpenRLHF's loop (which has no max-steps flag): the controller's
StepLimit turns the sample generator into an exhausted one at the limit. The loop itself
runs in test_e2e.py (three episodes' worth of data, stopped at global step 4)."""

import copy

import pytest

from hapo_openrlhf.integrations.openrlhf.controller.trainer import StepLimit


def test_step_limit_ends_generation_at_the_limit():
    calls = []

    def generate(**kw):
        calls.append(kw)
        return ["sample"], 1.0, 4, False

    lim = StepLimit(2)
    gen = lim.wrap(generate)
    assert gen(temperature=1.0) == (["sample"], 1.0, 4, False) and calls == [{"temperature": 1.0}]
    lim.step = 1
    assert gen()[0] == ["sample"] and not lim.reached
    lim.step = 2  # the controller sets it after each train_step (and from a resumed checkpoint)
    assert lim.reached and gen() == ([], None, 0, True) and len(calls) == 2
    # a resumed run already past its limit trains nothing
    late = StepLimit(3)
    late.step = 5
    assert late.wrap(generate)() == ([], None, 0, True) and len(calls) == 2


def test_step_limit_zero_and_negative():
    assert StepLimit(0).reached
    with pytest.raises(ValueError, match="trainer.steps"):
        StepLimit(-1)


class _FakeArgs:
    def __init__(self, out, save_steps, steps=100):
        # 8 x 4 samples per RL step over train batches of 16, two PPO epochs: 4 optimizer steps per RL step
        self.hapo = {"output_dir": str(out), "trainer": {"steps": steps},
                     "algorithm": {"loss": "ppo", "loss_params": {}},
                     "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4},
                     "openrlhf": {"train_batch_size": 16}, "optim": {"ppo_epochs": 2}}
        self.ckpt = type("ckpt", (), {"save_steps": save_steps, "path": str(out)})()


PPO = {"hapo_loss": {"name": "ppo", "params": {}}}  # what every save records of the loss


def _controller(tmp_path, monkeypatch, save_steps, resumed=None):
    """hapo's controller without Ray/OpenRLHF behind it: upstream's save is recorded."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from hapo_openrlhf.integrations.openrlhf.controller.trainer import HapoPPOTrainerImpl

    saved = []
    monkeypatch.setattr(BasePPOTrainer, "save_logs_and_checkpoints",
                        lambda self, step, logs=None, cs=None: saved.append((step, self.args.ckpt.save_steps, cs))
                        if step % self.args.ckpt.save_steps == 0 else None)
    monkeypatch.setattr(BasePPOTrainer, "init_checkpoint_states", lambda self: {"global_step": 4, **(resumed or {})})
    t = object.__new__(HapoPPOTrainerImpl)
    t.experience_maker = SimpleNamespace(loss_state={})
    t.args = _FakeArgs(tmp_path, save_steps)
    if resumed and "hapo_loss" in resumed:
        t.args.hapo["algorithm"] = {"loss": resumed["hapo_loss"]["name"], "loss_params": dict(resumed["hapo_loss"]["params"])}
    t.step_limit = StepLimit(100)
    t._last_client_states, t._last_saved_step, t._optimizer_steps = None, 0, 0
    gen = t._stop_after_generation(t.step_limit.wrap(lambda **kw: (["s"], None, 4, False)))
    t.init_checkpoint_states()  # resumed from global step 4
    return t, gen, saved


def test_stop_flag_during_generation_checkpoints_the_previous_step(tmp_path, monkeypatch):
    from hapo_openrlhf.rundir.preemption import Preempted, request_flag

    t, gen, saved = _controller(tmp_path, monkeypatch, save_steps=10)
    request_flag(tmp_path).touch()
    # first step after a restart: nothing of this process is unsaved -> train the step
    assert gen()[0] == ["s"] and saved == []
    request_flag(tmp_path).unlink()
    t.step_limit.step = 5  # train_step ran
    t.save_logs_and_checkpoints(5, {}, {"global_step": 5, "data_loader_state_dict": {"pos": 5}})
    assert saved == []  # 5 is not a save step
    request_flag(tmp_path).touch()  # the stop arrives while step 6 generates
    with pytest.raises(Preempted) as e:
        gen()
    # the state step 6 started from (step 5's weights, the loader before step 6) is saved, forced
    assert e.value.step == 5 and saved == [(5, 1, {"global_step": 5, "data_loader_state_dict": {"pos": 5}, **PPO,
                                                   "hapo_optimizer_steps": 16})]
    assert t.args.ckpt.save_steps == 10  # restored


def test_stop_flag_during_generation_after_a_saved_step_saves_nothing_more(tmp_path, monkeypatch):
    from hapo_openrlhf.rundir.preemption import Preempted, request_flag

    t, gen, saved = _controller(tmp_path, monkeypatch, save_steps=5)
    t.step_limit.step = 5
    t.save_logs_and_checkpoints(5, {}, {"global_step": 5})
    assert [s[0] for s in saved] == [5]
    request_flag(tmp_path).touch()
    with pytest.raises(Preempted):
        gen()
    assert [s[0] for s in saved] == [5]  # already on disk


def test_async_state_counts_versions_and_the_step_limit():
    """The generator/trainer shared state of the async trainer, without Ray."""
    from hapo_openrlhf.integrations.openrlhf.controller.trainer_async import AsyncState

    st = AsyncState.__ray_actor_class__(limit=4)
    st.start(2)  # resumed from global step 2: the engines hold step 2's weights
    assert st.get_version() == 2 and st.may_produce()
    st.produced_batch(2, 2)  # batch for step 3, generated by version 2
    st.set_version(3)  # step 3's sync
    st.produced_batch(2, 3)  # batch for step 4 straddled that sync (partial rollout)
    assert not st.may_produce()  # 2 + 2 batches: the limit (4) is reached
    assert st.pop() == (2, 2) and st.pop() == (2, 3) and st.pop() is None


def test_async_trainer_waiting_for_a_batch_honours_the_stop_flag(tmp_path, monkeypatch):
    """While the async trainer waits for a rollout batch, the stop flag checkpoints the last
    trained step (unless on disk) and stops; a batch that arrives is handed over."""
    from ray.util.queue import Empty

    from hapo_openrlhf.integrations.openrlhf.controller.trainer_async import _StopAwareQueue
    from hapo_openrlhf.rundir.preemption import Preempted, request_flag

    t, _, saved = _controller(tmp_path, monkeypatch, save_steps=10)

    class Q:
        def __init__(self, items):
            self.items = list(items)

        def get(self, block=True, timeout=None):
            if self.items:
                return self.items.pop(0)
            raise Empty

    q = _StopAwareQueue(Q(["batch"]), t._stop_before_update, poll_s=0.01)
    assert q.get() == "batch"
    t.step_limit.step = 5
    t.save_logs_and_checkpoints(5, {}, {"global_step": 5, "data_loader_state_dict": {"pos": 5}})
    q = _StopAwareQueue(Q([]), t._stop_before_update, poll_s=0.01)
    with pytest.raises(Empty):  # no flag: a timed wait times out as the queue's would
        q.get(timeout=0.05)
    request_flag(tmp_path).touch()
    with pytest.raises(Preempted) as e:
        q.get()
    assert e.value.step == 5 and saved == [(5, 1, {"global_step": 5, "data_loader_state_dict": {"pos": 5}, **PPO,
                                                   "hapo_optimizer_steps": 16})]


def test_a_stateful_losss_controller_goes_into_every_checkpoint_and_comes_back(tmp_path, monkeypatch):
    """STARE's controller lives with the experience maker (as the reference's with its
    driver): its state joins OpenRLHF's client states in every save -- the forced one of a
    preemption included -- and a resumed controller starts from the checkpoint's."""
    from hapo_openrlhf.rundir.preemption import Preempted, request_flag

    ctl = {"gate_on": True, "reweight_w": 1.25, "reweight_m": 0.75, "current_ent": 0.2}
    t, gen, saved = _controller(tmp_path, monkeypatch, save_steps=10, resumed={"hapo_loss_state": ctl})
    assert t.experience_maker.loss_state == ctl and t.experience_maker.loss_state is not ctl
    assert t.experience_maker._step == 4  # RL steps so far: eapo_entropic's kappa decay continues from them
    t.experience_maker.loss_state = {**ctl, "reweight_w": 1.3}  # step 5's update
    t.step_limit.step = 5
    t.save_logs_and_checkpoints(5, {}, {"global_step": 5})
    request_flag(tmp_path).touch()
    with pytest.raises(Preempted):
        gen()
    assert saved == [(5, 1, {"global_step": 5, "hapo_loss_state": {**ctl, "reweight_w": 1.3}, **PPO,
                             "hapo_optimizer_steps": 16})]
    t2, _, _ = _controller(tmp_path, monkeypatch, save_steps=10)  # a checkpoint without one: a fresh controller
    assert t2.experience_maker.loss_state == {}


def test_paecs_anchor_learns_from_each_steps_metrics_before_the_checkpoint(tmp_path, monkeypatch):
    """PAEC's anchor is updated from the step's reported mean masked entropy (the actors'
    ``paec/masked_entropy`` in upstream's status) when the step's logs arrive -- before that
    step's checkpoint, so the saved state includes the step -- and is fixed after K steps."""
    t, _, saved = _controller(tmp_path, monkeypatch, save_steps=1)
    # the config's transport is read once per process (config.transported): a new run's config is a new dict
    t.args.hapo = {**t.args.hapo, "algorithm": {"loss": "paec", "loss_params": dict(
        beta=1.0, rho_min=0.5, top_p=0.9, mask="product", softness=0.0, anchor_steps=2)}}
    t.save_logs_and_checkpoints(5, {"paec/masked_entropy": 1.0, "policy_loss": 0.1}, {"global_step": 5})
    assert saved[-1][2]["hapo_loss_state"] == {"anchor_steps": [1.0]}
    t.save_logs_and_checkpoints(6, {"paec/masked_entropy": 3.0}, {"global_step": 6})
    assert saved[-1][2]["hapo_loss_state"] == {"anchor_steps": [1.0, 3.0], "anchor": 2.0}
    t.save_logs_and_checkpoints(7, {"paec/masked_entropy": 9.0}, {"global_step": 7})
    assert saved[-1][2]["hapo_loss_state"]["anchor"] == 2.0


def test_a_resume_applies_a_changed_stare_w_and_counts_the_optimizer_steps_taken(tmp_path, monkeypatch):
    """The controller side of issue 55's severity-1 findings: a checkpoint saved under STARE W 1.1
    whose controller is at W 1.25 resumes under W 1.3 with the controller at 1.3 (announced); the
    optimizer steps are the checkpoint's count (10, e.g. after a change of PPO epochs), not the RL
    steps times this run's rate (4 x 4 = 16), and each step with logs adds this run's rate."""
    stare = {"name": "stare", "params": {"reweight_w": 1.1}}
    ctl = {"gate_on": True, "reweight_w": 1.25, "reweight_m": 0.9, "current_ent": 0.2}
    t, _, saved = _controller(tmp_path, monkeypatch, save_steps=1, resumed={
        "hapo_loss_state": ctl, "hapo_loss": stare, "hapo_optimizer_steps": 10})
    assert t.experience_maker.loss_state["reweight_w"] == 1.25  # same W configured: the controller's own
    t.args.hapo = copy.deepcopy(t.args.hapo)  # the resumed run's config (a new transport: config.transported)
    t.args.hapo["algorithm"]["loss_params"]["reweight_w"] = 1.3
    t.init_checkpoint_states()
    assert t.experience_maker.loss_state == {**ctl, "reweight_w": 1.3}
    assert t._optimizer_steps == 10 and t.experience_maker._optimizer_steps == 10
    t.save_logs_and_checkpoints(5, {"policy_loss": 0.1}, {"global_step": 5})
    assert saved[-1][2]["hapo_optimizer_steps"] == 14
    assert saved[-1][2]["hapo_loss"] == {"name": "stare", "params": {"reweight_w": 1.3}}
    # a checkpoint from before the count: its RL steps at this run's rate
    t2, _, _ = _controller(tmp_path, monkeypatch, save_steps=1)
    assert t2._optimizer_steps == 16


def test_a_damaged_loss_state_in_openrlhfs_checkpoint_is_named(tmp_path, monkeypatch):
    import pytest as _pytest

    bad = {"gate_on": True, "reweight_w": float("nan"), "reweight_m": 0.9}
    with _pytest.raises(ValueError, match=r"global step 4 .*stare state reweight_w must be a finite number"):
        _controller(tmp_path, monkeypatch, save_steps=1, resumed={
            "hapo_loss_state": bad, "hapo_loss": {"name": "stare", "params": {}}})
