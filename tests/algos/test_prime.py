"""PRIME (algos/prime.py) against its recipe, restated loop for loop in prime_reference.py
(verl ``recipe/prime/``): random padded batches with several groups and uneven lengths."""

import math

import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos import prime as P
from tests.algos import prime_reference as ref


def _batch(seed, groups=3, n=4, T=9, min_len=1):
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    L = torch.randint(min_len, T + 1, (B,), generator=g)
    L[0] = T  # a full row
    mask = torch.arange(T)[None, :] < L[:, None]
    q = torch.randn(B, T, generator=g) * 3
    q[~mask] = torch.randn(int((~mask).sum()), generator=g)  # padding holds garbage: it must never count
    acc = (torch.rand(B, generator=g) < 0.5).float()
    acc[n:2 * n] = 1.0  # one group whose outcomes agree
    return q, mask, acc, L, torch.arange(groups).repeat_interleave(n), n


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam,granularity", [(0.0, "token"), (0.5, "token"), (0.0, "whole"), (0.7, "whole")])
def test_token_scores_equal_the_recipes_forward_tail(seed, lam, granularity):
    """prime_dp_rm.py, _forward_micro_batch: r = beta q (lam 0) or its reverse accumulation, on
    tokens 0..L-2 (the last token's own reward dropped) or summed onto token L-1 (whole)."""
    q, mask, _, L, _, _ = _batch(seed)
    got = P.token_scores(q, mask, beta=0.05, lam=lam, granularity=granularity)
    want = ref.forward_tail(q, L.tolist(), 0.05, lam, granularity)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if granularity == "token" and lam == 0.0:  # by hand: the last valid token's score is 0, the one before is beta q
        i = 0
        assert got[i, L[i] - 1] == 0 and got[i, L[i] - 2] == pytest.approx(0.05 * float(q[i, L[i] - 2]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_batch_norm_rloo_returns_and_whitening_equal_the_recipe(seed):
    """prime_dp_rm.py prime_norm, then prime_core_algos.py compute_rloo_advantage_return (both
    sources, per-source RLOO, the reverse cumulative sum, masked_whiten)."""
    q, mask, acc, L, group, n = _batch(seed, min_len=2)
    scores = P.batch_norm(P.token_scores(q, mask, beta=0.05))
    want_scores = ref.prime_norm(ref.forward_tail(q, L.tolist(), 0.05, 0.0, "token"))
    torch.testing.assert_close(scores, want_scores)
    adv, returns, _, _ = P.prime_advantages(scores, acc, mask, group, reward_dpo_coef=5.0, reward_gt_coef=5.0)
    want_adv, want_ret = ref.rloo_advantage_return(want_scores, acc, mask.long(), n, 5.0, 5.0)
    torch.testing.assert_close(returns, want_ret * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[mask], want_adv[mask], rtol=1e-4, atol=1e-5)
    assert bool((adv[~mask] == 0).all())
    # through the registry, from q: the same advantages
    inputs = algos.AdvantageInputs(rewards=acc, response_mask=mask, entropy=torch.zeros_like(q), group_index=group,
                                   process_q=q)
    out = algos.run_estimator("prime", inputs)
    torch.testing.assert_close(out.advantages, adv)
    assert 0 < out.metrics["prime/process_share"] < 1


def test_rloo_by_hand_on_one_group():
    """Three responses of one group, the outcome source (last token only): m = (1, 0, 1), b =
    2 / 2 = 1, so the last tokens get 1 * 3/2 - 1 = 0.5, 0 - 1 = -1, 0.5; nothing else."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    last = P.last_token_mask(mask)
    gt = torch.where(last, torch.tensor([1.0, 0.0, 1.0])[:, None], torch.zeros(3, 3))
    out = P.rloo(gt, last, torch.zeros(3, dtype=torch.long))
    assert out.tolist() == [[0, 0.5, 0], [0, 0, -1.0], [0.5, 0, 0]]
    # the process source on the whole mask: every valid token is shifted, including a zero-score last token
    s = torch.tensor([[2.0, 0, 0], [1.0, 1.0, 0], [0.0, 0, 0]])
    out = P.rloo(s, mask, torch.zeros(3, dtype=torch.long))  # m = (1, 2/3, 0), b = (5/3) / 2 = 5/6
    want = torch.tensor([[3 - 5 / 6, -5 / 6, 0], [1.5 - 5 / 6, 1.5 - 5 / 6, -5 / 6], [-5 / 6, 0, 0]])
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("coefs", [(5.0, 5.0), (0.0, 5.0), (5.0, 0.0), (1.0, 3.0)])
def test_source_weights_equal_the_recipe(seed, coefs):
    q, mask, acc, L, group, n = _batch(seed, groups=2, n=3, min_len=2)
    scores = P.token_scores(q, mask, beta=0.05)
    adv, ret, _, _ = P.prime_advantages(scores, acc, mask, group, reward_dpo_coef=coefs[0], reward_gt_coef=coefs[1])
    want_adv, want_ret = ref.rloo_advantage_return(scores, acc, mask.long(), n, *coefs)
    torch.testing.assert_close(ret, want_ret * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[mask], want_adv[mask], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prm_loss_and_its_gradient_equal_the_recipe(seed):
    """prime_core_algos.py, compute_ce_dpo_loss_rm: the value and d loss / d q (from the logit here)."""
    q, mask, acc, _, _, _ = _batch(seed)
    q1, q2 = q.clone().requires_grad_(), q.clone().requires_grad_()
    got = P.prm_loss(q1 * mask, acc, mask, beta=0.05)
    want = ref.ce_dpo_loss(q2 * mask, acc, mask.float(), 0.05)
    torch.testing.assert_close(got, want)
    got.backward(), want.backward()
    torch.testing.assert_close(q1.grad, q2.grad)
    assert bool((q1.grad[~mask] == 0).all()) and float(q1.grad.abs().sum()) > 0


def test_prm_loss_keeps_its_gradient_where_the_recipes_sigmoid_saturates():
    """|beta sum q| = 25: float32's sigmoid is 1.0, the recipe's BCE clamps log(0) to -100 and its
    gradient through the sigmoid is 0; from the logit the gradient is -beta (the documented deviation)."""
    q = torch.full((1, 5), 100.0, requires_grad=True)
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss = P.prm_loss(q, torch.zeros(1), mask, beta=0.05)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(25.0, rel=1e-5) and q.grad[0, 0] == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pairwise_accuracy_equals_the_recipes_dpo_accuracy(seed):
    q, mask, acc, _, group, n = _batch(seed)
    acc[0:n] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # a group with two of each
    assert P.pairwise_accuracy(q, acc, mask, group) == pytest.approx(float(ref.dpo_accuracy(q, acc, mask.float(), n)))


def test_outcome_auc_by_hand():
    q = torch.tensor([[3.0], [1.0], [2.0], [2.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    # positives 3, 2 vs negatives 1, 2: pairs (3>1, 3>2, 2>1, 2=2) -> (1 + 1 + 1 + 0.5) / 4
    assert P.outcome_auc(q, torch.tensor([1, 0, 1, 0]), mask) == 0.875
    assert math.isnan(P.outcome_auc(q, torch.ones(4), mask))


def test_whiten_equals_the_recipe_and_zero_off_the_mask():
    g = torch.Generator().manual_seed(5)
    x, mask = torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g) < 0.7
    got = P.masked_whiten(x, mask)
    torch.testing.assert_close(got[mask], ref.masked_whiten(x, mask.float())[mask])
    assert bool((got[~mask] == 0).all())


def test_prime_refuses_a_batch_without_q_or_with_a_singleton_group():
    mask = torch.ones(3, 2, dtype=torch.bool)
    base = dict(rewards=torch.tensor([1.0, 0.0, 1.0]), response_mask=mask, entropy=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="process_q"):
        algos.run_estimator("prime", algos.AdvantageInputs(group_index=torch.tensor([0, 0, 1]), **base))
    with pytest.raises(ValueError, match="at least 2 responses"):
        algos.run_estimator("prime", algos.AdvantageInputs(group_index=torch.tensor([0, 0, 1]),
                                                           process_q=torch.zeros(3, 2), **base))
    bad = torch.zeros(3, 2)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        algos.run_estimator("prime", algos.AdvantageInputs(group_index=torch.tensor([0, 0, 0]), process_q=bad, **base))


@pytest.mark.parametrize("params,match", [
    ({"beta": 0.0}, "beta must be > 0"), ({"beta": -0.05}, "beta must be > 0"),
    ({"beta": float("nan")}, "finite"), ({"beta": float("inf")}, "finite"),
    ({"reward_dpo_coef": -1.0}, "reward_dpo_coef must be >= 0"), ({"reward_gt_coef": -5.0}, "reward_gt_coef"),
    ({"reward_dpo_coef": 0.0, "reward_gt_coef": 0.0}, "both 0"), ({"lam": 1.5}, "lam must be in"),
    ({"granularity": "step"}, "granularity must be one of"), ({"norm": "layer_norm"}, "norm must be one of"),
])
def test_hostile_prime_parameters_are_one_named_error(params, match):
    with pytest.raises(ValueError, match=match):
        algos.ESTIMATORS.check_params("prime", params)


def test_prime_is_implemented_not_refused():
    assert "prime" in algos.list_estimators() and "prime" not in algos.ESTIMATORS.refused()
    assert algos.ESTIMATORS.get("PRIME".lower()).trains_prm


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam,granularity", [(0.0, "token"), (0.5, "token"), (0.0, "whole")])
def test_the_advantage_does_not_depend_on_where_a_rows_response_starts(seed, lam, granularity):
    """OpenRLHF's action masks start after each row's padding (found in the OpenRLHF end-to-end run,
    where every score had been dropped: the tail was placed by length from position 0). The same
    responses, each shifted right by its own offset, give the same scores and advantages, shifted."""
    q, mask, acc, L, gi, _ = _batch(seed)
    B, T = mask.shape
    shift = torch.randint(0, 6, (B,), generator=torch.Generator().manual_seed(seed + 10))
    W = T + 6
    q2, m2 = torch.randn(B, W), torch.zeros(B, W, dtype=torch.bool)  # garbage off the response
    for i in range(B):
        q2[i, shift[i]:shift[i] + T], m2[i, shift[i]:shift[i] + T] = q[i], mask[i]

    def back(x):  # the shifted rows' values at the original positions
        return torch.stack([x[i, shift[i]:shift[i] + T] for i in range(B)])

    kw = dict(beta=0.05, lam=lam, granularity=granularity)
    torch.testing.assert_close(back(P.token_scores(q2, m2, **kw)), P.token_scores(q, mask, **kw), rtol=0, atol=1e-7)
    a = algos.AdvantageInputs(rewards=acc, response_mask=mask, entropy=torch.zeros(B, T), group_index=gi,
                              correct=acc > 0.5, process_q=q)
    b = algos.AdvantageInputs(rewards=acc, response_mask=m2, entropy=torch.zeros(B, W), group_index=gi,
                              correct=acc > 0.5, process_q=q2)
    got_a = algos.run_estimator("prime", a, **kw).advantages
    got_b = algos.run_estimator("prime", b, **kw).advantages
    assert float(got_a.abs().max()) > 0.1
    torch.testing.assert_close(back(got_b), got_a, rtol=1e-5, atol=1e-6)
    assert float(got_b[~m2].abs().max()) == 0
