"""algos/step.py: the one algorithm step every back end calls (issue 56)."""

from types import SimpleNamespace

import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.step import after_update, before_update


def _algorithm(**kw):
    base = dict(estimator="less", estimator_params={"min_len": 2}, loss="stare",
                loss_params={"selection": "batch", "top_ratio": 0.2, "adaptive": True}, quadrant_split="group_mean",
                quadrant_quantile=0.8, quadrant_threshold=None)
    return SimpleNamespace(**{**base, **kw})


def _inputs(B=12, T=9, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = (torch.rand(B, generator=g) > 0.5).float()
    return algos.AdvantageInputs(rewards=rewards, response_mask=mask, entropy=torch.rand(B, T, generator=g) * mask,
                                 group_index=torch.arange(B) // n, correct=rewards > 0.5,
                                 response_ids=torch.randint(0, 3, (B, T), generator=g) * mask), \
        -torch.rand(B, T, generator=g) * mask


def test_the_step_runs_the_sequence_in_the_published_order_and_keeps_the_callers_rows():
    """Estimator, then quadrants and their metrics, then the loss's step state, metrics in that
    order; with ``estimator_order`` (the controller's rows out of rollout order) the estimator sees
    rollout order and the result comes back in the caller's: equal to the in-order step, row for row."""
    inputs, old = _inputs()
    a = _algorithm()
    want = before_update(a, inputs, {"reweight_w": 1.2}, old_logprobs=old)
    est = algos.run_estimator("less", inputs, min_len=2)
    assert torch.equal(want.advantages, est.advantages)
    keys = list(want.metrics)
    first_less = next(i for i, k in enumerate(keys) if k.startswith("less/"))
    assert keys[0].startswith("quadrant/") and not any(k.startswith("quadrant/") for k in keys[first_less:])
    assert first_less < keys.index("stare/batch_entropy") == len(keys) - 1
    assert want.state_metrics and set(want.state_metrics) <= set(want.metrics)
    assert want.loss_state is not None and "threshold_pos" in want.loss_state and want.persisted["reweight_w"] != 1.2

    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    shuffled = algos.AdvantageInputs(rewards=inputs.rewards[perm], response_mask=inputs.response_mask[perm],
                                     entropy=inputs.entropy[perm], group_index=inputs.group_index[perm],
                                     correct=inputs.correct[perm], response_ids=inputs.response_ids[perm])
    got = before_update(a, shuffled, {"reweight_w": 1.2}, old_logprobs=old[perm], estimator_order=torch.argsort(perm))
    assert torch.equal(got.advantages, want.advantages[perm]) and torch.equal(got.loss_mask, want.loss_mask[perm])
    assert got.persisted == pytest.approx(want.persisted) and got.loss_state == pytest.approx(want.loss_state)
    # a loss without state: None for the calls, nothing to checkpoint, no state metrics
    plain = before_update(_algorithm(loss="ppo", loss_params={}), inputs, None, old_logprobs=old)
    assert (plain.loss_state, plain.persisted, plain.state_metrics) == (None, {}, {})


def test_after_the_update_a_loss_that_learns_from_the_step_records_it():
    a = _algorithm(loss="paec", loss_params={"beta": 0.5, "rho_min": 0.8, "top_p": 0.9, "mask": "product",
                                             "softness": 0.0, "anchor_steps": 2})
    s = after_update(a, {}, {"paec/masked_entropy": 2.0})
    s = after_update(a, s, {"paec/masked_entropy": 1.0})
    assert s == {"anchor_steps": [2.0, 1.0], "anchor": 1.5}
    assert after_update(_algorithm(loss="ppo", loss_params={}), {"x": 1}, {}) == {"x": 1}
