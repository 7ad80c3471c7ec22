"""HapoPolicyLoss: OpenRLHF's PolicyLoss contract, hapo's registry underneath."""

import pytest
import torch

from hapo_openrlhf.algos.losses import compute_policy_loss
from hapo_openrlhf.integrations.openrlhf.actors.loss import HapoPolicyLoss


def _batch(B=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    new = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 2:] = False
    return new, old, adv, mask


@pytest.mark.parametrize("agg, dual", [("token-mean", None), ("seq-mean-token-mean", None), ("token-mean", 3.0)])
def test_ppo_equals_openrlhf_policy_loss(agg, dual):
    """Same scalar, same gradient, same clip ratio and KL as upstream's PolicyLoss, with the
    global normalisers OpenRLHF passes (token count / gas, dp_size)."""
    from openrlhf.models import PolicyLoss

    new, old, adv, mask = _batch()
    kw = dict(action_mask=mask, dp_size=2, batch_num_tokens=mask.sum().float() * 1.5,
              global_batch_size=torch.tensor(6.0))
    up = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual, token_level_loss=agg == "token-mean")
    ours = HapoPolicyLoss("ppo", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": dual}, aggregation=agg)
    l_up, clip_up, kl_up, vk, fr = up(new, old, adv, **kw)
    (g_up,) = torch.autograd.grad(l_up, new)
    l_ours, clip_ours, kl_ours, vk2, fr2 = ours(new, old, adv, **kw)
    (g_ours,) = torch.autograd.grad(l_ours, new)
    torch.testing.assert_close(l_ours, l_up, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_up, rtol=1e-6, atol=1e-7)
    if dual is None:  # upstream counts dual-clipped tokens differently; both report the plain clip then
        assert float(clip_ours) == pytest.approx(float(clip_up), abs=1e-6)
    assert float(kl_ours) == pytest.approx(float(kl_up), abs=1e-6)
    assert vk is None and vk2 is None and fr2 is None


@pytest.mark.parametrize("name, params", [
    ("kl_cov", {"k_ratio": 0.2, "kl_coef_cov": 1.0}),
    ("clip_cov", {"clip_ratio": 0.2, "cov_lb": -10.0, "cov_ub": 10.0, "eps_low": 0.2, "eps_high": 0.28}),
    ("entro_reg", {"beta": 0.01, "eps_low": 0.2, "eps_high": 0.28}),
    ("rsi_s", {"lower": 0.2, "upper": 3.0, "eps_low": 0.2, "eps_high": 0.28}),
])
def test_dispatches_to_registry_losses(name, params):
    new, old, adv, mask = _batch(seed=1)
    ent = torch.rand(4, 9, requires_grad=True)  # OpenRLHF's entropy spans the whole sequence; last T used
    loss_fn = HapoPolicyLoss(name, params, aggregation="token-mean")
    extra = {}
    if name in ("entro_reg", "rsi_s"):  # the losses that take the current entropy
        assert loss_fn.needs_entropy
        loss_fn.pending_entropy = ent
        extra["entropy"] = ent[:, -7:]
    torch.manual_seed(3)
    got = loss_fn(new, old, adv, action_mask=mask, dp_size=1, batch_num_tokens=torch.tensor(float(mask.sum())))[0]
    torch.manual_seed(3)
    want, _ = compute_policy_loss(name, new, old, adv, mask, aggregation="token-mean",
                                  normalizer=float(mask.sum()), **extra, **params)
    torch.testing.assert_close(got, want)
    if name in ("entro_reg", "rsi_s"):
        assert loss_fn.pending_entropy is None  # consumed: a stale entropy is never reused
        with pytest.raises(RuntimeError, match="entropy"):
            loss_fn(new, old, adv, action_mask=mask)


def test_a_non_finite_loss_reaches_the_gradient_guard_without_a_sync():
    """The actors' loss checks nothing per micro-batch (a check would wait for the GPU): a NaN
    advantage gives a NaN loss and NaN gradients, which the optimizer step's guard skips
    (algos/grad_guard.py; the actors' tests). The registry's own entry point still refuses it."""
    new, old, adv, mask = _batch()
    adv[1, 1] = float("nan")
    new = new.detach().clone().requires_grad_(True)
    loss, *_ = HapoPolicyLoss("ppo", {})(new, old, adv, action_mask=mask)
    assert torch.isnan(loss)
    loss.backward()
    assert not torch.isfinite(new.grad).all()
    with pytest.raises(FloatingPointError, match="non-finite"):
        compute_policy_loss("ppo", new.detach(), old, adv, mask.float())


def test_a_stateful_loss_trains_with_the_state_the_actor_received_and_reports_its_metrics():
    """STARE on the actors: the step's controller state arrives with ``set_loss_state``
    (actor.py / megatron_actor.py via ``LossStateSink``); without it the loss refuses to run
    ungated; with it the loss is the registry's with that state, and its own metrics reach
    upstream's per-micro-batch info (the training_step wrapper's ``info_sink``)."""
    from hapo_openrlhf.integrations.openrlhf.actors.loss import LossStateSink

    new, old, adv, mask = _batch(seed=2)
    loss_fn = HapoPolicyLoss("stare", {"variant": "C2", "top_ratio": 0.3}, aggregation="token-mean")
    with pytest.raises(RuntimeError, match="controller state has not reached the actor"):
        loss_fn(new, old, adv, action_mask=mask)
    actor = LossStateSink()
    actor.loss_fn = loss_fn
    state = {"gate_on": True, "reweight_w": 1.4, "reweight_m": 0.6}
    actor.set_loss_state(state)
    info: dict = {}
    loss_fn.info_sink = info
    got = loss_fn(new, old, adv, action_mask=mask, dp_size=2, batch_num_tokens=torch.tensor(float(mask.sum())))[0]
    want, m = compute_policy_loss("stare", new, old, adv, mask, aggregation="token-mean",
                                  normalizer=float(mask.sum()) / 2, loss_state=state, variant="C2", top_ratio=0.3)
    torch.testing.assert_close(got, want)
    assert float(info["stare/reweight_w"]) == pytest.approx(1.4) and float(info["stare/reweight_m"]) == pytest.approx(0.6)
    assert float(info["stare/positive_reweight_frac"]) == pytest.approx(m["stare/positive_reweight_frac"])
    ungated, _ = compute_policy_loss("stare", new, old, adv, mask, aggregation="token-mean",
                                     normalizer=float(mask.sum()) / 2, variant="C2", top_ratio=0.3)
    assert not torch.equal(got, ungated)  # the received W and M, not the configured ones
