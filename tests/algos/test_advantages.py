import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hapo_openrlhf.algos import (
    AdvantageInputs,
    compute_advantages,
    list_estimators,
    run_estimator,
)
from hapo_openrlhf.algos.advantages import group_token_entropy_stats


def inputs(rewards, mask, entropy, groups):
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float32), response_mask=torch.tensor(mask, dtype=torch.float32),
        entropy=torch.tensor(entropy, dtype=torch.float32), group_index=torch.tensor(groups),
    )


def test_registry_lists_every_estimator_in_the_issue():
    assert {"grpo", "dr_grpo", "hapo", "quadrant", "w_reinf", "entro_adv", "forking"} <= set(list_estimators())


def test_grpo_hand_computed():
    # group 0: rewards 1,0,0 -> mean 1/3, unbiased std sqrt(1/3) = 0.57735; group 1 all equal -> 0
    x = inputs([1, 0, 0, 1, 1], [[1, 1, 0]] * 5, [[0.1, 0.2, 0.3]] * 5, [0, 0, 0, 7, 7])
    adv = compute_advantages("grpo", x)
    s = math.sqrt(1 / 3)
    assert adv[0].tolist() == pytest.approx([(2 / 3) / (s + 1e-6)] * 2 + [0.0], rel=1e-5)
    assert adv[1, 0].item() == pytest.approx((-1 / 3) / (s + 1e-6), rel=1e-5)
    assert adv[3:].abs().sum() == 0  # zero-variance group
    assert adv[:, 2].abs().sum() == 0  # masked tokens


def test_singleton_group_and_group_index_order_do_not_matter():
    x = inputs([1, 0, 1], [[1]] * 3, [[0.5]] * 3, [5, 2, 2])
    adv = compute_advantages("grpo", x)
    assert adv[0].item() == 0.0
    assert adv[1].item() == pytest.approx(-adv[2].item())


def test_dr_grpo_and_w_reinf_hand_computed():
    x = inputs([1, 0, 0, 0], [[1, 1]] * 4, [[0.0, 0.0]] * 4, [0] * 4)
    assert compute_advantages("dr_grpo", x)[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert compute_advantages("w_reinf", x)[:, 1].tolist() == pytest.approx([0.1, -1, -1, -1])
    assert compute_advantages("w_reinf", x, lam=0.5)[0, 0].item() == pytest.approx(0.5)


def test_entro_adv_hand_computed():
    # rewards (1, 0): A = +-0.5 / std, std = sqrt(0.5) (unbiased) -> +-0.70711
    x = inputs([1, 0], [[1, 1], [1, 1]], [[0.5, 3.0], [0.5, 3.0]], [0, 0])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 0.5) / unbiased std of (1, 0)
    adv = compute_advantages("entro_adv", x, alpha=0.4, kappa=2.0)
    # bonus = min(0.4 * H, |A| / 2): 0.2 for H=0.5; capped at |A|/2 for H=3
    assert adv[0].tolist() == pytest.approx([a + 0.2, a + a / 2], rel=1e-5)
    assert adv[1].tolist() == pytest.approx([-a + 0.2, -a + a / 2], rel=1e-5)
    assert (torch.sign(adv) == torch.tensor([[1.0, 1.0], [-1.0, -1.0]])).all()


def test_forking_keeps_top_rho_tokens_and_shrinks_loss_mask():
    ent = [[0.1, 0.9, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8, 1.0]]
    x = inputs([1, 0], [[1] * 5] * 2, ent, [0, 0])
    out = run_estimator("forking", x, rho=0.2)
    # 10 tokens, top 20% = entropies 0.9 and 1.0
    assert out.loss_mask.tolist() == [[0, 1, 0, 0, 0], [0, 0, 0, 0, 1]]
    assert (out.advantages != 0).sum() == 2
    assert out.metrics["forking/token_frac"] == pytest.approx(0.2)


def test_quadrant_masks_hand_computed():
    ent = [[0.1, 0.9], [0.1, 0.9]]
    x = inputs([1, 0], [[1, 1], [1, 1]], ent, [0, 0])
    # fixed threshold 0.5: seq 0 positive -> (PLR, PHR); seq 1 negative -> (NLR, NHR)
    for qs, keep in [
        (["PHR"], [[0, 1], [0, 0]]), (["PLR"], [[1, 0], [0, 0]]), (["NHR"], [[0, 0], [0, 1]]),
        (["NLR"], [[0, 0], [1, 0]]), (["PHR", "NLR"], [[0, 1], [1, 0]]),
    ]:
        out = run_estimator("quadrant", x, quadrants=qs, threshold=0.5)
        assert out.loss_mask.tolist() == keep
        assert ((out.advantages != 0).float() == torch.tensor(keep, dtype=torch.float32)).all()


# ------------------------------------------------------------------- HAPO
def test_hapo_hand_computed_zscore_and_mean_ratio():
    # one group, 2 responses x 2 tokens, H = 1, 3 | 1, 3 -> mu 2, sigma 1 (population)
    x = inputs([1, 0], [[1, 1], [1, 1]], [[1.0, 3.0], [1.0, 3.0]], [0, 0])
    mu, sigma = group_token_entropy_stats(x)
    assert mu[0].item() == pytest.approx(2.0) and sigma[0].item() == pytest.approx(1.0)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 0.5) / unbiased std of (1, 0)
    adv = compute_advantages("hapo", x, alpha=0.2, phi=2.0)
    # z = -1, +1 -> multipliers 0.8, 1.2
    assert adv[0].tolist() == pytest.approx([a * 0.8, a * 1.2], rel=1e-4)
    assert adv[1].tolist() == pytest.approx([-a * 0.8, -a * 1.2], rel=1e-4)
    adv = compute_advantages("hapo", x, alpha=0.2, phi=2.0, normalize="mean_ratio")
    # c = H / mu = 0.5, 1.5 -> 1 + 0.2 (c - 1) = 0.9, 1.1
    assert adv[0].tolist() == pytest.approx([a * 0.9, a * 1.1], rel=1e-4)


def test_hapo_clips_at_phi():
    x = inputs([1, 0], [[1] * 5] * 2, [[0, 0, 0, 0, 100]] * 2, [0, 0])
    out = run_estimator("hapo", x, alpha=0.2, phi=1.5)
    assert out.metrics["hapo/adv_scale_max"] == pytest.approx(1.3, abs=1e-6)


@pytest.mark.parametrize("alpha,phi", [(0.5, 2.0), (1.0, 1.0), (0.25, 4.0)])
def test_hapo_rejects_alpha_phi_at_least_one(alpha, phi):
    x = inputs([1, 0], [[1]] * 2, [[0.1]] * 2, [0, 0])
    with pytest.raises(ValueError, match="alpha \\* hapo.phi"):
        compute_advantages("hapo", x, alpha=alpha, phi=phi)


def test_unknown_estimator_param_and_shape_errors():
    x = inputs([1, 0], [[1]] * 2, [[0.1]] * 2, [0, 0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'hapoo'.*did you mean 'hapo'"):
        compute_advantages("hapoo", x)
    with pytest.raises(ValueError, match="has no parameter"):
        compute_advantages("grpo", x, alpha=0.1)
    with pytest.raises(ValueError, match="rewards must be"):
        inputs([1, 0, 1], [[1]] * 2, [[0.1]] * 2, [0, 0])
    with pytest.raises(ValueError, match="entropy must be"):
        AdvantageInputs(rewards=torch.ones(2), response_mask=torch.ones(2, 3), entropy=torch.ones(2, 2),
                        group_index=torch.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        inputs([float("nan"), 0], [[1]] * 2, [[0.1]] * 2, [0, 0])


batches = st.integers(0, 10_000).map(
    lambda seed: _random_batch(torch.Generator().manual_seed(seed))
)


def _random_batch(g):
    G, K = int(torch.randint(2, 5, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    B, T = G * K, int(torch.randint(1, 7, (1,), generator=g))
    mask = (torch.rand(B, T, generator=g) < 0.8).float()
    mask[:, 0] = 1
    return AdvantageInputs(
        rewards=torch.randint(0, 2, (B,), generator=g).float(), response_mask=mask,
        entropy=torch.rand(B, T, generator=g) * 3, group_index=torch.arange(K).repeat_interleave(G),
    )


@settings(max_examples=60, deadline=None)
@given(x=batches)
def test_hapo_alpha_zero_is_grpo(x):
    assert torch.allclose(compute_advantages("hapo", x, alpha=0.0), compute_advantages("grpo", x))


@settings(max_examples=60, deadline=None)
@given(x=batches, alpha=st.floats(0.0, 0.49), normalize=st.sampled_from(["zscore", "mean_ratio"]))
def test_hapo_preserves_sign(x, alpha, normalize):
    adv = compute_advantages("hapo", x, alpha=alpha, phi=2.0, normalize=normalize)
    base = compute_advantages("grpo", x)
    assert torch.equal(torch.sign(adv), torch.sign(base))


@settings(max_examples=60, deadline=None)
@given(x=batches, normalize=st.sampled_from(["zscore", "mean_ratio"]))
def test_hapo_monotone_in_entropy_within_a_response(x, normalize):
    adv = compute_advantages("hapo", x, normalize=normalize).abs()
    m = x.response_mask.bool()
    for i in range(adv.shape[0]):
        h, a = x.entropy[i][m[i]], adv[i][m[i]]
        order = torch.argsort(h)
        assert (a[order].diff() >= -1e-6).all()


@settings(max_examples=60, deadline=None)
@given(x=batches, junk=st.floats(-50, 50))
def test_hapo_masked_tokens_are_zero_and_do_not_move_stats(x, junk):
    adv = compute_advantages("hapo", x)
    assert (adv[x.response_mask == 0] == 0).all()
    ent2 = torch.where(x.response_mask.bool(), x.entropy, torch.full_like(x.entropy, junk))
    x2 = AdvantageInputs(rewards=x.rewards, response_mask=x.response_mask, entropy=ent2, group_index=x.group_index)
    assert torch.allclose(compute_advantages("hapo", x2), adv)


def test_hapo_no_gradient_through_entropy():
    x0 = _random_batch(torch.Generator().manual_seed(3))
    ent = x0.entropy.clone().requires_grad_(True)
    x = AdvantageInputs(rewards=x0.rewards, response_mask=x0.response_mask, entropy=ent, group_index=x0.group_index)
    adv = compute_advantages("hapo", x)
    assert not adv.requires_grad


@settings(max_examples=40, deadline=None)
@given(x=batches, q=st.sampled_from(["PHR", "PLR", "NHR", "NLR"]))
def test_hapo_ablated_quadrant_equals_grpo_on_its_tokens(x, q):
    from hapo_openrlhf.algos import entropy_threshold, quadrant_masks
    from hapo_openrlhf.algos.advantages import grpo_sequence_advantage

    adv = compute_advantages("hapo", x, ablate=[q])
    base = compute_advantages("grpo", x)
    tau = entropy_threshold(x.entropy, x.response_mask, quantile=0.8)
    masks = quadrant_masks(torch.sign(grpo_sequence_advantage(x)), x.entropy, x.response_mask, tau)
    assert torch.allclose(adv[masks[q]], base[masks[q]])
    full = compute_advantages("hapo", x)
    others = x.response_mask.bool() & ~masks[q]
    assert torch.allclose(adv[others], full[others])
