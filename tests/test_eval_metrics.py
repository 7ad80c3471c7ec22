import itertools
from math import comb

import pytest

from hapo_openrlhf.eval import avg_at_k, pass_at_k, summarize_samples


def test_pass_at_k_matches_combinatorial_definition_exhaustively():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # fraction of size-k subsets of n samples that contain a correct one
                samples = [1] * c + [0] * (n - c)
                hits = sum(any(s) for s in itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(hits / comb(n, k), abs=1e-12)


def test_pass_at_k_stable_for_large_n():
    assert pass_at_k(256, 1, 1) == pytest.approx(1 / 256)
    assert pass_at_k(256, 0, 32) == 0.0
    assert pass_at_k(256, 3, 32) == pytest.approx(1 - comb(253, 32) / comb(256, 32), rel=1e-12)
    assert 0.0 <= pass_at_k(256, 128, 128) <= 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_avg_and_summary():
    scores = [[1, 0, 0, 0], [1, 1, 1, 1]]
    assert avg_at_k(scores) == pytest.approx(0.625)
    assert summarize_samples(scores) == {"avg@4": 0.625, "pass@4": 1.0}


def test_avg_counts_correct_with_minus_one_rewards():
    assert avg_at_k([[1.0, -1.0], [-1.0, -1.0]]) == pytest.approx(0.25)
