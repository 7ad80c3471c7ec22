"""HF Qwen2 / Qwen3 / Llama <-> Megatron GPTModel weight layout, split for TP and PP:
exact round trip (pure tensors; no process group)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hapo_openrlhf.megatron.convert import hf_to_megatron, megatron_to_hf, padded_vocab_size


FAMILIES = ("qwen2", "qwen3", "llama")


def tiny_config(family: str = "qwen2", tied: bool = True, layers: int = 4):
    """A tiny config of each supported family: Qwen3 with head_dim 24 != hidden / heads (16)
    and QK-norm, Llama with llama3 RoPE scaling (factor 8 at theta 5e5: its low frequencies
    are rescaled) and head_dim 24; Qwen2 with its QKV bias."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    if family == "qwen2":
        return Qwen2Config(**common, max_position_embeddings=64)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, max_position_embeddings=64)
    if family == "llama":
        return LlamaConfig(**common, head_dim=24, max_position_embeddings=16384, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0})
    raise ValueError(family)


def tiny_model(family: str = "qwen2", tied: bool = True, layers: int = 4):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied, layers))
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
        for n, p in model.named_parameters():
            if "norm" in n or "bias" in n:
                p.normal_()
    return model


def tiny_qwen2(tied: bool, layers: int = 4) -> Qwen2ForCausalLM:
    return tiny_model("qwen2", tied, layers)


def hf_logprobs_entropy(model, ids, am, temperature):
    """The reference: fp64 next-token log-probs and entropy [B, S-1] of the Hugging Face
    model over the full vocabulary (``model`` is converted to float64 in place)."""
    model = model.double()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1] / temperature
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_exact(family, tied, tp, pp):
    from hapo_openrlhf.megatron.convert import hf_shapes

    model = tiny_model(family, tied)
    hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    # the streamed sync's name/shape list is the family's own state dict, in order
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_shapes(model.config)
    shards = {(s, r): hf_to_megatron(hf, model.config, tp=tp, tp_rank=r, pp=pp, pp_rank=s)
              for s in range(pp) for r in range(tp)}
    back = megatron_to_hf(shards, model.config, tp=tp, pp=pp)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    # stage contents: embedding on the first stage, head and final norm on the last
    V = padded_vocab_size(259, tp)
    assert shards[(0, 0)]["embedding.word_embeddings.weight"].shape == (V // tp, 64)
    assert ("output_layer.weight" in shards[(pp - 1, 0)]) == (not tied or pp > 1)
    assert "decoder.final_layernorm.weight" not in shards[(0, 0)] or pp == 1
    assert sum(k.endswith("linear_fc2.weight") for k in shards[(0, 0)]) == 4 // pp
    layer0 = {k for k in shards[(0, 0)] if k.startswith("decoder.layers.0.")}
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in layer0) == (family == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in layer0) == (family == "qwen3")
    if family != "qwen2":  # head_dim 24: [heads * 24] rows per rank, not hidden / heads = 16
        assert shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 24 // tp, 64)


def test_qkv_is_fused_per_query_group():
    """Megatron's fused QKV rows: for each KV head, its query heads, then k, then v; TP rank r
    holds whole groups."""
    model = tiny_qwen2(True, layers=1)
    hf = model.state_dict()
    d = 16
    m0 = hf_to_megatron(hf, model.config, tp=2, tp_rank=1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    # rank 1 holds KV group 1: query heads 2 and 3, then k head 1, then v head 1
    assert torch.equal(m0, torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))


def test_layout_errors_are_named():
    model = tiny_qwen2(True)
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not divisible by tensor parallel size 4"):
        hf_to_megatron(model.state_dict(), model.config, tp=4)
    with pytest.raises(ValueError, match="num_hidden_layers 4 is not divisible by pipeline parallel size 3"):
        hf_to_megatron(model.state_dict(), model.config, pp=3)
    with pytest.raises(ValueError, match=r"missing shards \(pp_rank, tp_rank\) \[\(0, 1\)\]"):
        megatron_to_hf({(0, 0): {}}, model.config, tp=2, pp=1)
