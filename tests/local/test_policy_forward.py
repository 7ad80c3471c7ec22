"""The embedded trainer's scoring forward: fused LM head == full logits, packed == padded,
values and gradients, on a random tiny Qwen2 with both CPU attention kernels."""

import pytest
import torch

from hapo_openrlhf.generation.rollout import Rollout
from hapo_openrlhf.local.forward import policy_forward


def _model(attn: str, tie: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, attn_implementation=attn)
    return Qwen2ForCausalLM(cfg).float()


def _rollout(seed=1) -> Rollout:
    """Left-padded prompts of 3..6 tokens, right-padded responses of 2..7 tokens."""
    g = torch.Generator().manual_seed(seed)
    P, R = 6, 7
    plens, rlens = [6, 3, 5, 4], [7, 2, 5, 3]
    seq = torch.zeros(4, P + R, dtype=torch.long)
    attn = torch.zeros_like(seq)
    rmask = torch.zeros(4, R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(plens, rlens)):
        seq[b, P - p : P + r] = torch.randint(2, 97, (p + r,), generator=g)
        attn[b, P - p : P + r] = 1
        rmask[b, :r] = 1
    return Rollout(seq, attn, rmask, P, ["x"] * 4, torch.zeros(4, dtype=torch.bool))


def _run(model, ro, **kw):
    model.zero_grad(set_to_none=True)
    logp, ent = policy_forward(model, ro, temperature=0.7, chunk_size=5, with_entropy_grad=True, **kw)
    g_a = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2))
    (logp * g_a + ent * 0.3).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), grads


def _close(a, b):
    la, ea, ga = a
    lb, eb, gb = b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ea, eb, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tie", [True, False])
def test_fused_head_equals_full_logits(attn, tie):
    model, ro = _model(attn, tie), _rollout()
    _close(_run(model, ro, fused=True), _run(model, ro, fused=False))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fused", [True, False])
def test_packed_equals_padded(attn, fused):
    model, ro = _model(attn), _rollout()
    padded = _run(model, ro, fused=fused, packing=False)
    packed = _run(model, ro, fused=fused, packing=True)
    _close(packed, padded)
    # padding positions stay exactly zero
    assert (packed[0][ro.response_mask_BR == 0] == 0).all() and (packed[1][ro.response_mask_BR == 0] == 0).all()


def test_packed_rows_do_not_attend_to_each_other():
    """Changing every token of row 0 leaves the other rows' packed outputs unchanged."""
    model, ro = _model("sdpa"), _rollout()
    with torch.no_grad():
        base = policy_forward(model, ro, temperature=1.0, chunk_size=8, packing=True)
        seq = ro.sequences_BL.clone()
        seq[0][ro.attention_mask_BL[0].bool()] = (seq[0][ro.attention_mask_BL[0].bool()] + 7) % 95 + 2
        other = Rollout(seq, ro.attention_mask_BL, ro.response_mask_BR, ro.prompt_len, ro.responses, ro.truncated_B)
        moved = policy_forward(model, other, temperature=1.0, chunk_size=8, packing=True)
    assert not torch.allclose(base[0][0], moved[0][0])
    torch.testing.assert_close(base[0][1:], moved[0][1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(base[1][1:], moved[1][1:], rtol=0, atol=1e-6)


def test_fused_head_rejects_a_biased_output_layer():
    model, ro = _model("sdpa", tie=False), _rollout()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(97))
    with pytest.raises(ValueError, match="output layer has a bias"):
        policy_forward(model, ro, temperature=1.0, chunk_size=8)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_family_builds_that_architecture(family):
    """``model.family`` picks the tiny model's Hugging Face architecture (the Megatron e2e test
    trains a Qwen3): head_dim = hidden / heads, Qwen3's QK-norm, no QKV bias outside Qwen2."""
    from dataclasses import replace

    from hapo_openrlhf.config import ModelConfig
    from hapo_openrlhf.local.model import build_model, build_tokenizer

    model = build_model(replace(ModelConfig(), family=family), build_tokenizer(), seed=0)
    assert model.config.model_type == family and model.config.head_dim == 128 // 4
    names = {n for n, _ in model.named_parameters()}
    assert any("q_norm" in n for n in names) == (family == "qwen3")
    assert not any(n.endswith("q_proj.bias") for n in names)
