"""YaRN RoPE scaling on the Megatron actor (issue 58's 128k config: Qwen3-8B extended from 32,768 to
131,072 positions as its model card gives it): megatron-core's ``YarnRotaryEmbedding`` built from a
Hugging Face YaRN config equals transformers' own (``_compute_yarn_parameters``) -- the frequencies,
the attention factor on cos and sin, and so the model's log-probs, entropy and gradients -- on
sequences past the original context, packed (THD) and right-aligned; and what megatron-core cannot
reproduce is refused by name."""

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise RuntimeError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed")
    pytest.skip("megatron-core not installed (the megatron extra)", allow_module_level=True)

from tests.megatron._dist import init_megatron, load_hf_into, spawn  # noqa: E402

T = 0.7
# a tiny Qwen3 whose original context is 16 positions, stretched 4x: the batch's 40 tokens go past it,
# and the correction range (beta 32 / 1 rotations in 16 positions) falls inside head_dim 24's 12 frequencies
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}


def _tiny_yarn(rope=None):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                      rms_norm_eps=1e-6, max_position_embeddings=64, rope_parameters=dict(rope or YARN))
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_()
    return model


def _yarn_worker(rank, out):
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy
    from tests.megatron.test_convert import hf_logprobs_entropy

    init_megatron()
    results = {}
    for name, rope in (("factor", YARN), ("mscale", {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0,
                                                     "beta_fast": 16.0, "truncate": False})):
        hf = _tiny_yarn(rope)
        model = build_gpt_model(hf.config, head="fused")
        load_hf_into(model, hf)
        emb, mscale = model.rotary_pos_emb.get_emb(2)
        results[name] = {"inv_freq": emb[1, 0, 0, :12].double(), "mscale": float(mscale),
                         "hf_inv_freq": hf.model.rotary_emb.inv_freq.double(),
                         "hf_scaling": float(hf.model.rotary_emb.attention_scaling)}
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 259, (2, 40), generator=g)
        am = torch.ones(2, 40, dtype=torch.long)
        am[1, :9] = 0  # left padding: the second row's positions start at 0 after it
        want_lp, want_en = hf_logprobs_entropy(hf, ids, am, T)
        valid = (am[:, :-1] * am[:, 1:]).bool()
        for layout in ("thd", "padded"):
            lp, en = logprobs_and_entropy(model, ids, am, vocab_size=259, temperature=T, chunk_size=7, layout=layout)
            results[name][layout] = (float((lp.double() - want_lp)[valid].abs().max()),
                                     float((en.double() - want_en)[valid].abs().max()))
    torch.save(results, out)


def test_megatron_yarn_equals_transformers(tmp_path):
    spawn(_yarn_worker, 1, str(tmp_path / "yarn.pt"))
    got = torch.load(tmp_path / "yarn.pt")
    for name, r in got.items():
        torch.testing.assert_close(r["inv_freq"], r["hf_inv_freq"], rtol=1e-6, atol=0, msg=name)
        assert r["mscale"] == pytest.approx(r["hf_scaling"], rel=1e-12), name
        for layout in ("thd", "padded"):
            lp_err, en_err = r[layout]
            assert lp_err < 2e-5 and en_err < 2e-5, (name, layout, r[layout])
    # the settings changed something: YaRN's frequencies are not plain RoPE's, nor the two cases' alike
    plain = 1.0 / 10000.0 ** (torch.arange(0, 24, 2, dtype=torch.float64) / 24)
    assert not torch.allclose(got["factor"]["inv_freq"], plain) and got["factor"]["mscale"] == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert got["mscale"]["mscale"] != got["factor"]["mscale"]
    assert not torch.allclose(got["mscale"]["inv_freq"], got["factor"]["inv_freq"])


@pytest.mark.parametrize("rope, problem", [
    ({**YARN, "attention_factor": 1.5}, "explicit attention_factor 1.5"),
    ({k: v for k, v in YARN.items() if k != "original_max_position_embeddings"}, "without original_max_position"),
    ({**YARN, "rope_type": "dynamic"}, "RoPE scaling 'dynamic' (supported: none, yarn, or llama3 on llama)"),
])
def test_yarn_megatron_cannot_reproduce_is_refused_by_name(rope, problem):
    from types import SimpleNamespace

    from hapo_openrlhf.megatron.families import family_of

    cfg = SimpleNamespace(model_type="qwen3", rope_parameters=rope, max_position_embeddings=64, hidden_act="silu")
    with pytest.raises(ValueError, match="cannot build this Qwen3") as e:
        family_of(cfg)
    assert problem in str(e.value)
