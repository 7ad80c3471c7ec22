"""The fused vocabulary-parallel head (hapo_openrlhf.megatron.head): equal to the logits
path (``algos.vocab_parallel`` over ``hidden @ W^T``) in values and every gradient, at
TP=1 and TP=2, with a padded vocabulary and T != 1, and never creating a [T, V/TP]
tensor in its forward or backward."""

import pytest
import torch
import torch.distributed as dist

from hapo_openrlhf.algos.vocab_parallel import vocab_parallel_logprobs_entropy
from hapo_openrlhf.megatron.head import fused_vocab_parallel_logprobs_entropy

from ..conftest import count_allocations, largest_tensor_numel
from ._dist import spawn

N, H, V, VOCAB = 37, 16, 24, 21  # V rows in the head, the last 3 of them vocabulary padding


def _problem(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, VOCAB, (N,), generator=g)
    w_lp, w_en = torch.randn(N, generator=g, dtype=dtype), torch.randn(N, generator=g, dtype=dtype)
    return h, w, labels, w_lp, w_en


def _grads(fn, h, w, w_lp, w_en):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, en = fn(h, w)
    ((lp * w_lp).sum() + (en * w_en).sum()).backward()
    return lp.detach(), en.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_equals_the_logits_path_on_one_rank(chunk, temperature):
    h, w, labels, w_lp, w_en = _problem()
    kw = dict(vocab_start=0, vocab_size=VOCAB, temperature=temperature, chunk_size=chunk)
    ref = _grads(lambda h, w: vocab_parallel_logprobs_entropy(h @ w.t(), labels, **kw), h, w, w_lp, w_en)
    got = _grads(lambda h, w: fused_vocab_parallel_logprobs_entropy(h, w, labels, **kw), h, w, w_lp, w_en)
    for name, a, b in zip(("logp", "entropy", "hidden grad", "weight grad"), got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=name)
    # the full softmax by hand, and padding rows: out of the distribution, no gradient
    z = (h @ w[:VOCAB].t()) / temperature
    lp_all = torch.log_softmax(z, -1)
    torch.testing.assert_close(got[0].double(), lp_all.gather(-1, labels[:, None]).squeeze(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].double(), -(lp_all.exp() * lp_all).sum(-1), rtol=1e-5, atol=1e-5)
    assert bool((got[3][VOCAB:] == 0).all()) and bool((got[3][:VOCAB] != 0).any())


def test_fused_head_gradient_of_one_output_alone():
    """Only the log-probs, or only the entropy, carry gradient (the other's is None)."""
    h, w, labels, *_ = _problem()
    for pick in (0, 1):
        outs = {}
        for name, fn in (("fused", lambda h, w: fused_vocab_parallel_logprobs_entropy(h, w, labels, vocab_start=0)),
                         ("logits", lambda h, w: vocab_parallel_logprobs_entropy(h @ w.t(), labels, vocab_start=0))):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            fn(hh, ww)[pick].sum().backward()
            outs[name] = (hh.grad, ww.grad)
        for a, b in zip(outs["fused"], outs["logits"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_head_never_creates_a_tokens_by_vocabulary_tensor():
    """Forward + backward: the largest tensor is a [chunk, V] block or the [V, H] weight
    gradient, never [N, V]; and one [V, H] fp32 weight gradient however many chunks."""
    h, w, labels, w_lp, w_en = _problem(torch.float32)
    h, w = h.repeat(4, 1).requires_grad_(), w.requires_grad_()  # N = 148 tokens, 30 chunks
    lab, wl, we = labels.repeat(4), w_lp.repeat(4), w_en.repeat(4)

    def run(fn):
        h.grad = w.grad = None
        lp, en = fn()
        ((lp * wl).sum() + (en * we).sum()).backward()

    fused = lambda: fused_vocab_parallel_logprobs_entropy(h, w, lab, vocab_start=0, vocab_size=VOCAB, chunk_size=5)
    logits = lambda: vocab_parallel_logprobs_entropy(h @ w.t(), lab, vocab_start=0, vocab_size=VOCAB, chunk_size=5)
    n_tv = h.shape[0] * V
    assert largest_tensor_numel(lambda: run(logits)) >= n_tv  # the check sees the logits path's [N, V]
    assert largest_tensor_numel(lambda: run(fused)) <= max(5 * V, V * H, h.numel()) < n_tv
    assert count_allocations(lambda: run(fused), V * H) == 1


def test_fused_head_refuses_bad_shapes_by_name():
    h, w, labels, *_ = _problem()
    with pytest.raises(ValueError, match="labels shape"):
        fused_vocab_parallel_logprobs_entropy(h, w, labels[:-1], vocab_start=0)
    with pytest.raises(ValueError, match=r"weight must be \[Vr, H=16\]"):
        fused_vocab_parallel_logprobs_entropy(h, w[:, :-1], labels, vocab_start=0)
    with pytest.raises(ValueError, match="vocab_size 5"):
        fused_vocab_parallel_logprobs_entropy(h, w, labels, vocab_start=0, vocab_size=5)


def _tp_worker(rank, world, out):
    h, w, labels, w_lp, w_en = _problem()
    Vr = V // world  # rank 1's shard holds the 3 padding rows
    mine = w[rank * Vr:(rank + 1) * Vr]
    kw = dict(vocab_start=rank * Vr, vocab_size=VOCAB, temperature=0.8, chunk_size=6, group=dist.group.WORLD)
    got = _grads(lambda h, w: fused_vocab_parallel_logprobs_entropy(h, w, labels, **kw), h, mine, w_lp, w_en)
    shards = [None] * world
    dist.all_gather_object(shards, [t.clone() for t in got])
    if rank == 0:
        torch.save(shards, out)


def test_fused_head_at_tp2_equals_one_rank(tmp_path):
    """Two gloo ranks, each with half the head (rank 1's half padded): values and the
    hidden gradient (summed over ranks) equal one rank's; the weight gradient's halves are
    the one-rank gradient's halves."""
    out = tmp_path / "tp2.pt"
    spawn(_tp_worker, 2, 2, str(out))
    shards = torch.load(out)
    h, w, labels, w_lp, w_en = _problem()
    ref = _grads(lambda h, w: fused_vocab_parallel_logprobs_entropy(h, w, labels, vocab_start=0, vocab_size=VOCAB,
                                                                   temperature=0.8, chunk_size=6), h, w, w_lp, w_en)
    for r in range(2):
        torch.testing.assert_close(shards[r][0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(shards[r][1], ref[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(shards[r][2], ref[2], rtol=1e-5, atol=1e-5)  # all-reduced over TP
    torch.testing.assert_close(torch.cat([shards[0][3], shards[1][3]]), ref[3], rtol=1e-5, atol=1e-5)
