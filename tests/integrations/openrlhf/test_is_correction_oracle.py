"""hapo's ``ppo`` loss with the rollout/training mismatch correction equals OpenRLHF
0.11.2's own ``PolicyLoss`` (the oracle) over every level, mode and gating it accepts:
values, gradients, ``vllm_kl`` and the filter fraction; bad settings get upstream's
errors, word for word."""

import pytest
import torch

from hapo_openrlhf.algos import compute_policy_loss
from hapo_openrlhf.algos.is_correction import ISCorrection
from tests.algos.test_is_correction import SETTINGS, _batch


@pytest.mark.parametrize("level, mode, gating, threshold", SETTINGS)
def test_ppo_with_correction_equals_openrlhf_policy_loss(level, mode, gating, threshold):
    from openrlhf.models.loss import PolicyLoss

    lp, old, rollout, adv, mask = _batch()
    n_tokens, dp = float(mask.sum()) * 2, 2  # a global count from "several micro-batches", 2 DP ranks
    up = PolicyLoss(0.2, 0.28, is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                    is_correction_threshold=list(threshold))
    want, _, _, want_kl, want_filter = up(lp, old, adv, action_mask=mask, rollout_log_probs=rollout, dp_size=dp,
                                          batch_num_tokens=n_tokens)
    want_grad, = torch.autograd.grad(want, lp)
    got, m = compute_policy_loss("ppo", lp, old, adv, mask, eps_low=0.2, eps_high=0.28, normalizer=n_tokens / dp,
                                 rollout_logprobs=rollout,
                                 is_correction={"level": level, "mode": mode, "gating": gating, "threshold": threshold})
    got_grad, = torch.autograd.grad(got, lp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert m["actor/vllm_kl"] == pytest.approx(float(want_kl), rel=1e-12)
    assert m["actor/is_filter_frac"] == pytest.approx(float(want_filter), rel=1e-12)
    assert 0 < m["actor/is_filter_frac"] < 1  # the settings bite on this batch (neither all nor nothing)
    # the correction changed the loss (it is not a no-op on this batch)
    plain, _ = compute_policy_loss("ppo", lp, old, adv, mask, eps_low=0.2, eps_high=0.28, normalizer=n_tokens / dp)
    assert abs(float(plain) - float(got)) > 1e-6


@pytest.mark.parametrize("level, mode, gating, threshold", [
    ("chunk", "mask", "ratio", (0.5, 5.0)), ("token", "drop", "ratio", (0.5, 5.0)),
    ("token", "mask", "kl", (0.5, 5.0)), ("seq", "clip", "ratio", (0.5, 5.0)),
    ("token", "clip", "tv", (0.0, 0.1)), ("token", "mask", "binary_kl", (0.5, 5.0)),
])
def test_bad_settings_get_openrlhfs_errors(level, mode, gating, threshold):
    from openrlhf.models.loss import PolicyLoss

    with pytest.raises(ValueError) as up:
        PolicyLoss(is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                   is_correction_threshold=list(threshold))
    with pytest.raises(ValueError) as ours:
        ISCorrection(level, mode, gating, threshold)
    assert str(ours.value) == str(up.value)


