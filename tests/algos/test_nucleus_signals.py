"""PAEC's per-position signals (``algos.nucleus.sharded_nucleus_stats``): the nucleus
entropy and the top-two log-probability gap, against a hand-computed row, against the
naive full-vocabulary computation (the nucleus by the sort rule, ``nucleus_logprobs``), over
two gloo ranks holding vocabulary shards (equal to one process), in the fused form from
hidden states, and without a [N, V] tensor."""

import math

import pytest
import torch

from hapo_openrlhf.algos.nucleus import nucleus_logprobs, sharded_nucleus_stats

from ..conftest import largest_tensor_numel


def naive(z: torch.Tensor, top_p: float):
    lp = nucleus_logprobs(z, top_p)
    ent = -(lp.exp() * torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))).sum(-1)
    top = torch.log_softmax(z.double(), -1).topk(2, -1).values
    return ent, (top[:, 0] - top[:, 1]).float()


def test_hand_computed_row():
    # p = 0.5, 0.3, 0.15, 0.05; top-p 0.8 keeps {0.5, 0.3}: q = 5/8, 3/8
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    st = sharded_nucleus_stats(z, 0.8, entropy=True, top2_gap=True)
    want = -(5 / 8 * math.log(5 / 8) + 3 / 8 * math.log(3 / 8))
    assert float(st.entropy) == pytest.approx(want, abs=1e-6)
    assert float(st.top2_gap) == pytest.approx(math.log(0.5 / 0.3), abs=1e-6)
    assert float(st.logmass) == pytest.approx(math.log(0.8), abs=1e-6)
    # top-p 1: the full entropy; a tiny top-p: one token, entropy 0
    full = -sum(p * math.log(p) for p in (0.5, 0.3, 0.15, 0.05))
    assert float(sharded_nucleus_stats(z, 1.0, entropy=True).entropy) == pytest.approx(full, abs=1e-6)
    assert float(sharded_nucleus_stats(z, 1e-6, entropy=True).entropy) == pytest.approx(0.0, abs=1e-6)
    # nothing asked: no entropy or gap computed
    st = sharded_nucleus_stats(z, 0.8)
    assert st.entropy is None and st.top2_gap is None


def _rows(seed=0, n=41, v=37):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 2.5
    z[0] = 1.0  # every token tied: gap 0, nucleus cut by count
    z[1, 3] = z[1, 9] = z[1].max() + 1  # the top two tied
    z[2, 7] = 40.0  # one-hot in float32: entropy 0 at every top-p
    z[3] = z[3].to(torch.bfloat16).float()  # bf16-rounded: ties below the top
    return z


# top_k: 0 sorts every row; 3 reads a nucleus of at most 3 tokens from the top and sorts the other
# rows (both in one chunk); 64 holds this vocabulary whole (issue 61)
TOP_KS = [0, 3, 64]


@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.6, 0.95, 1.0])
def test_one_process_equals_the_naive_computation(top_p, top_k):
    z, T = _rows(), 0.7
    want_ent, want_gap = naive(z / T, top_p)
    st = sharded_nucleus_stats(z, top_p, temperature=T, chunk_size=6, entropy=True, top2_gap=True, top_k=top_k)
    torch.testing.assert_close(st.entropy, want_ent, rtol=0, atol=2e-6)
    torch.testing.assert_close(st.top2_gap, want_gap, rtol=0, atol=2e-6)
    assert float(st.top2_gap[0]) == 0.0 and float(st.top2_gap[1]) == 0.0 and float(st.entropy[2]) < 1e-6
    assert bool((st.entropy >= 0).all()) and bool((st.entropy <= math.log(z.shape[1]) + 1e-6).all())


@pytest.mark.parametrize("top_k", TOP_KS)
def test_fused_form_equals_the_logits_form_and_stays_chunk_sized(top_k):
    g = torch.Generator().manual_seed(2)
    N, H, V = 96, 8, 211
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    padded = torch.cat([weight, torch.full((5, H), 30.0)])  # vocabulary padding rows, never counted
    want_ent, want_gap = naive(hidden @ weight.t() / 0.8, 0.9)
    run = lambda: sharded_nucleus_stats(hidden, 0.9, weight=padded, n_valid=V, temperature=0.8,  # noqa: E731
                                        chunk_size=16, entropy=True, top2_gap=True, top_k=top_k)
    st = run()
    torch.testing.assert_close(st.entropy, want_ent, rtol=0, atol=2e-6)
    torch.testing.assert_close(st.top2_gap, want_gap, rtol=0, atol=2e-6)
    # the largest tensor is a chunk's [16, V + pad] (the sort's index block at most), never [N, V]
    assert largest_tensor_numel(run) <= 16 * padded.shape[0] < N * V


def test_a_one_token_vocabulary_has_an_infinite_gap():
    st = sharded_nucleus_stats(torch.zeros(3, 1), 0.9, entropy=True, top2_gap=True)
    assert bool(torch.isinf(st.top2_gap).all()) and not st.entropy.any()


def _tp_worker(rank):
    group = torch.distributed.group.WORLD
    z, T = _rows(), 0.7
    bounds = [0, 15, z.shape[1]]
    lo, hi = bounds[rank], bounds[rank + 1]
    for top_p, top_k in ((p, k) for p in (1e-6, 0.5, 0.95, 1.0) for k in TOP_KS):
        one = sharded_nucleus_stats(z, top_p, temperature=T, entropy=True, top2_gap=True, top_k=0)
        got = sharded_nucleus_stats(z[:, lo:hi], top_p, temperature=T, chunk_size=7, group=group,
                                    entropy=True, top2_gap=True, top_k=top_k)
        torch.testing.assert_close(got.entropy, one.entropy, rtol=0, atol=2e-6)
        torch.testing.assert_close(got.top2_gap, one.top2_gap, rtol=0, atol=1e-6)
    # the top two on different ranks, and both on one rank
    row = torch.full((2, 6), -3.0)
    row[0, 1], row[0, 4] = 2.0, 1.0  # rank 0 holds the first, rank 1 the second (columns 0-2 | 3-5)
    row[1, 3], row[1, 5] = 2.0, 2.0  # rank 1 holds both, tied: gap 0
    got = sharded_nucleus_stats(row[:, 3 * rank:3 * rank + 3], 1.0, group=group, top2_gap=True).top2_gap
    assert got.tolist() == [1.0, 0.0]
    # a rank whose whole shard is padding
    w = z if rank == 0 else torch.zeros(z.shape[0], 4)
    one = sharded_nucleus_stats(z, 0.9, entropy=True, top2_gap=True, top_k=0)
    for top_k in TOP_KS:
        got = sharded_nucleus_stats(w, 0.9, n_valid=z.shape[1] if rank == 0 else 0, group=group,
                                    entropy=True, top2_gap=True, top_k=top_k)
        torch.testing.assert_close(got.entropy, one.entropy, rtol=0, atol=2e-6)
        torch.testing.assert_close(got.top2_gap, one.top2_gap, rtol=0, atol=0)


def test_two_gloo_ranks_holding_vocabulary_shards_equal_one_process():
    from tests.megatron._dist import spawn

    spawn(_tp_worker, 2)
