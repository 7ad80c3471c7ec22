"""KVSampler (hapo_openrlhf/generation/sampler.py).

* The cache machinery exactly: its tokens equal a cache-free reference that runs transformers'
  own model over the whole sequence at every step and draws with the same uniforms (every
  family the embedded trainer builds, T 1 / 0.6, top-p 0.95 / 1, left padding, rows ending
  at different steps, shared prompts); its log-probs, entropy and nucleus mass equal the
  reference's within 1e-5, and the trainer's scoring forward's too.
* The draw's distribution: the kept set is exactly ``TopPLogitsWarper``'s, and a chi-square
  goodness-of-fit test against the warper's distribution does not reject at 0.1 %; a
  two-sample test against ``generate``'s own draws does not either.
* Invariances: compaction and prompt sharing do not change the tokens.
* Named refusals.
"""

from dataclasses import replace

import pytest
import torch

from hapo_openrlhf.config import ModelConfig
from hapo_openrlhf.generation import sampler as sampler_mod
from hapo_openrlhf.local.model import build_model, build_tokenizer
from hapo_openrlhf.generation.sampler import KVSampler

ALPHA = 1e-3  # significance of the distribution tests


def _model(family: str, eos_bias: float = 0.0, sharpen: float = 1.0):
    """A random tiny model of ``family``; ``eos_bias`` > 0 gives its output layer a bias that
    makes EOS likely at every position (rows then end at different steps); ``sharpen``
    scales the output layer (peaked distributions: the top-k path of the top-p filter)."""
    tok = build_tokenizer()
    model = build_model(replace(ModelConfig(), family=family, tie_word_embeddings=False), tok, seed=3).eval()
    head = model.lm_head
    with torch.no_grad():
        head.weight.mul_(sharpen)
    if eos_bias:
        biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        with torch.no_grad():
            biased.weight.copy_(head.weight)
            biased.bias.zero_()
            biased.bias[tok.eos_token_id] = eos_bias
        model.lm_head = biased
    return model, tok


def _prompts(tok, texts=("1+2 =", "Compute 7-3+5 =", "9 =")):
    enc = tok(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def _reference(model, ids, am, *, temperature, top_p, max_new_tokens, eos, pad, repeats, seed):
    """No cache: transformers' model over the whole sequence at every step, generate's
    positions, the same uniforms and the same draw."""
    ids, am = ids.repeat_interleave(repeats, 0), am.repeat_interleave(repeats, 0)
    B = len(ids)
    torch.manual_seed(seed)
    seq, mask = ids, am
    alive = torch.ones(B, dtype=torch.bool)
    cols = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            logits = model(input_ids=seq, attention_mask=mask, position_ids=pos).logits[:, -1].float()
            tok, lp, en, lm = KVSampler.draw(logits, torch.rand(B), temperature, top_p)
            tok = tok.masked_fill(~alive, pad)
            cols.append((tok, lp * alive, en * alive, lm * alive))
            alive &= tok != eos
            seq, mask = torch.cat([seq, tok[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            if not bool(alive.any()):
                break
    return seq, *(torch.stack([c[i] for c in cols], 1) for i in (1, 2, 3))


def _sample(model, tok, ids, am, seed, **kw):
    torch.manual_seed(seed)
    return KVSampler(model).sample(ids, am, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("temperature,top_p,sharpen", [(1.0, 0.95, 1.0), (0.6, 1.0, 1.0), (1.0, 0.9, 8.0)])
@pytest.mark.parametrize("eos_bias", [0.0, 3.0])
def test_tokens_and_scores_equal_a_cache_free_reference(family, temperature, top_p, sharpen, eos_bias):
    model, tok = _model(family, eos_bias, sharpen)
    ids, am = _prompts(tok)
    assert bool((am == 0).any())  # left padding in play
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=20)
    got = _sample(model, tok, ids, am, 11, repeats=4, **kw)
    want, lp, en, lm = _reference(model, ids, am, eos=tok.eos_token_id, pad=tok.pad_token_id, repeats=4, seed=11,
                                  **kw)
    assert got.sequences.shape == want.shape and torch.equal(got.sequences, want)
    torch.testing.assert_close(got.logprobs, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, en, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.nucleus_logmass, lm, atol=1e-5, rtol=1e-5)
    resp = got.sequences[:, ids.shape[1]:]
    ended = (resp == tok.eos_token_id).any(-1)
    if eos_bias:  # rows ended at different steps (compaction in play), pad after their EOS
        first = (resp == tok.eos_token_id).long().argmax(-1)[ended]
        assert len(set(first.tolist())) > 1
        assert all(bool((r[f + 1:] == tok.pad_token_id).all()) for r, f in zip(resp[ended], first.tolist()))
    if top_p == 1.0:
        assert bool((got.nucleus_logmass == 0).all())
    elif sharpen > 1:  # peaked: the nucleus is a strict subset, its mass below 1
        assert bool((got.nucleus_logmass[got.logprobs != 0] < 0).all())


def test_compaction_and_prompt_sharing_do_not_change_the_tokens(monkeypatch):
    model, tok = _model("qwen2", eos_bias=3.0)
    ids, am = _prompts(tok)
    kw = dict(temperature=1.0, top_p=0.95, max_new_tokens=24)
    base = _sample(model, tok, ids, am, 5, repeats=3, **kw)
    expanded = _sample(model, tok, ids.repeat_interleave(3, 0), am.repeat_interleave(3, 0), 5, **kw)
    assert torch.equal(base.sequences, expanded.sequences)
    for every in (0.0, 1.0):  # never compact / compact whenever a row ends
        monkeypatch.setattr(sampler_mod, "COMPACT", every)
        assert torch.equal(_sample(model, tok, ids, am, 5, repeats=3, **kw).sequences, base.sequences), every


def test_generation_stops_when_every_row_has_ended_and_a_one_token_budget():
    model, tok = _model("qwen2", 6.0)  # EOS about 60 % likely at every position
    ids, am = _prompts(tok, ("1+2 =", "Compute 7-3+5 ="))
    got = _sample(model, tok, ids, am, 4, temperature=1.0, top_p=0.95, max_new_tokens=40, repeats=2)
    resp = got.sequences[:, ids.shape[1]:]
    assert resp.shape[1] < 40 and bool((resp == tok.eos_token_id).any(-1).all())
    assert resp.shape == got.logprobs.shape == got.entropy.shape
    one = _sample(model, tok, ids, am, 4, temperature=1.0, top_p=0.95, max_new_tokens=1, repeats=2)
    assert one.sequences.shape == (4, ids.shape[1] + 1)
    assert torch.equal(one.sequences[:, -1], got.sequences[:, ids.shape[1]])  # the first draw is the same
    none = _sample(model, tok, ids, am, 4, temperature=1.0, top_p=0.95, max_new_tokens=0, repeats=2)
    assert torch.equal(none.sequences, ids.repeat_interleave(2, 0)) and none.logprobs.shape == (4, 0)


def _warper_probs(logits, temperature, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    z = TemperatureLogitsWarper(temperature)(None, logits.clone()) if temperature != 1.0 else logits.clone()
    if top_p < 1.0:
        z = TopPLogitsWarper(top_p)(None, z)
    return z.softmax(-1)


@pytest.mark.parametrize("case", ["peaked", "flat", "ties", "cold"])
def test_the_draw_follows_the_top_p_distribution(case):
    g = torch.Generator().manual_seed(7)
    V = 259
    logits = torch.randn(1, V, generator=g)
    T, top_p = 1.0, 0.95
    if case == "peaked":
        logits = logits * 4  # nucleus within topk's k
    if case == "ties":
        logits = (logits * 2).round() / 2 + 3 * (torch.arange(V) < 6)  # tied groups, one straddling the boundary
    if case == "cold":
        T, top_p = 0.6, 0.8
    want = _warper_probs(logits, T, top_p)[0]
    N = 40_000
    tok, lp, en, lm = KVSampler.draw(logits.expand(N, V), torch.rand(N, generator=g), T, top_p)
    p_t = (logits / T).log_softmax(-1)[0]
    torch.testing.assert_close(lp, p_t[tok])
    torch.testing.assert_close(en[0], -(p_t.exp() * p_t).sum())
    torch.testing.assert_close(lm[0], p_t.exp()[want > 0].sum().log())
    counts = torch.bincount(tok, minlength=V).double()
    if case != "ties":
        # the kept set is the warper's, exactly, whichever path (top-k or full sort) the draw took
        assert set(tok.unique().tolist()) <= set(want.nonzero().squeeze(1).tolist())
        assert _chi2_pvalue(counts, want.double() * N) > ALPHA
    else:
        # a tied group straddling the boundary is cut by count; which of its equal tokens stay
        # is the sort's choice (the warper's ascending sort, our descending one): compare by
        # probability level -- as many tokens of each level kept, the same mass on each level
        levels, level_of = logits[0].unique(return_inverse=True)
        kept = torch.zeros(len(levels)).index_add_(0, level_of, (want > 0).double().float())
        drawn = torch.zeros(len(levels)).index_add_(0, level_of[tok.unique()], torch.ones(len(tok.unique())))
        assert bool((drawn <= kept).all())
        assert 0 < int(((kept > 0) & (kept < torch.bincount(level_of).float())).sum())  # a group is split
        per_level = torch.zeros(len(levels), dtype=torch.float64)
        assert _chi2_pvalue(per_level.index_add(0, level_of, counts), per_level.index_add(0, level_of, want.double())
                            * N) > ALPHA


def test_a_rows_draw_depends_on_its_own_logits_and_uniform_alone():
    """Rows whose nucleus lies within the top-k candidates and rows whose nucleus reaches past
    them (sorted whole), in one batch: each row draws exactly what it draws alone -- token,
    log-prob, entropy and nucleus mass -- whichever other rows share its batch. Rows of tied
    logits are among them: which of equal tokens a row takes must not depend on whether some
    other row needed the full sort."""
    from hapo_openrlhf.generation.sampler import TOPK

    g = torch.Generator().manual_seed(11)
    V, B = 259, 48
    scale = torch.where(torch.arange(B) % 3 == 0, 0.3, 6.0)[:, None]  # flat rows (nucleus past k) and peaked
    logits = torch.randn(B, V, generator=g) * scale
    logits[1] = 8.0 * (torch.arange(V) < 10)  # ten tied tokens hold the nucleus, within k
    logits[2] = 2.0 * (torch.arange(V) % 7 == 0) - 1.0  # 37 tied tokens: a nucleus past k
    u = torch.rand(B, generator=g)
    for T, top_p in ((1.0, 0.95), (0.6, 0.8)):
        z = logits / T
        within = z.softmax(-1).topk(TOPK, -1).values.sum(-1) >= top_p
        assert 0 < int(within.sum()) < B  # both kinds of row in the batch
        batch = KVSampler.draw(logits, u, T, top_p)
        alone = [KVSampler.draw(logits[i:i + 1], u[i:i + 1], T, top_p) for i in range(B)]
        for j in range(4):
            assert torch.equal(batch[j], torch.cat([a[j] for a in alone])), (T, top_p, j)


def _chi2_pvalue(observed, expected, min_expected=5.0):
    """Pearson's chi-square goodness of fit; cells with expected count < ``min_expected``
    pooled into one. ``torch.special.gammaincc`` is the chi-square survival function."""
    keep = expected >= min_expected
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if float(exp[-1]) < min_expected:  # the pooled tail too small to be its own cell: fold it into the last
        obs, exp = torch.cat([obs[:-2], obs[-2:].sum()[None]]), torch.cat([exp[:-2], exp[-2:].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_the_chi_square_test_rejects_a_wrong_distribution():
    """The test above can fail: the same draw against a distribution without the top-p cut,
    or with T 1 instead of 0.6, is rejected."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 259, generator=g) * 4
    N = 40_000
    tok = KVSampler.draw(logits.expand(N, -1), torch.rand(N, generator=g), 0.6, 0.8)[0]
    counts = torch.bincount(tok, minlength=259).double()
    for T, top_p in ((0.6, 1.0), (1.0, 0.8)):
        assert _chi2_pvalue(counts, _warper_probs(logits, T, top_p)[0].double() * N) < ALPHA


def test_two_sample_against_generate():
    """The first three tokens of 3,000 rows from ``generate`` and from the sampler: a
    chi-square homogeneity test on the joint outcome does not reject at 0.1 %."""
    from transformers import GenerationConfig

    model, tok = _model("qwen2", eos_bias=2.0, sharpen=15.0)
    ids, am = _prompts(tok, ("1+2 =",))
    n = 3000
    torch.manual_seed(0)
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_p=0.9, top_k=0, max_new_tokens=3,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    a = model.generate(input_ids=ids.expand(n, -1), attention_mask=am.expand(n, -1), generation_config=cfg)
    b = _sample(model, tok, ids, am, 1, temperature=1.0, top_p=0.9, max_new_tokens=3, repeats=n).sequences
    P = ids.shape[1]

    def outcomes(seq):
        r = torch.nn.functional.pad(seq[:, P:], (0, 3 - (seq.shape[1] - P)), value=tok.pad_token_id)
        return [tuple(x) for x in r.tolist()]

    from collections import Counter

    ca, cb = Counter(outcomes(a)), Counter(outcomes(b))
    keys = sorted(set(ca) | set(cb))
    table = torch.tensor([[ca[k], cb[k]] for k in keys], dtype=torch.float64)
    big = table.sum(1) >= 10  # pool rare outcomes
    table = torch.cat([table[big], table[~big].sum(0, keepdim=True)])
    exp = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - exp) ** 2 / exp).sum())
    dof = len(table) - 1
    assert dof >= 10  # a joint outcome with many cells, not a trivially peaked one
    assert float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2))) > ALPHA


def test_the_rollout_scores_equal_the_trainers_scoring_forward():
    """``rollout.generate`` carries the sampler's log-probs, entropy and nucleus mass; they
    equal ``policy_forward``'s (the old-log-prob forward ``rollout.old_logprobs: forward``
    runs) within 1e-5 on every response token, and are 0 off the mask."""
    from hapo_openrlhf.generation.rollout import concat_rollouts, generate
    from hapo_openrlhf.local.forward import policy_forward

    for eos_bias, fused in ((2.5, False), (0.0, True)):  # the fused head has no bias
        model, tok = _model("qwen3", eos_bias=eos_bias, sharpen=2.0)
        torch.manual_seed(0)
        parts = [generate(model, tok, ["1+2 =", "Compute 7-3+5 ="], n=3, temperature=0.8, top_p=0.9,
                          max_new_tokens=16),
                 generate(model, tok, ["9 ="], n=3, temperature=0.8, top_p=0.9, max_new_tokens=10)]
        ro = concat_rollouts(parts, tok.pad_token_id)
        lp, en, lm = policy_forward(model, ro, temperature=0.8, chunk_size=64, nucleus_top_p=0.9, fused=fused)
        mask = ro.response_mask_BR.bool()
        assert bool((ro.logprobs_BR[~mask] == 0).all()) and bool((ro.entropy_BR[~mask] == 0).all())
        torch.testing.assert_close(ro.logprobs_BR, lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ro.entropy_BR, en, atol=1e-5, rtol=0)
        torch.testing.assert_close(ro.logmass_BR, lm, atol=1e-5, rtol=0)
        sub = ro.select([4, 1])
        assert torch.equal(sub.logprobs_BR, ro.logprobs_BR[[4, 1]])


def test_the_samples_are_ordinary_tensors_a_training_forward_can_use():
    """The loop runs under ``torch.inference_mode``; what ``sample`` returns is not an inference
    tensor: a training forward and backward over the sampled sequences runs, and the outputs
    can be written in place (on an inference tensor that raises outside inference mode)."""
    from hapo_openrlhf.generation.decoder import Decoder

    model, tok = _model("qwen2")
    ids, am = _prompts(tok)
    s = _sample(model, tok, ids, am, 0, temperature=1.0, top_p=0.95, max_new_tokens=6, repeats=2)
    assert not any(t.is_inference() for t in (s.sequences, s.logprobs, s.entropy, s.nucleus_logmass))
    mask = torch.cat([am.repeat_interleave(2, 0), torch.ones_like(s.logprobs, dtype=am.dtype)], 1)
    model.train()
    Decoder(model).forward(s.sequences, mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    s.logprobs.mul_(2.0)


def test_refusals_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        KVSampler(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))
    model, tok = _model("qwen2")

    class Wrapped(torch.nn.Linear):  # an adapter or a quantised layer: not plain weights
        pass

    wrapped, _ = _model("qwen2")
    wrapped.model.layers[1].mlp.up_proj.__class__ = Wrapped
    with pytest.raises(ValueError, match="Wrapped is not a plain torch.nn.Linear"):
        KVSampler(wrapped)
    ids, am = torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long)
    for kw, msg in (({"temperature": 0.0, "top_p": 1.0}, "temperature must be > 0"),
                    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
                    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
                    ({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": -1}, "max_new_tokens must be >= 0")):
        with pytest.raises(ValueError, match=msg):
            KVSampler(model).sample(ids, am, **({"max_new_tokens": 3} | kw), eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="a prompt has no token"):
        KVSampler(model).sample(torch.tensor([[0, 0], [5, 6]]), torch.tensor([[0, 0], [1, 1]]), temperature=1.0,
                                top_p=1.0, max_new_tokens=3, eos_token_id=1, pad_token_id=0)
