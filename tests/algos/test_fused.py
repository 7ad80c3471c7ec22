import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hapo_openrlhf.algos.fused import fused_logprobs_entropy, fused_token_loss


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


@pytest.mark.parametrize("form", ["recompute", "forward_gradient"])
def test_fused_backward_allocates_one_weight_gradient_however_many_chunks(form):
    """The [V,H] weight gradient is accumulated in place (addmm_ / addmm out=): a fused
    backward allocates exactly one [V,H] buffer whether it runs 2 chunks or 16. A
    temporary per chunk (gz^T h, then add_) would be +1 GB per chunk at V=152k, H=1536."""
    from ..conftest import count_allocations

    N, H, V = 64, 12, 50  # V*H = 600: no other tensor here has that many elements
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    lab = torch.randint(0, V, (N,))

    def run(chunk):
        def fn():
            h.grad = w.grad = None
            if form == "recompute":
                lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=chunk)
                (lp.sum() - 0.1 * ent.sum()).backward()
            else:
                loss, _, _ = fused_token_loss(h, w, lab, lambda lp, ent, sl: -(lp.sum() + 0.1 * ent.sum()),
                                              chunk_size=chunk)
                loss.backward()
        n = count_allocations(fn, V * H)
        return n, w.grad.clone()

    (n2, g2), (n16, g16) = run(32), run(4)
    assert n2 == n16 == 1, (n2, n16)
    torch.testing.assert_close(g16, g2, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 4), R=st.integers(1, 6), rows=st.integers(1, 3), temp=st.sampled_from([0.7, 1.0]),
       beta=st.sampled_from([0.0, 0.05]), agg=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
       seed=st.integers(0, 999))
def test_fused_token_loss_equals_registry_loss_on_full_logits(B, R, rows, temp, beta, agg, seed):
    """PPO-clip (+ EntroReg) through the forward-gradient head == the registry loss on naive logits."""
    from hapo_openrlhf.algos import compute_policy_loss

    g = torch.Generator().manual_seed(seed)
    H, V = 5, 11
    h = torch.randn(B, R, H, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(True)
    lab = torch.randint(0, V, (B, R), generator=g)
    old = torch.randn(B, R, generator=g, dtype=torch.float64) * 0.3 - 2.5
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, R, generator=g) < 0.8).long()
    mask[:, 0] = 1
    name, params = ("entro_reg", {"beta": beta}) if beta else ("ppo", {})

    def loss_of(lp, ent, sl):  # whole rows per chunk: the per-row aggregation stays exact
        r = slice(sl.start // R, sl.stop // R)
        return compute_policy_loss(name, lp.view(-1, R).double(), old[r], adv[r], mask[r], aggregation=agg,
                                   normalizer=float(mask.sum() if agg == "token-mean" else B),
                                   entropy=ent.view(-1, R).double(), **params)[0]

    loss, lp, ent = fused_token_loss(h, w, lab, loss_of, temperature=temp, chunk_size=rows * R)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logp_all = torch.log_softmax((h @ w.t()) / temp, -1)
    lp0 = logp_all.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    ent0 = -(logp_all.exp() * logp_all).sum(-1)
    loss0 = compute_policy_loss(name, lp0, old, adv, mask, aggregation=agg, entropy=ent0, **params)[0]
    loss0.backward()
    assert torch.allclose(loss.double(), loss0, atol=1e-5, rtol=1e-5)
    assert torch.allclose(lp.double(), lp0.detach(), atol=1e-5) and torch.allclose(ent.double(), ent0.detach(), atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-4, rtol=1e-4)
    assert torch.allclose(gw, w.grad, atol=1e-4, rtol=1e-4)


def test_fused_token_loss_backward_scales_by_the_upstream_gradient():
    torch.manual_seed(0)
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    lab = torch.randint(0, 9, (6,))
    loss, _, _ = fused_token_loss(h, w, lab, lambda lp, ent, sl: -(lp * 2 + ent).sum(), chunk_size=4)
    (3.0 * loss).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=4)
    (3.0 * -(lp * 2 + ent).sum()).backward()
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gw, w.grad)


def test_bf16_weights_match_the_models_own_bf16_head():
    """The chunk matmul runs in the weight's dtype (like the model's head), the softmax in fp32."""
    torch.manual_seed(0)
    h = torch.randn(10, 16).bfloat16()
    w = (torch.randn(50, 16) * 0.3).bfloat16().requires_grad_(True)
    lab = torch.randint(0, 50, (10,))
    lp, ent = fused_logprobs_entropy(h, w, lab, temperature=0.6, chunk_size=3)
    logp_all = torch.log_softmax((h @ w.t()).float() / 0.6, -1)
    torch.testing.assert_close(lp, logp_all.gather(-1, lab[:, None]).squeeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, -(logp_all.exp() * logp_all).sum(-1), atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    assert w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad.float()).all()


def test_weight_grad_gemm_fp32_on_cpu_and_bf16_error_bound():
    """The LM-head weight gradient: fp32 on CPU (the reference path); on CUDA with bf16
    weights a bf16 GEMM with fp32 accumulation and output. Its error is that of rounding
    gz and h to bf16 before an exact fp32-accumulated product, emulated here, and bounded
    over a 16-chunk accumulation like the head's backward (the GPU smoke runs the real one)."""
    from hapo_openrlhf.algos.fused import weight_grad_gemm

    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(256, 512, generator=g) * 1e-3, torch.randn(256, 64, generator=g)) for _ in range(16)]
    ref = sum(gz.double().t() @ h.double() for gz, h in chunks)
    cpu = sum(weight_grad_gemm(gz, h, torch.bfloat16) for gz, h in chunks)
    assert cpu.dtype == torch.float32
    assert float((cpu.double() - ref).norm() / ref.norm()) < 1e-6  # CPU: fp32, whatever the weight dtype
    bf16 = sum(gz.bfloat16().float().t() @ h.bfloat16().float() for gz, h in chunks)  # = cuBLAS bf16 in, fp32 acc/out
    rel = float((bf16.double() - ref).norm() / ref.norm())
    assert 1e-5 < rel < 1e-2, rel  # bf16 inputs: ~2^-9 per element, averaged down over the sums
