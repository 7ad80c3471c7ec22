import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hapo_openrlhf.algos.fused import fused_logprobs_entropy


@settings(max_examples=25, deadline=None)
@given(N=st.integers(1, 20), H=st.integers(1, 8), V=st.integers(2, 30), chunk=st.integers(1, 25),
       temp=st.sampled_from([0.6, 1.0, 1.3]), seed=st.integers(0, 999))
def test_fused_values_and_gradients_equal_naive(N, H, V, chunk, temp, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(True)
    lab = torch.randint(0, V, (N,), generator=g)
    a = torch.randn(N, generator=g, dtype=torch.float64)
    b = torch.randn(N, generator=g, dtype=torch.float64)

    lp, ent = fused_logprobs_entropy(h, w, lab, temperature=temp, chunk_size=chunk)
    (lp.double() * a + ent.double() * b).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    # reference: the naive full-logits computation in float64
    logp_all = torch.log_softmax((h @ w.t()) / temp, -1)
    lp0 = logp_all.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    ent0 = -(logp_all.exp() * logp_all).sum(-1)
    (lp0 * a + ent0 * b).sum().backward()
    assert torch.allclose(lp.double(), lp0, atol=1e-4, rtol=1e-5)
    assert torch.allclose(ent.double(), ent0, atol=1e-4, rtol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-3, rtol=1e-4)
    assert torch.allclose(gw, w.grad, atol=1e-3, rtol=1e-4)


def test_fused_batch_shape_and_errors():
    h = torch.randn(2, 3, 4)
    w = torch.randn(7, 4)
    lab = torch.randint(0, 7, (2, 3))
    lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=2)
    assert lp.shape == ent.shape == (2, 3)
    with pytest.raises(ValueError, match="labels shape"):
        fused_logprobs_entropy(h, w, lab[:, :2])
    with pytest.raises(ValueError, match="weight must be"):
        fused_logprobs_entropy(h, torch.randn(7, 5), lab)


def test_fused_never_materialises_more_than_a_chunk_of_logits():
    from ..conftest import largest_tensor_numel

    N, H, V, C = 64, 8, 50, 4
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    lab = torch.randint(0, V, (N,))

    def run():
        lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=C)
        (lp.sum() + ent.sum()).backward()

    # the largest tensor is a chunk of logits or the weight (gradient); never N x V
    assert largest_tensor_numel(run) <= max(C * V, V * H, N * H)
