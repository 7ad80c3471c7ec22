import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hapo_openrlhf.algos import check_finite, entropy_from_logits, logprobs_and_entropy, logprobs_from_logits


def naive(logits, labels, T=1.0):
    z = logits.float() / T
    logp_all = torch.log_softmax(z, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1), ent


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 3), T=st.integers(1, 9), V=st.integers(2, 40),
    chunk=st.integers(1, 50), temp=st.sampled_from([0.6, 1.0, 1.7]), seed=st.integers(0, 1000),
)
def test_chunked_equals_naive(B, T, V, chunk, temp, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 4
    labels = torch.randint(0, V, (B, T), generator=g)
    lp, ent = logprobs_and_entropy(logits, labels, chunk_size=chunk, temperature=temp)
    lp0, ent0 = naive(logits, labels, temp)
    assert torch.allclose(lp, lp0, atol=1e-5)
    assert torch.allclose(ent, ent0, atol=1e-5)
    assert torch.allclose(entropy_from_logits(logits, chunk_size=chunk, temperature=temp), ent0, atol=1e-5)


def test_entropy_hand_values():
    # uniform over 4 -> log 4; one-hot-ish -> ~0; temperature 2 on [0, log 3]: p = (1, sqrt3)/(1+sqrt3)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    ent = entropy_from_logits(logits, chunk_size=1)
    assert ent[0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)
    z = torch.tensor([[0.0, math.log(3.0)]])
    p = torch.tensor([1.0, math.sqrt(3.0)]) / (1 + math.sqrt(3.0))
    assert entropy_from_logits(z, temperature=2.0).item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


def test_bf16_logits_computed_in_fp32():
    logits = (torch.randn(2, 5, 30) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 30, (2, 5))
    lp, ent = logprobs_and_entropy(logits, labels, chunk_size=3)
    lp0, ent0 = naive(logits.float(), labels)
    assert lp.dtype == torch.float32 and torch.allclose(lp, lp0, atol=1e-5) and torch.allclose(ent, ent0, atol=1e-5)


def test_gradients_match_naive_through_checkpointed_chunks():
    logits = torch.randn(2, 7, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7))
    w = torch.randn(2, 7)
    lp, ent = logprobs_and_entropy(logits, labels, chunk_size=4, temperature=0.7)
    (lp * w + ent * w.flip(0)).sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    lp0, ent0 = naive(logits, labels, 0.7)
    (lp0 * w + ent0 * w.flip(0)).sum().backward()
    assert torch.allclose(g, logits.grad, atol=1e-5)


def test_logprobs_only_api_and_errors():
    logits = torch.randn(3, 6)
    labels = torch.tensor([0, 5, 2])
    assert torch.allclose(logprobs_from_logits(logits, labels), torch.log_softmax(logits, -1)[range(3), labels])
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_and_entropy(logits, labels[:2])
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


def test_check_finite_names_the_tensor_and_respects_mask():
    x = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    check_finite("logits", x, torch.tensor([[1, 0], [1, 1]]))  # NaN is masked out
    with pytest.raises(FloatingPointError, match="non-finite logits: 1 of 4"):
        check_finite("logits", x)


def test_no_fp32_tensor_larger_than_one_chunk_is_created():
    """Every fp32 tensor an op produces stays within chunk x V (bf16 logits of 64 x 50)."""
    from ..conftest import largest_tensor_numel

    logits = torch.randn(4, 16, 50).to(torch.bfloat16)
    labels = torch.randint(0, 50, (4, 16))
    biggest = largest_tensor_numel(lambda: logprobs_and_entropy(logits, labels, chunk_size=8, temperature=0.9),
                                   dtype=torch.float32)
    assert 0 < biggest <= 8 * 50
