"""RSI-S (SPEC 2.8, issue 39): its index, its kept-token normaliser, the host loss at
bounds [0, inf), and its unpublished bounds as required parameters. No official code
exists; the oracle is the formula evaluated token by token in Python."""

import math

import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.rsi import relative_surprisal

from ._ragged import ragged_batch


def _batch(seed=0, B=5, T=8):
    _, mask, logp, old, adv, ent = ragged_batch(seed, B, T)
    logp[~mask], ent[~mask] = 9.0, float("nan")  # padding holds garbage
    return logp, old, adv, mask, ent


def test_the_index_and_the_kept_tokens_by_hand():
    logp = torch.tensor([[-1.0, -0.5, -2.0, 0.0]])
    ent = torch.tensor([[2.0, 0.25, 1.0, 0.0]])  # RSI: 0.5, 2, 2, 0 (a one-hot's own token)
    assert relative_surprisal(logp, ent).tolist() == [[0.5, 2.0, 2.0, 0.0]]
    assert relative_surprisal(torch.tensor([[-0.1]]), torch.tensor([[0.0]])).item() == math.inf
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.ones(1, 4)
    loss, m = algos.compute_policy_loss("rsi_s", logp, logp, adv, mask, entropy=ent, lower=0.4, upper=1.5)
    # ratio 1 everywhere: the surrogate is -A = -1 per token; only the first token is kept
    assert float(loss) == -1.0 and m["rsi/kept_frac"] == 0.25 and m["rsi/index_mean"] == 0.5
    loss, m = algos.compute_policy_loss("rsi_s", logp, logp, adv * torch.tensor([[1.0, 2, 3, 4]]), mask, entropy=ent,
                                        lower=1.0, upper=None)
    assert float(loss) == pytest.approx(-(2 + 3) / 2) and m["rsi/kept_frac"] == 0.5


@pytest.mark.parametrize("seed", range(3))
def test_bounds_zero_to_infinity_are_the_host_loss_exactly(seed):
    logp, old, adv, mask, ent = _batch(seed)
    common = dict(aggregation="token-mean", normalizer=float(mask.sum()) * 2.5, eps_low=0.2, eps_high=0.28,
                  dual_clip=3.0)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    la, _ = algos.compute_policy_loss("rsi_s", a, old, adv, mask, entropy=ent, lower=0.0, upper=None, **common)
    lb, _ = algos.compute_policy_loss("ppo", b, old, adv, mask, **common)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)


def test_the_normaliser_counts_kept_tokens_and_micro_batches_rescale_by_their_kept_fraction():
    logp, old, adv, mask, ent = _batch(4)
    kw = dict(entropy=ent, lower=0.5, upper=2.0, aggregation="token-mean")
    whole, m = algos.compute_policy_loss("rsi_s", logp, old, adv, mask, **kw)
    rsi = relative_surprisal(logp, ent)
    keep = mask & (rsi >= 0.5) & (rsi <= 2.0)
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    torch.testing.assert_close(whole, pg[keep].sum() / keep.sum())  # one micro-batch: the kept count
    # the actors' global normaliser (all valid tokens of the step) is rescaled by the kept fraction
    same, _ = algos.compute_policy_loss("rsi_s", logp, old, adv, mask, normalizer=float(mask.sum()), **kw)
    torch.testing.assert_close(same, whole)
    assert 0 < m["rsi/kept_frac"] < 1


@pytest.mark.parametrize("params, named", [
    ({}, "lower and upper must be set: .* publish the relative surprisal index but not its interval bounds"),
    ({"lower": 0.1}, "upper must be set"), ({"lower": -0.1, "upper": 1.0}, "lower must be >= 0"),
    ({"lower": 2.0, "upper": 1.0}, "upper must be >= rsi_s.lower"),
    ({"lower": float("nan"), "upper": 1.0}, "lower must be a finite number"),
    ({"lower": 0.1, "upper": float("inf")}, "upper must be a finite number"),
    ({"lower": "0.1", "upper": 1.0}, "lower must be a finite number"),
    ({"lower": 0.1, "upper": 1.0, "eps_low": 1.5}, "eps_low must be in"),
])
def test_hostile_and_missing_bounds_are_named(params, named):
    with pytest.raises(ValueError, match=named):
        algos.LOSSES.check_params("rsi_s", params)


def test_a_config_without_the_bounds_is_refused_naming_them_unpublished():
    from hapo_openrlhf.config import load_config

    from ..conftest import REPO

    with pytest.raises(ValueError, match="rsi_s: lower and upper must be set"):
        load_config(REPO / "configs" / "cpu_tiny.yaml", ["algorithm.loss=rsi_s", "algorithm.loss_params={}"])
    cfg = load_config(REPO / "configs" / "cpu_tiny.yaml", ["algorithm.loss=rsi_s",
                                                           "algorithm.loss_params={lower: 0.5, upper: null}"])
    assert cfg.algorithm.loss_params == {"lower": 0.5, "upper": None}
