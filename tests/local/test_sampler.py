"""KVSampler (hapo_openrlhf/local/sampler.py) against transformers' ``generate``: the same
token ids under the same seed -- left-padded prompts of different lengths, every family the
embedded trainer builds, temperature 1 and 0.6, top-p 0.95 and 1, rows that stop at EOS
(finished rows draw and get the pad token, so the stream stays aligned) and rows cut at
``max_new_tokens`` -- and named refusals."""

from dataclasses import replace

import pytest
import torch

from hapo_openrlhf.config import ModelConfig
from hapo_openrlhf.local.model import build_model, build_tokenizer
from hapo_openrlhf.local.sampler import KVSampler


def _model(family: str, eos_bias: float):
    """A random tiny model of ``family``; ``eos_bias`` > 0 gives its output layer a bias that
    makes EOS likely at every position (rows then end at different steps)."""
    tok = build_tokenizer()
    model = build_model(replace(ModelConfig(), family=family, tie_word_embeddings=False), tok, seed=3).eval()
    if eos_bias:
        head = model.lm_head
        biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        with torch.no_grad():
            biased.weight.copy_(head.weight)
            biased.bias.zero_()
            biased.bias[tok.eos_token_id] = eos_bias
        model.lm_head = biased
    return model, tok


def _generate(model, tok, ids, am, *, temperature, top_p, max_new_tokens, seed):
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    cfg = GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model.generate(input_ids=ids, attention_mask=am, generation_config=cfg)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.95), (0.6, 1.0)])
@pytest.mark.parametrize("eos_bias", [0.0, 3.0])
def test_tokens_equal_generate_under_the_same_seed(family, temperature, top_p, eos_bias):
    model, tok = _model(family, eos_bias)
    enc = tok(["1+2 =", "Compute 7-3+5 =", "9 ="], return_tensors="pt", padding=True, add_special_tokens=False)
    ids, am = enc["input_ids"].repeat_interleave(4, 0), enc["attention_mask"].repeat_interleave(4, 0)
    assert bool((am == 0).any())  # left padding in play
    want = _generate(model, tok, ids, am, temperature=temperature, top_p=top_p, max_new_tokens=24, seed=11)
    torch.manual_seed(11)
    got = KVSampler(model).sample(ids, am, temperature=temperature, top_p=top_p, max_new_tokens=24,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert got.shape == want.shape and torch.equal(got, want)
    # the random stream ends where generate's does: the next draw agrees too
    torch.manual_seed(11)
    KVSampler(model).sample(ids, am, temperature=temperature, top_p=top_p, max_new_tokens=24,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    after = torch.rand(3)
    _generate(model, tok, ids, am, temperature=temperature, top_p=top_p, max_new_tokens=24, seed=11)
    assert torch.equal(after, torch.rand(3))
    resp = got[:, ids.shape[1]:]
    ended = (resp == tok.eos_token_id).any(-1)
    if eos_bias:  # rows ended at different steps, pad after their EOS
        first = (resp == tok.eos_token_id).long().argmax(-1)[ended]
        assert len(set(first.tolist())) > 1
        assert all(bool((r[f + 1:] == tok.pad_token_id).all()) for r, f in zip(resp[ended], first.tolist()))
    else:  # a random model rarely says EOS: rows run to max_new_tokens
        assert resp.shape[1] == 24 and not bool(ended.all())


def test_generation_stops_when_every_row_has_ended():
    model, tok = _model("qwen2", 6.0)  # EOS about 60% likely at every position
    enc = tok(["1+2 =", "Compute 7-3+5 ="], return_tensors="pt", padding=True, add_special_tokens=False)
    ids, am = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    want = _generate(model, tok, ids, am, temperature=1.0, top_p=0.95, max_new_tokens=24, seed=4)
    torch.manual_seed(4)
    got = KVSampler(model).sample(ids, am, temperature=1.0, top_p=0.95, max_new_tokens=24,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(got, want)
    resp = got[:, ids.shape[1]:]
    assert resp.shape[1] < 24 and bool((resp == tok.eos_token_id).any(-1).all())


def test_a_batch_without_padding_and_a_one_token_budget():
    model, tok = _model("qwen2", 0.0)
    ids = torch.randint(2, 200, (5, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    for n in (1, 7):
        want = _generate(model, tok, ids, am, temperature=1.0, top_p=0.9, max_new_tokens=n, seed=2)
        torch.manual_seed(2)
        got = KVSampler(model).sample(ids, am, temperature=1.0, top_p=0.9, max_new_tokens=n,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert torch.equal(got, want), n


def test_refusals_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        KVSampler(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))
    model, tok = _model("qwen2", 0.0)
    ids, am = torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long)
    for kw, msg in (({"temperature": 0.0, "top_p": 1.0}, "temperature must be > 0"),
                    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
                    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]")):
        with pytest.raises(ValueError, match=msg):
            KVSampler(model).sample(ids, am, max_new_tokens=3, eos_token_id=1, pad_token_id=0, **kw)
