import pytest
import torch

from hapo_openrlhf.algos import (
    DynamicSamplingBuffer,
    entropy_cut,
    entropy_threshold,
    informative_groups,
    normalize_quadrants,
    overlong_penalty,
    quadrant_entropy_change,
    quadrant_masks,
    quadrant_metrics,
)


def test_quadrant_metrics_hand_computed():
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ent = torch.tensor([[0.1, 0.9, 0.2, 5.0], [0.8, 0.3, 7.0, 7.0], [0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
    m = quadrant_metrics(adv, ent, mask, threshold=0.5)
    assert m["quadrant/PHR/token_frac"] == pytest.approx(1 / 7)
    assert m["quadrant/PLR/token_frac"] == pytest.approx(2 / 7)
    assert m["quadrant/NHR/token_frac"] == pytest.approx(1 / 7)
    assert m["quadrant/NLR/token_frac"] == pytest.approx(1 / 7)
    assert m["quadrant/zero_adv_frac"] == pytest.approx(2 / 7)
    assert m["quadrant/PLR/entropy_mean"] == pytest.approx(0.15)
    assert m["quadrant/NHR/adv_abs_sum"] == pytest.approx(2.0)
    assert m["quadrant/PLR/adv_abs_mean"] == pytest.approx(1.0)


def test_quadrant_metrics_group_mean_cut_and_outcome_polarity():
    # two groups; cut = each group's mean token entropy ([B,1]); polarity = outcome, so the
    # all-correct group 1 (A = 0) still has quadrants but no |A|
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    ent = torch.tensor([[0.2, 1.0, 9.0], [0.6, 0.2, 0.0], [2.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    m = quadrant_metrics(adv, ent, mask, entropy_cut(ent, mask, torch.tensor([0, 0, 1])),
                         polarity=torch.tensor([1.0, -1.0, 1.0]))
    # group 0 valid H: 0.2 1.0 0.6 0.2 0.0 -> mu 0.4; group 1: 2, 4 -> mu 3
    assert m["quadrant/PHR/token_frac"] == pytest.approx(2 / 7)  # 1.0 (row 0) and 4.0 (row 2)
    assert m["quadrant/PLR/token_frac"] == pytest.approx(2 / 7)  # 0.2 (row 0) and 2.0 (row 2)
    assert m["quadrant/NHR/token_frac"] == pytest.approx(1 / 7)  # 0.6
    assert m["quadrant/NLR/token_frac"] == pytest.approx(2 / 7)  # 0.2, 0.0
    assert m["quadrant/high_frac"] == pytest.approx(3 / 7)
    assert m["quadrant/zero_adv_frac"] == pytest.approx(2 / 7)
    assert m["quadrant/PHR/adv_abs_sum"] == pytest.approx(1.0)  # row 2's token has |A| = 0
    assert m["quadrant/threshold"] == pytest.approx((0.4 + 0.4 + 3) / 3)


def test_threshold_quantile_selects_top_share():
    ent = torch.arange(10, dtype=torch.float32).view(2, 5)
    mask = torch.ones(2, 5)
    tau = entropy_threshold(ent, mask, quantile=0.8)
    assert tau.item() == 8.0 and int((ent >= tau).sum()) == 2
    assert entropy_threshold(ent, mask, value=3.5).item() == 3.5
    assert entropy_threshold(ent, torch.zeros(2, 5)).item() == float("inf")
    with pytest.raises(ValueError):
        entropy_threshold(ent, mask, quantile=1.5)


def test_entropy_change_per_quadrant():
    pol = torch.tensor([1.0, -1.0])
    ent = torch.tensor([[0.1, 0.9], [0.2, 0.8]])
    masks = quadrant_masks(pol, ent, torch.ones(2, 2), torch.tensor(0.5))
    d = quadrant_entropy_change(masks, ent, ent + torch.tensor([[0.1, -0.2], [0.3, 0.4]]))
    assert d["quadrant/PLR/entropy_delta"] == pytest.approx(0.1)
    assert d["quadrant/PHR/entropy_delta"] == pytest.approx(-0.2)
    assert d["quadrant/NLR/entropy_delta"] == pytest.approx(0.3)
    assert d["quadrant/NHR/entropy_delta"] == pytest.approx(0.4)


def test_normalize_quadrants():
    assert normalize_quadrants("phr") == ("PHR",)
    assert normalize_quadrants(["all"]) == ("PHR", "PLR", "NHR", "NLR")
    with pytest.raises(ValueError, match="unknown quadrant 'XYZ'"):
        normalize_quadrants(["xyz"])


def test_informative_groups_and_overlong():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    assert informative_groups(r, g).tolist() == [False, False, True, True, False, False]
    pen = overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_len=16, cache_len=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), 4, 8)


def test_dynamic_sampling_buffer_refills_and_counts():
    buf = DynamicSamplingBuffer(target_groups=3, max_rounds=5)
    buf.add(["a", "b"], [True, False])
    assert not buf.ready
    buf.add(["c", "d", "e"], [True, True, False])
    assert buf.ready
    assert buf.take() == ["a", "c", "d"]
    assert buf.metrics() == {"dapo/gen_rounds": 2.0, "dapo/dropped_group_frac": pytest.approx(2 / 5)}
