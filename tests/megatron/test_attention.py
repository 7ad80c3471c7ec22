"""hapo's FlashCoreAttention (the Megatron local spec's core attention): causal, GQA,
packed (THD) and right-padded, equal to an explicit fp64 softmax(QK^T)V reference in
values and gradients; no [S, S] tensor anywhere in a GPTModel forward + backward
(Megatron's own DotProductAttention makes several, which shows the check can fail);
no NaN from padding rows; a mask is refused, not ignored."""

import pytest
import torch

from hapo_openrlhf.megatron.attention import padded_attention, varlen_attention
from tests.conftest import largest_tensor_numel

from ._dist import init_megatron, spawn


def _reference(q, k, v, scale):
    """[S, nq, d], [S, ng, d] -> [S, nq * d]: causal softmax attention in float64."""
    S, nq, d = q.shape
    rep = nq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double()).reshape(S, nq * d)


def _qkv(T, nq=4, ng=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, n, d, generator=g, dtype=torch.float64).requires_grad_() for n in (nq, ng, ng)]


def test_varlen_equals_per_sequence_reference_values_and_grads():
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    q, k, v = _qkv(sum(lengths))
    w = torch.randn(sum(lengths), 32, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu, max(lengths), 0.3)
    (out * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = torch.cat([_reference(q[a:b], k[a:b], v[a:b], 0.3) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, t in zip(got, (q, k, v)):  # no gradient crosses a sequence boundary
        torch.testing.assert_close(a, t.grad, rtol=1e-10, atol=1e-10)


def test_padded_rows_equal_reference_and_padding_makes_no_nan():
    S, B = 7, 3
    lengths = [7, 4, 1]
    q, k, v = (t.detach() for t in _qkv(S * B, seed=1))
    q, k, v = (t.view(S, B, *t.shape[1:]) for t in (q, k, v))  # Megatron's sbhd layout
    out = padded_attention(q, k, v, 0.5)
    assert torch.isfinite(out).all()  # pad positions attend to the row's tokens and themselves
    for b, n in enumerate(lengths):  # each row's real tokens (from position 0) see only themselves
        torch.testing.assert_close(out[:n, b], _reference(q[:n, b], k[:n, b], v[:n, b], 0.5), rtol=1e-10, atol=1e-10)


def _no_square_worker(rank, out):
    from megatron.core.packed_seq_params import PackedSeqParams

    from hapo_openrlhf.megatron.attention import FlashCoreAttention
    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model
    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy

    from .test_convert import tiny_qwen2

    init_megatron()
    cfg = tiny_qwen2(False, layers=2).config
    cfg.max_position_embeddings = 2048
    S = 1024
    ids = torch.randint(0, 259, (2, S))
    am = torch.ones(2, S, dtype=torch.long)
    am[1, :300] = 0
    res = {}
    for attention, layout in (("flash", "thd"), ("flash", "padded"), ("local", "masked")):
        model = build_qwen2_gpt_model(cfg, attention=attention)

        def fwd_bwd():
            lp, en = logprobs_and_entropy(model, ids, am, vocab_size=259, layout=layout)
            (lp.sum() + en.sum()).backward()

        res[layout] = largest_tensor_numel(fwd_bwd)
    core = FlashCoreAttention(model.config, 1, None, "self")
    with pytest.raises(ValueError, match="no attention mask"):
        core(*(torch.zeros(4, 1, 4, 16) for _ in range(3)), torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="THD"):
        core(*(torch.zeros(4, 4, 16) for _ in range(3)), None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    torch.save(res, out)


def test_no_square_tensor_in_a_gptmodel_forward_backward(tmp_path):
    out = tmp_path / "res.pt"
    spawn(_no_square_worker, 1, str(out))
    res = torch.load(out)
    S = 1024
    # the biggest tensors left are [tokens, vocab] logits and [tokens, ffn] activations: O(S)
    assert res["thd"] < S * S and res["padded"] < S * S, res
    assert res["masked"] >= 4 * S * S, res  # Megatron's DotProductAttention: [b * heads, S, S] scores
