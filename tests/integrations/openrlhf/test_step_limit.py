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
