"""PAEC (SPEC 2.8, issue 39): its position mask, its floor penalty and gradient, the host
loss at beta = 0 and before the anchor, the anchor over the first K steps, and its
unpublished values as required parameters. No code is published; the oracle is the
formula evaluated by hand or row by row in Python."""

import math

import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.paec import observe, position_mask, step_state

from ._ragged import ragged_batch

P = dict(beta=2.0, rho_min=0.5, top_p=0.9, mask="nucleus_entropy", softness=0.0)


def _batch(seed=0, B=5, T=9):
    g, mask, logp, old, adv, ent = ragged_batch(seed, B, T)
    hp = ent * torch.rand(B, T, generator=g)
    gap = torch.rand(B, T, generator=g) * 3
    for t in (logp, ent, hp, gap):
        t[~mask] = 7.0  # padding holds garbage
    return logp, old, adv, mask, ent, hp, gap


def test_the_mask_by_hand():
    hp = torch.tensor([[0.1, 0.9, 0.5, 0.9, 0.2, 0.0, 0.3, 0.4, 0.8, 0.7, 5.0]])
    gap = torch.tensor([[3.0, 0.1, 2.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, 10] = False  # padding: never selected, though its score is the largest
    # 10 positions, top 20%: k = 2 by score; the two 0.9s
    m = position_mask(hp, gap, mask, mask="nucleus_entropy", rho=0.8, softness=0.0)
    assert m[0].nonzero().squeeze(-1).tolist() == [1, 3]
    # -gap: the smallest gaps 0.0 and 0.1
    m = position_mask(hp, gap, mask, mask="top2_gap", rho=0.8, softness=0.0)
    assert m[0].nonzero().squeeze(-1).tolist() == [1, 4]
    # Hp exp(-g): 0.9 e^-0.1 = 0.814, 0.2, 0.9 e^-0.5 = 0.546, 0.8 e^-1 = 0.294, 0.7 e^-1 = 0.258
    m = position_mask(hp, gap, mask, mask="product", rho=0.8, softness=0.0)
    assert m[0].nonzero().squeeze(-1).tolist() == [1, 3]
    # ties at the threshold all join; ceil((1 - rho) T) at least one
    m = position_mask(torch.ones(1, 11), gap, mask, mask="nucleus_entropy", rho=0.8, softness=0.0)
    assert m[0, :10].sum() == 10 and m[0, 10] == 0
    m = position_mask(hp[:, :3], gap[:, :3], mask[:, :3], mask="nucleus_entropy", rho=0.99, softness=0.0)
    assert m.tolist() == [[0.0, 1.0, 0.0]]
    # soft: sigmoid((score - thr) / softness), thr the k-th largest (0.9): 0.5 at the selected
    m = position_mask(hp, gap, mask, mask="nucleus_entropy", rho=0.8, softness=0.1)
    want = torch.sigmoid((hp[0, :10] - 0.9) / 0.1)
    torch.testing.assert_close(m[0, :10], want)
    assert m[0, 10] == 0


def test_the_penalty_and_its_gradient_by_hand():
    logp, old, adv, mask, ent, hp, gap = _batch()
    ent = ent.clone().requires_grad_(True)
    h_low = 3.0
    loss, met = algos.compute_policy_loss("paec", logp, old, adv, mask, entropy=ent, nucleus_entropy=hp, top2_gap=gap,
                                          loss_state={"h_low": h_low}, **P)
    host, _ = algos.compute_policy_loss("ppo", logp, old, adv, mask)
    m = position_mask(hp, gap, mask, mask="nucleus_entropy", rho=0.8, softness=0.0)
    h_bar = float((m * ent.detach()).sum() / m.sum())
    assert met["paec/masked_entropy"] == pytest.approx(h_bar)
    assert float(loss) == pytest.approx(float(host) + 2.0 * (h_low - h_bar) ** 2, rel=1e-6)
    loss.backward()
    # d/dH_t = -2 beta (H_low - H_bar) m_t / sum m: only the selected positions, all equal
    want = -2 * 2.0 * (h_low - h_bar) * m / m.sum()
    torch.testing.assert_close(ent.grad, want)
    assert met["paec/below_floor"] == 1.0 and met["paec/penalty"] == pytest.approx(2.0 * (h_low - h_bar) ** 2)
    # above the floor: no penalty, no entropy gradient
    loss, met = algos.compute_policy_loss("paec", logp, old, adv, mask, entropy=ent.detach(), nucleus_entropy=hp,
                                          top2_gap=gap, loss_state={"h_low": 0.01}, **P)
    assert float(loss) == pytest.approx(float(host)) and met["paec/penalty"] == 0 and met["paec/below_floor"] == 0


@pytest.mark.parametrize("state, params", [({"h_low": 5.0}, dict(P, beta=0.0)), ({"h_low": None}, P), (None, P)])
def test_beta_zero_or_no_anchor_yet_is_the_host_loss_exactly(state, params):
    logp, old, adv, mask, ent, hp, gap = _batch(seed=3)
    ent = ent.clone().requires_grad_(True)
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, rollout_logprobs=old - 0.1,
              is_correction={"level": "token", "mode": "clip", "threshold": [0.5, 2.0]})
    got, _ = algos.compute_policy_loss("paec", logp, old, adv, mask, entropy=ent, nucleus_entropy=hp, top2_gap=gap,
                                       loss_state=state, **kw, **{k: v for k, v in params.items()})
    want, _ = algos.compute_policy_loss("ppo", logp, old, adv, mask, **kw)
    assert torch.equal(got, want)


def test_micro_batches_weight_their_penalties_by_their_share():
    """Each call's penalty times its share of the step's tokens: the calls sum to the
    token-weighted mean of the per-call penalties; one call is the whole batch's."""
    logp, old, adv, mask, ent, hp, gap = _batch(seed=5, B=6)
    n = float(mask.sum())
    kw = dict(entropy=ent, nucleus_entropy=hp, top2_gap=gap, loss_state={"h_low": 5.0})
    whole, _ = algos.compute_policy_loss("paec", logp, old, adv, mask, normalizer=n, **kw, **P)
    one, _ = algos.compute_policy_loss("paec", logp, old, adv, mask, **kw, **P)
    assert float(whole) == pytest.approx(float(one))
    parts, want_pen = 0.0, 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        sub = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        loss, met = algos.compute_policy_loss("paec", logp[rows], old[rows], adv[rows], mask[rows], normalizer=n,
                                              **sub, **P)
        parts += float(loss)
        want_pen += float(mask[rows].sum()) / n * 2.0 * (5.0 - met["paec/masked_entropy"]) ** 2
    host, _ = algos.compute_policy_loss("ppo", logp, old, adv, mask)
    assert parts == pytest.approx(float(host) + want_pen, rel=1e-6)


def test_the_anchor_is_the_mean_of_the_first_k_steps_and_then_fixed():
    params = {**algos.LOSSES.get("paec").defaults, **P, "anchor_steps": 3}
    s: dict = {}
    for h in (1.0, float("nan"), 2.0):  # a step without a finite value is not counted
        state, s, met = step_state(params, s)
        assert state == {"h_low": None} and met == {}
        s = observe(params, s, {"paec/masked_entropy": h})
    assert "anchor" not in s
    s = observe(params, s, {"paec/masked_entropy": 6.0})
    assert s["anchor"] == pytest.approx(3.0)
    s = observe(params, s, {"paec/masked_entropy": 100.0})  # fixed once set
    state, s2, met = step_state(params, s)
    assert s["anchor"] == 3.0 and state == {"h_low": 1.5} and met == {"paec/h_low": 1.5} and s2 == s
    # through the registry's seams, a loss without state or observer passes through
    assert algos.loss_observe("ppo", {}, {"x": 1}, {}) == {"x": 1}
    assert algos.loss_observe("paec", dict(P, anchor_steps=1), {}, {"paec/masked_entropy": 2.0})["anchor"] == 2.0


def test_the_heads_are_asked_for_the_signals_at_paec_top_p_only():
    assert algos.head_signals_top_p("paec", dict(P, top_p=0.7)) == 0.7
    assert algos.head_signals_top_p("ppo", {}) is None and algos.head_signals_top_p("rsi_s", {}) is None


@pytest.mark.parametrize("params, named", [
    ({}, "beta, rho_min, top_p, mask, softness must be set: Yang et al. .* do not publish them"),
    ({k: v for k, v in P.items() if k != "mask"}, "paec: mask must be set"),
    (dict(P, beta=float("nan")), "beta must be a finite number"),
    (dict(P, beta=-1.0), "beta must be >= 0"),
    (dict(P, rho_min=float("inf")), "rho_min must be a finite number"),
    (dict(P, rho_min=-0.5), "rho_min must be >= 0"),
    (dict(P, top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(P, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(P, top_p="0.9"), "top_p must be a finite number"),
    (dict(P, rho=1.0), r"rho must be in \[0, 1\)"), (dict(P, rho=-0.1), r"rho must be in \[0, 1\)"),
    (dict(P, softness=-1.0), "softness must be >= 0"),
    (dict(P, mask="entropy"), "mask must be one of"), (dict(P, mask=1), "mask must be one of"),
    (dict(P, anchor_steps=0), "anchor_steps must be an integer >= 1"),
    (dict(P, anchor_steps=1.5), "anchor_steps must be an integer"),
    (dict(P, anchor_steps=True), "anchor_steps must be"),
    (dict(P, eps_low=1.5), "eps_low must be in"),
])
def test_hostile_and_missing_values_are_named(params, named):
    with pytest.raises(ValueError, match=named):
        algos.LOSSES.check_params("paec", params)


def test_the_loss_without_the_head_signals_is_a_named_error():
    logp, old, adv, mask, ent, hp, gap = _batch()
    with pytest.raises(ValueError, match="paec needs `entropy` .* `nucleus_entropy` and `top2_gap`"):
        algos.compute_policy_loss("paec", logp, old, adv, mask, entropy=ent, **P)


def test_a_config_naming_paec_without_its_unpublished_values_is_refused():
    from hapo_openrlhf.config import load_config

    from ..conftest import REPO

    with pytest.raises(ValueError, match="paec: beta, rho_min, top_p, mask, softness must be set"):
        load_config(REPO / "configs" / "cpu_tiny.yaml", ["algorithm.loss=paec", "algorithm.loss_params={}"])
    assert math.isfinite(P["beta"])
