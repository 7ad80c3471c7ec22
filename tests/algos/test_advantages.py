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
from hapo_openrlhf.algos import group_token_entropy_stats, split_quadrants


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


# A batch with padding and two groups, used by the hand-computed HAPO and quadrant tests.
# Group 0 (rows 0-2, rewards 1, 0, 0): GRPO A = (2/3) / (sqrt(1/3) + eps) on the correct row,
# (-1/3) / (sqrt(1/3) + eps) on the two wrong ones. Valid entropies 2, 2.4, 4 | 2, 1.6 | 0, 2, 2, 2:
# mu_H = 18 / 9 = 2, sigma_H = sqrt((0.16 + 4 + 0.16 + 4) / 9) (population std).
# Group 1 (rows 3-4, rewards 1, 1): zero variance, A = 0; valid entropies 5, 1 | 3, 3, 3: mu_H = 3.
# 9.9 / 7.7 / 8.8 sit on padding and must never count.
PAD_BATCH = dict(
    rewards=[1, 0, 0, 1, 1],
    mask=[[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]],
    entropy=[[2.0, 2.4, 4.0, 9.9], [2.0, 1.6, 7.7, 7.7], [0.0, 2.0, 2.0, 2.0], [5.0, 1.0, 8.8, 8.8],
             [3.0, 3.0, 3.0, 8.8]],
    groups=[0, 0, 0, 7, 7],
)
A_POS = (2 / 3) / (math.sqrt(1 / 3) + 1e-6)
A_NEG = (-1 / 3) / (math.sqrt(1 / 3) + 1e-6)
SIGMA0 = math.sqrt(8.32 / 9)


def pad_batch(correct=None):
    x = inputs(PAD_BATCH["rewards"], PAD_BATCH["mask"], PAD_BATCH["entropy"], PAD_BATCH["groups"])
    if correct is None:
        return x
    return AdvantageInputs(rewards=x.rewards, response_mask=x.response_mask, entropy=x.entropy,
                           group_index=x.group_index, correct=torch.tensor(correct))


def test_group_entropy_stats_exclude_padding():
    x = pad_batch()
    mu, sigma = group_token_entropy_stats(x.entropy, x.response_mask, x.group_index)
    assert mu.squeeze(-1).tolist() == pytest.approx([2, 2, 2, 3, 3])
    assert sigma[0].item() == pytest.approx(SIGMA0, rel=1e-6)
    assert sigma[3].item() == pytest.approx(math.sqrt((4 + 4 + 0 + 0 + 0) / 5), rel=1e-6)


def test_hapo_published_every_token_hand_computed():
    """A^h = A + alpha * sign(A) * clip((H - mu)/sigma, -|A|/phi, +|A|/phi), alpha 0.2, phi 2."""
    out = run_estimator("hapo", pad_batch(), alpha=0.2, phi=2.0)
    z_small, z_big = 0.4 / SIGMA0, 2.0 / SIGMA0  # 0.416, 2.080
    b_pos, b_neg = abs(A_POS) / 2, abs(A_NEG) / 2  # the clip bounds 0.577 and 0.289
    assert z_small < b_pos and z_small > b_neg and z_big > b_pos
    expected = [
        # correct row: z = 0, 0.416 (inside the bound), 2.08 (clipped to +0.577); padding 0
        [A_POS, A_POS + 0.2 * z_small, A_POS + 0.2 * b_pos, 0.0],
        # wrong row: z = 0, -0.416 (clipped to -0.289: low entropy shrinks |A|)
        [A_NEG, A_NEG + 0.2 * b_neg, 0.0, 0.0],
        # wrong row: z = -2.08 (clipped to -0.289), then 0, 0, 0
        [A_NEG + 0.2 * b_neg, A_NEG, A_NEG, A_NEG],
        # zero-variance group: unchanged (0), whatever its entropies
        [0.0] * 4, [0.0] * 4,
    ]
    for row, exp in zip(out.advantages.tolist(), expected):
        assert row == pytest.approx(exp, rel=1e-5, abs=1e-7)
    # the bounds |A^h|/|A| = 1 + alpha/phi and 1 - alpha/phi are reached, not passed
    assert out.metrics["hapo/adv_scale_max"] == pytest.approx(1.1, rel=1e-5)
    assert out.metrics["hapo/adv_scale_min"] == pytest.approx(0.9, rel=1e-5)
    # 3 of the 9 tokens with A != 0 sit at the +-|A|/phi bound
    assert out.metrics["hapo/credit_saturated_frac"] == pytest.approx(3 / 9)


def test_hapo_credit_zero_when_group_entropy_is_constant():
    x = inputs([1, 0], [[1, 1], [1, 0]], [[0.7, 0.7], [0.7, 5.0]], [0, 0])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    adv = compute_advantages("hapo", x, alpha=1.0, phi=2.0)
    assert adv.flatten().tolist() == pytest.approx([a, a, -a, 0.0], rel=1e-6)


def test_hapo_alpha_one_accepted_and_alpha_at_least_phi_rejected():
    x = pad_batch()
    adv = compute_advantages("hapo", x, alpha=1.0, phi=2.0)  # the paper's sweep goes to 1.0
    # |A^h|/|A| in [1 - 1/2, 1 + 1/2]; e.g. the clipped correct token gets A_POS * 1.5
    assert adv[0, 2].item() == pytest.approx(A_POS * 1.5, rel=1e-5)
    assert adv[1, 1].item() == pytest.approx(A_NEG * 0.5, rel=1e-5)
    for alpha, phi in [(2.0, 2.0), (3.0, 2.0), (0.5, 0.5)]:
        with pytest.raises(ValueError, match=r"hapo.alpha .* must be < hapo.phi"):
            compute_advantages("hapo", x, alpha=alpha, phi=phi)
    for bad, match in [({"alpha": -0.1}, "hapo.alpha must be"), ({"phi": 0.0}, "hapo.phi must be"),
                       ({"form": "mult"}, "hapo.form must be"),
                       ({"normalize": "mean_ratio"}, "only for hapo.form: multiplicative")]:
        with pytest.raises(ValueError, match=match):
            compute_advantages("hapo", x, **bad)


def test_hapo_multiplicative_form_is_the_old_reconstruction():
    # one group, 2 responses x 2 tokens, H = 1, 3 | 1, 3 -> mu 2, sigma 1 (population)
    x = inputs([1, 0], [[1, 1], [1, 1]], [[1.0, 3.0], [1.0, 3.0]], [0, 0])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 0.5) / unbiased std of (1, 0)
    adv = compute_advantages("hapo", x, alpha=0.2, phi=2.0, form="multiplicative")
    # z = -1, +1 -> multipliers 0.8, 1.2 (the published rule would give 1 -+ 0.2 * min(1, a/2) / a)
    assert adv[0].tolist() == pytest.approx([a * 0.8, a * 1.2], rel=1e-4)
    assert adv[1].tolist() == pytest.approx([-a * 0.8, -a * 1.2], rel=1e-4)
    adv = compute_advantages("hapo", x, alpha=0.2, phi=2.0, form="multiplicative", normalize="mean_ratio")
    # c = H / mu = 0.5, 1.5 -> 1 + 0.2 (c - 1) = 0.9, 1.1
    assert adv[0].tolist() == pytest.approx([a * 0.9, a * 1.1], rel=1e-4)
    published = compute_advantages("hapo", x, alpha=0.2, phi=2.0)
    assert published[0].tolist() == pytest.approx([a - 0.2 * a / 2, a + 0.2 * a / 2], rel=1e-4)
    # its own limits: alpha * phi < 1, clip at phi
    with pytest.raises(ValueError, match="alpha \\* hapo.phi"):
        compute_advantages("hapo", x, alpha=0.5, phi=2.0, form="multiplicative")
    y = inputs([1, 0], [[1] * 5] * 2, [[0, 0, 0, 0, 100]] * 2, [0, 0])
    out = run_estimator("hapo", y, alpha=0.2, phi=1.5, form="multiplicative")
    assert out.metrics["hapo/adv_scale_max"] == pytest.approx(1.3, abs=1e-6)


def test_quadrant_masks_group_mean_hand_computed():
    x = pad_batch(correct=[True, False, False, True, True])
    masks, tau = split_quadrants(x, "group_mean", 0.8, None)
    assert tau.squeeze(-1).tolist() == pytest.approx([2, 2, 2, 3, 3])
    # high iff H >= its group's mean: group 0 mu 2, group 1 mu 3; polarity = outcome
    assert masks["PHR"].int().tolist() == [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0], [1, 1, 1, 0]]
    assert masks["PLR"].int().tolist() == [[0] * 4, [0] * 4, [0] * 4, [0, 1, 0, 0], [0] * 4]
    assert masks["NHR"].int().tolist() == [[0] * 4, [1, 0, 0, 0], [0, 1, 1, 1], [0] * 4, [0] * 4]
    assert masks["NLR"].int().tolist() == [[0] * 4, [0, 1, 0, 0], [1, 0, 0, 0], [0] * 4, [0] * 4]
    # the batch-quantile option is a different split: top 20% of the 14 valid tokens
    qm, qtau = split_quadrants(x, "quantile", 0.8, None)
    assert qtau.item() == 3.0 and int(sum(m.sum() for m in qm.values())) == 14
    assert qm["PHR"].int().tolist()[0] == [0, 0, 1, 0]


def test_quadrant_estimator_group_mean_and_zero_advantage_groups():
    x = pad_batch(correct=[True, False, False, True, True])
    for qs, keep in [
        (["PHR"], [[1, 1, 1, 0], [0] * 4, [0] * 4]),
        (["PLR"], [[0] * 4] * 3),
        (["NHR"], [[0] * 4, [1, 0, 0, 0], [0, 1, 1, 1]]),
        (["NLR"], [[0] * 4, [0, 1, 0, 0], [1, 0, 0, 0]]),
    ]:
        out = run_estimator("quadrant", x, quadrants=qs)
        # rows 3-4 (zero-variance group) carry no gradient and leave the normaliser
        assert out.loss_mask.int().tolist() == keep + [[0] * 4, [0] * 4]
        assert ((out.advantages != 0).int() == out.loss_mask.int()).all()
    fixed = run_estimator("quadrant", x, quadrants=["PHR"], split="value", threshold=2.2)
    assert fixed.loss_mask.int().tolist()[0] == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="split 'value' needs quadrant.threshold"):
        run_estimator("quadrant", x, split="value")
    with pytest.raises(ValueError, match="quadrant.threshold is only used with"):
        run_estimator("quadrant", x, threshold=0.5)


def test_quadrant_masks_hand_computed():
    ent = [[0.1, 0.9], [0.1, 0.9]]
    x = inputs([1, 0], [[1, 1], [1, 1]], ent, [0, 0])
    # fixed threshold 0.5: seq 0 positive -> (PLR, PHR); seq 1 negative -> (NLR, NHR)
    for qs, keep in [
        (["PHR"], [[0, 1], [0, 0]]), (["PLR"], [[1, 0], [0, 0]]), (["NHR"], [[0, 0], [0, 1]]),
        (["NLR"], [[0, 0], [1, 0]]), (["PHR", "NLR"], [[0, 1], [1, 0]]),
    ]:
        out = run_estimator("quadrant", x, quadrants=qs, split="value", threshold=0.5)
        assert out.loss_mask.tolist() == keep
        assert ((out.advantages != 0).float() == torch.tensor(keep, dtype=torch.float32)).all()


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


FORMS = st.sampled_from([("additive", "zscore"), ("multiplicative", "zscore"), ("multiplicative", "mean_ratio")])


@settings(max_examples=60, deadline=None)
@given(x=batches, form=FORMS)
def test_hapo_alpha_zero_is_grpo(x, form):
    adv = compute_advantages("hapo", x, alpha=0.0, form=form[0], normalize=form[1])
    assert torch.allclose(adv, compute_advantages("grpo", x))


@settings(max_examples=80, deadline=None)
# the parameters a config admits: float32's range (registry._check_types), so no subnormal alpha
@given(x=batches, alpha=st.floats(0.0, 1.9800000190734863, width=32, allow_subnormal=False), phi=st.floats(0.05, 5.0))
def test_hapo_preserves_sign_and_bounds_the_ratio(x, alpha, phi):
    alpha = min(alpha, 0.999 * phi)
    adv = compute_advantages("hapo", x, alpha=alpha, phi=phi)
    base = compute_advantages("grpo", x)
    assert torch.equal(torch.sign(adv), torch.sign(base))
    nz = base != 0
    ratio = (adv[nz] / base[nz]).abs()
    assert (ratio >= 1 - alpha / phi - 1e-5).all() and (ratio <= 1 + alpha / phi + 1e-5).all()


@settings(max_examples=60, deadline=None)
@given(x=batches, alpha=st.floats(0.0, 0.47999998927116394, width=32, allow_subnormal=False),
       normalize=st.sampled_from(["zscore", "mean_ratio"]))
def test_hapo_multiplicative_preserves_sign(x, alpha, normalize):
    adv = compute_advantages("hapo", x, alpha=alpha, phi=2.0, form="multiplicative", normalize=normalize)
    base = compute_advantages("grpo", x)
    assert torch.equal(torch.sign(adv), torch.sign(base))


@settings(max_examples=60, deadline=None)
@given(x=batches, form=FORMS)
def test_hapo_monotone_in_entropy_within_a_response(x, form):
    adv = compute_advantages("hapo", x, form=form[0], normalize=form[1]).abs()
    m = x.response_mask.bool()
    for i in range(adv.shape[0]):
        h, a = x.entropy[i][m[i]], adv[i][m[i]]
        order = torch.argsort(h)
        assert (a[order].diff() >= -1e-6).all()


@settings(max_examples=60, deadline=None)
@given(x=batches, junk=st.one_of(st.floats(-50, 50), st.just(float("nan")), st.just(float("inf"))), form=FORMS)
def test_hapo_masked_tokens_are_zero_and_do_not_move_stats(x, junk, form):
    kw = dict(form=form[0], normalize=form[1])
    adv = compute_advantages("hapo", x, **kw)
    assert (adv[x.response_mask == 0] == 0).all()
    ent2 = torch.where(x.response_mask.bool(), x.entropy, torch.full_like(x.entropy, junk))
    x2 = AdvantageInputs(rewards=x.rewards, response_mask=x.response_mask, entropy=ent2, group_index=x.group_index)
    assert torch.allclose(compute_advantages("hapo", x2, **kw), adv)


@pytest.mark.parametrize("form", ["additive", "multiplicative"])
def test_hapo_no_gradient_through_entropy(form):
    x0 = _random_batch(torch.Generator().manual_seed(3))
    ent = x0.entropy.clone().requires_grad_(True)
    x = AdvantageInputs(rewards=x0.rewards, response_mask=x0.response_mask, entropy=ent, group_index=x0.group_index)
    adv = compute_advantages("hapo", x, form=form)
    assert not adv.requires_grad
    # and an advantage used as a loss weight sends nothing back to H
    logits = torch.zeros_like(ent, requires_grad=True)
    (adv * logits).sum().backward()
    assert ent.grad is None


@settings(max_examples=40, deadline=None)
@given(x=batches, q=st.sampled_from(["PHR", "PLR", "NHR", "NLR"]), split=st.sampled_from(["group_mean", "quantile"]))
def test_hapo_ablated_quadrant_equals_grpo_on_its_tokens(x, q, split):
    adv = compute_advantages("hapo", x, ablate=[q], split=split)
    base = compute_advantages("grpo", x)
    masks, _ = split_quadrants(x, split, 0.8, None)
    assert torch.allclose(adv[masks[q]], base[masks[q]])
    full = compute_advantages("hapo", x)
    others = x.response_mask.bool() & ~masks[q]
    assert torch.allclose(adv[others], full[others])


def test_hapo_has_its_own_module_naming_its_paper():
    """Issue 56: HAPO is registered from algos/hapo.py, which opens with its paper (arXiv
    2604.11056v1, Eq. 6-7) and its deviations; advantages.py holds the baselines."""
    import inspect

    from hapo_openrlhf.algos import ESTIMATORS, hapo

    assert inspect.getmodule(ESTIMATORS.get("hapo").fn) is hapo
    doc = hapo.__doc__
    assert "2604.11056v1" in doc and "Eq. 6-7" in doc and "Deviations" in doc
    assert inspect.getmodule(ESTIMATORS.get("grpo").fn).__name__.endswith("algos.advantages")
