"""The rollout/training mismatch correction (``algos.is_correction``): hand-computed
cases for every loss (the oracle comparison with OpenRLHF's ``PolicyLoss`` is in
tests/integrations/openrlhf/test_is_correction_oracle.py), and the registry's refusal of a
loss that would ignore the weight."""

import math

import pytest
import torch

from hapo_openrlhf.algos import compute_policy_loss
from hapo_openrlhf.algos.is_correction import ISCorrection, is_correction_weights
from hapo_openrlhf.algos.registry import Registry

SETTINGS = [  # (level, mode, gating, threshold): every combination upstream accepts
    ("token", "mask", "ratio", (0.8, 1.25)),  # ICEPOP
    ("token", "clip", "ratio", (0.8, 1.25)),  # TIS
    ("seq", "mask", "ratio", (0.9, 1.1)),  # seq-mask-TIS
    ("token", "mask", "binary_kl", (0.0, 0.02)),
    ("token", "mask", "tv", (0.0, 0.1)),
    ("seq", "mask", "binary_kl", (0.0, 0.01)),  # FlashREINFORCE's trust region
    ("seq", "mask", "tv", (0.0, 0.08)),
]


def _batch(seed=0, B=5, T=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.25  # the engine's drift
    lp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    mask[3, 2:] = False
    return lp, old, rollout, adv, mask


def test_single_threshold_is_an_upper_bound_and_off_is_identity():
    assert ISCorrection("seq", "mask", "binary_kl", (0.01,)).threshold == (0.0, 0.01)
    lp, old, rollout, adv, mask = _batch(1)
    w, m = is_correction_weights(old, rollout, mask, {"level": "off"})
    assert w is None and m == {}
    a, _ = compute_policy_loss("ppo", lp, old, adv, mask)
    b, _ = compute_policy_loss("ppo", lp, old, adv, mask, rollout_logprobs=rollout, is_correction=ISCorrection())
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no rollout log-probs"):
        compute_policy_loss("ppo", lp, old, adv, mask, is_correction={"level": "token"})
    with pytest.raises(ValueError, match="no key"):
        ISCorrection.of({"level": "token", "treshold": (1, 2)})
    bad = rollout.clone()
    bad[2, 1] = float("nan")
    bad[0, 0] = float("-inf")
    with pytest.raises(ValueError, match="2 response token.*rows \\[0, 2\\]"):
        compute_policy_loss("ppo", lp, old, adv, mask, rollout_logprobs=bad, is_correction={"level": "token"})
    bad = rollout.clone()
    bad[3, 5] = float("nan")  # a padding position (row 3 has 2 valid tokens): ignored, in either mode
    for mode in ("mask", "clip"):
        loss, _ = compute_policy_loss("ppo", lp, old, adv, mask, rollout_logprobs=bad,
                                      is_correction={"level": "token", "mode": mode})
        assert torch.isfinite(loss)


def _hand_case():
    """2 rows x 3 tokens; row 1's last token is padding. Token IS ratios exp(old - rollout):
    row 0: 1, e^0.5 (out of [0.8, 1.25]), e^-0.1; row 1: e^0.2, e^-0.3 (out), pad."""
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    rollout = old - torch.tensor([[0.0, 0.5, -0.1], [0.2, -0.3, 0.0]], dtype=torch.float64)
    lp = old.clone().requires_grad_()  # ratio pi/pi_old = 1: no PPO clipping, pg_t = -A_t
    adv = torch.tensor([[1.0, 2.0, -1.0], [0.5, -2.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w = torch.tensor([[1.0, 0.0, math.exp(-0.1)], [math.exp(0.2), 0.0, 0.0]], dtype=torch.float64)  # ICEPOP
    return lp, old, rollout, adv, mask, w


@pytest.mark.parametrize("loss", ["entro_reg", "kl_cov", "clip_cov"])
def test_other_losses_get_the_same_token_weights_by_hand(loss):
    """ICEPOP (token mask, [0.8, 1.25]) on every loss: the per-token policy term times w,
    over the 5 valid tokens; EntroReg's entropy bonus is not reweighted."""
    lp, old, rollout, adv, mask, w = _hand_case()
    spec = {"level": "token", "mode": "mask", "threshold": (0.8, 1.25)}
    extra = {"entro_reg": {"entropy": torch.full_like(old, 0.5), "beta": 0.1},
             "kl_cov": {"k_ratio": 0.0}, "clip_cov": {"clip_ratio": 0.0, "cov_lb": 1e9}}[loss]
    got, m = compute_policy_loss(loss, lp, old, adv, mask, rollout_logprobs=rollout, is_correction=spec, **extra)
    pg = -(adv * w)[mask].sum() / 5  # token-mean over the 5 valid tokens
    want = pg - (0.1 * 0.5 if loss == "entro_reg" else 0.0)
    assert float(got) == pytest.approx(float(want), abs=1e-12)
    grad, = torch.autograd.grad(got, lp)  # d/dlogp of -A * ratio * w at ratio 1 = -A * w / 5
    torch.testing.assert_close(grad, -(adv * w * mask) / 5)
    assert m["actor/is_filter_frac"] == pytest.approx(2 / 5)
    assert m["actor/vllm_kl"] == pytest.approx(-(0.0 + 0.5 - 0.1 + 0.2 - 0.3) / 5)
    assert m["actor/is_ratio_max"] == pytest.approx(math.exp(0.5))
    assert m["actor/is_ratio_mean"] == pytest.approx((1 + math.exp(0.5) + math.exp(-0.1) + math.exp(0.2)
                                                      + math.exp(-0.3)) / 5)


def test_seq_mask_drops_whole_rows_and_clip_clamps_by_hand():
    lp, old, rollout, adv, mask, _ = _hand_case()
    # seq level, ratio gating: geometric means exp(mean log w) = exp(0.4 / 3) and exp(-0.1 / 2)
    w, m = is_correction_weights(old, rollout, mask, {"level": "seq", "threshold": (0.96, 1.1)})
    # row 0's exp(0.1333) = 1.1426 is out, row 1's exp(-0.05) = 0.951 is out of [0.96, 1.1] too
    assert torch.equal(w, torch.zeros_like(w)) and m["actor/is_filter_frac"] == 1.0
    w, m = is_correction_weights(old, rollout, mask, {"level": "seq", "threshold": (0.9, 1.1)})
    torch.testing.assert_close(w[0], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(w[1], torch.tensor([math.exp(0.2), math.exp(-0.3), 1.0], dtype=torch.float64))
    assert m["actor/is_filter_frac"] == 0.5  # one of two sequences
    w, m = is_correction_weights(old, rollout, mask, {"level": "token", "mode": "clip", "threshold": (0.8, 1.25)})
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.25, math.exp(-0.1)], [math.exp(0.2), 0.8, 1.0]],
                                               dtype=torch.float64))
    assert m["actor/is_filter_frac"] == pytest.approx(2 / 5)


def test_registry_refuses_a_loss_that_ignores_the_weight():
    reg = Registry("policy loss", fixed=("logprobs", "token_weight"), required=("token_weight",))
    with pytest.raises(TypeError, match="token_weight"):
        @reg.register("forgetful")
        def forgetful(*, logprobs, scale: float = 1.0):
            return logprobs.sum() * scale
