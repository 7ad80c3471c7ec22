"""trainer.steps under OpenRLHF's loop (which has no max-steps flag): the controller's
StepLimit turns the sample generator into an exhausted one at the limit. The loop itself
runs in test_e2e.py (three episodes' worth of data, stopped at global step 4)."""

import pytest

from hapo_openrlhf.integrations.openrlhf.trainer import StepLimit


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
        self.hapo = {"output_dir": str(out), "trainer": {"steps": steps}}
        self.ckpt = type("ckpt", (), {"save_steps": save_steps})()


def _controller(tmp_path, monkeypatch, save_steps):
    """hapo's controller without Ray/OpenRLHF behind it: upstream's save is recorded."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from hapo_openrlhf.integrations.openrlhf.trainer import HapoPPOTrainerImpl

    saved = []
    monkeypatch.setattr(BasePPOTrainer, "save_logs_and_checkpoints",
                        lambda self, step, logs=None, cs=None: saved.append((step, self.args.ckpt.save_steps, cs))
                        if step % self.args.ckpt.save_steps == 0 else None)
    monkeypatch.setattr(BasePPOTrainer, "init_checkpoint_states", lambda self: {"global_step": 4})
    t = object.__new__(HapoPPOTrainerImpl)
    t.args = _FakeArgs(tmp_path, save_steps)
    t.step_limit = StepLimit(100)
    t._last_client_states, t._last_saved_step = None, 0
    gen = t._stop_after_generation(t.step_limit.wrap(lambda **kw: (["s"], None, 4, False)))
    t.init_checkpoint_states()  # resumed from global step 4
    return t, gen, saved


def test_stop_flag_during_generation_checkpoints_the_previous_step(tmp_path, monkeypatch):
    from hapo_openrlhf.preemption import Preempted, request_flag

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
    assert e.value.step == 5 and saved == [(5, 1, {"global_step": 5, "data_loader_state_dict": {"pos": 5}})]
    assert t.args.ckpt.save_steps == 10  # restored


def test_stop_flag_during_generation_after_a_saved_step_saves_nothing_more(tmp_path, monkeypatch):
    from hapo_openrlhf.preemption import Preempted, request_flag

    t, gen, saved = _controller(tmp_path, monkeypatch, save_steps=5)
    t.step_limit.step = 5
    t.save_logs_and_checkpoints(5, {}, {"global_step": 5})
    assert [s[0] for s in saved] == [5]
    request_flag(tmp_path).touch()
    with pytest.raises(Preempted):
        gen()
    assert [s[0] for s in saved] == [5]  # already on disk
