"""Vocab-parallel log-probs and entropy == the full-vocabulary computation (values and
gradients), in one process and across 2 gloo ranks holding uneven vocabulary shards."""

import pytest
import torch

from hapo_openrlhf.algos.vocab_parallel import vocab_parallel_logprobs_entropy
from tests.megatron._dist import spawn

N, V, T = 37, 11, 0.7  # V = 11 splits 6 + 5 across two ranks; chunk 8 does not divide N


def _reference(logits, labels, temperature):
    z = logits.double() / temperature
    logp_all = torch.log_softmax(z, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1), ent


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 3
    labels = torch.randint(0, V, (N,), generator=g)
    w_lp, w_en = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return logits, labels, w_lp, w_en


def _check_shard(logits, labels, w_lp, w_en, start, stop, group=None, chunk=8, pad=0):
    """This rank's shard [start, stop) of the vocabulary, plus ``pad`` padding columns past
    V on the last shard (filled with a huge logit that must be ignored)."""
    ref_in = logits.clone().double().requires_grad_(True)
    ref_lp, ref_en = _reference(ref_in, labels, T)
    ((ref_lp * w_lp.double()).sum() + (ref_en * w_en.double()).sum()).backward()
    shard = logits[:, start:stop]
    if pad and stop == V:
        shard = torch.cat([shard, torch.full((N, pad), 100.0)], -1)
    shard = shard.clone().requires_grad_(True)
    lp, en = vocab_parallel_logprobs_entropy(shard, labels, vocab_start=start, vocab_size=V if pad else None,
                                             group=group, temperature=T, chunk_size=chunk)
    ((lp * w_lp).sum() + (en * w_en).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(en.double(), ref_en.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shard.grad[:, : stop - start].double(), ref_in.grad[:, start:stop], rtol=1e-4, atol=1e-5)
    assert not shard.grad[:, stop - start:].any()  # padding columns get no gradient


def test_single_process_equals_full_vocabulary():
    logits, labels, w_lp, w_en = _case()
    _check_shard(logits, labels, w_lp, w_en, 0, V)
    _check_shard(logits, labels, w_lp, w_en, 0, V, pad=5)  # padded vocabulary
    # leading dims are kept
    lp, en = vocab_parallel_logprobs_entropy(logits.reshape(1, N, V), labels.reshape(1, N), vocab_start=0)
    assert lp.shape == en.shape == (1, N) and lp.dtype == torch.float32


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="disagree on the token dims"):
        vocab_parallel_logprobs_entropy(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long), vocab_start=0)
    with pytest.raises(ValueError, match="vocab_size 4"):
        vocab_parallel_logprobs_entropy(torch.zeros(3, 5), torch.full((3,), 4), vocab_start=0, vocab_size=4)


def _worker(rank):
    logits, labels, w_lp, w_en = _case()
    bounds = [0, 6, V]
    _check_shard(logits, labels, w_lp, w_en, bounds[rank], bounds[rank + 1])
    _check_shard(logits, labels, w_lp, w_en, bounds[rank], bounds[rank + 1], pad=1)  # 12 = 6 + 6, one padding id
    # a rank whose whole shard is padding
    _check_shard(logits, labels, w_lp, w_en, *((0, V) if rank == 0 else (V, V)), pad=3 * rank)
    # bf16 shards: fp32 accumulation, still close to the fp64 reference
    lp, en = vocab_parallel_logprobs_entropy(logits[:, bounds[rank]:bounds[rank + 1]].bfloat16(), labels,
                                             vocab_start=bounds[rank], temperature=T, chunk_size=5)
    ref_lp, ref_en = _reference(logits.bfloat16().float(), labels, T)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(en.double(), ref_en, rtol=1e-4, atol=1e-4)


def test_two_gloo_ranks_equal_full_vocabulary():
    spawn(_worker, 2)
