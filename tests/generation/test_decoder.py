"""decoder.Decoder (the embedded trainer's forward for Qwen2 / Qwen3 / Llama, the projections
on real tokens only) against transformers' own model: hidden states on every real position,
the response log-probs and entropy the trainer scores with, and every weight's gradient of a
loss through them -- left and right padding, GQA and plain multi-head attention, biases,
QK-norm, an untied output layer."""

from dataclasses import replace

import pytest
import torch

from hapo_openrlhf.config import ModelConfig
from hapo_openrlhf.generation.decoder import Decoder, unsupported
from hapo_openrlhf.local.model import build_model, build_tokenizer


def _batch(tok):
    g = torch.Generator().manual_seed(1)
    B, L = 5, 23
    ids = torch.randint(3, 250, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[0, :4] = 0  # left padding (prompts) ...
    am[1, :2] = 0
    am[2, -7:] = 0  # ... and right padding (responses that ended)
    am[3, :3] = 0
    am[3, -2:] = 0
    ids[am == 0] = tok.pad_token_id
    return ids, am


def _hf_hidden(model, ids, am):
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    return model.get_decoder()(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).last_hidden_state


@pytest.mark.parametrize("family,kv_heads", [("qwen2", 2), ("qwen3", 2), ("llama", 2), ("qwen2", 4)])
def test_hidden_states_and_gradients_equal_transformers(family, kv_heads):
    tok = build_tokenizer()
    cfg = replace(ModelConfig(), family=family, num_kv_heads=kv_heads, tie_word_embeddings=family == "llama")
    model = build_model(cfg, tok, seed=5)
    if family == "qwen3":  # QK-norm weights away from 1, so a mix-up of query and key norms shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ids, am = _batch(tok)
    keep = am.bool()
    head = model.get_output_embeddings().weight
    w = torch.randn(*ids.shape, generator=torch.Generator().manual_seed(2))

    def loss_and_grads(hidden_fn):
        model.zero_grad(set_to_none=True)
        h = hidden_fn()
        logp = (h @ head.T).log_softmax(-1)
        # a loss through log-probs and entropy of the real positions, as the trainer's
        loss = ((logp.gather(-1, ids[..., None])[..., 0] - 0.1 * (logp.exp() * logp).sum(-1)) * w)[keep].sum()
        loss.backward()
        return h.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters()}

    want_h, want_g = loss_and_grads(lambda: _hf_hidden(model, ids, am))
    got_h, got_g = loss_and_grads(lambda: Decoder(model).forward(ids, am))
    torch.testing.assert_close(got_h, want_h, atol=2e-5, rtol=1e-4)
    assert set(got_g) == set(want_g)
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-3, msg=n)
    assert bool((Decoder(model).forward(ids, am)[~keep] == 0).all())  # padding: 0


def test_the_trainers_scoring_forward_uses_it_and_matches_transformers():
    from hapo_openrlhf.generation.rollout import generate
    from hapo_openrlhf.local.forward import policy_forward

    tok = build_tokenizer()
    model = build_model(ModelConfig(), tok, seed=6)
    torch.manual_seed(0)
    ro = generate(model, tok, ["1+2 =", "Compute 7-3+5 ="], n=3, temperature=1.0, top_p=0.95,
                         max_new_tokens=12)
    lp, en = policy_forward(model, ro, temperature=1.0, chunk_size=64)
    seen = []
    orig = Decoder.forward
    Decoder.forward = lambda self, *a, **k: seen.append(1) or orig(self, *a, **k)
    try:
        policy_forward(model, ro, temperature=1.0, chunk_size=64)
    finally:
        Decoder.forward = orig
    assert seen  # the scoring forward went through Decoder
    P = ro.prompt_len
    h = _hf_hidden(model, ro.sequences_BL, ro.attention_mask_BL)[:, P - 1:-1]
    want = (h @ model.lm_head.weight.T).log_softmax(-1)
    m = ro.response_mask_BR.bool()
    torch.testing.assert_close(lp[m], want.gather(-1, ro.response_ids_BR[..., None])[..., 0][m], atol=1e-5, rtol=0)
    torch.testing.assert_close(en[m], -(want.exp() * want).sum(-1)[m], atol=1e-5, rtol=0)


def test_unsupported_models_are_named_and_fall_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert "model_type 'gpt2'" in unsupported(gpt2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        Decoder(gpt2)
    tok = build_tokenizer()
    model = build_model(ModelConfig(), tok, seed=1)
    model.config.attention_dropout = 0.1
    assert unsupported(model) == "attention dropout is not supported"
    with pytest.raises(ValueError, match="a row has no attended token"):
        model.config.attention_dropout = 0.0
        Decoder(model).forward(torch.tensor([[5, 6], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_rows_sharing_a_prompt_run_it_once_and_equal_transformers(family):
    """A rollout's layout (left-padded prompts, right-padded responses) with each prompt in
    three rows: ``prompt_len`` makes the prompt's forward run once per distinct prompt, and
    hidden states and every gradient still equal transformers' per-row forward."""
    tok = build_tokenizer()
    model = build_model(replace(ModelConfig(), family=family), tok, seed=7)
    g = torch.Generator().manual_seed(3)
    P, R = 9, 12
    prompts = torch.randint(3, 250, (3, P), generator=g)
    pm = torch.ones(3, P, dtype=torch.long)
    pm[0, :4], pm[1, :1] = 0, 0
    prompts[pm == 0] = tok.pad_token_id
    ids = torch.cat([prompts.repeat_interleave(3, 0), torch.randint(3, 250, (9, R), generator=g)], 1)
    am = torch.cat([pm.repeat_interleave(3, 0), torch.ones(9, R, dtype=torch.long)], 1)
    for row, n in ((0, 5), (4, 11), (8, 1), (7, 0)):  # responses that ended early (row 7 runs to the end)
        if n:
            am[row, -n:] = 0
    ids[am == 0] = tok.pad_token_id
    keep = am.bool()
    w = torch.randn(*ids.shape, model.config.hidden_size, generator=g)

    def run(fn):
        model.zero_grad(set_to_none=True)
        h = fn()
        (h * w)[keep].sum().backward()
        return h.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters()}

    seen = []
    orig = Decoder._rows_forward
    Decoder._rows_forward = lambda self, i, m, keep_kv: seen.append(tuple(i.shape)) or orig(self, i, m, keep_kv)
    try:
        got_h, got_g = run(lambda: Decoder(model).forward(ids, am, prompt_len=P))
    finally:
        Decoder._rows_forward = orig
    assert seen == [(3, P)]  # the three distinct prompts, once each; the responses per row
    want_h, want_g = run(lambda: _hf_hidden(model, ids, am))
    torch.testing.assert_close(got_h, want_h, atol=2e-5, rtol=1e-4)
    for n in want_g:  # relative to the gradient's scale (a sum over three rows for the prompts' tokens)
        scale = want_g[n].abs().max()
        torch.testing.assert_close(got_g[n] / scale, want_g[n] / scale, atol=1e-5, rtol=1e-4, msg=n)
    # distinct prompts: the per-row forward, the same values
    torch.testing.assert_close(Decoder(model).forward(ids[::3], am[::3], prompt_len=P),
                               Decoder(model).forward(ids[::3], am[::3]), atol=1e-6, rtol=0)
