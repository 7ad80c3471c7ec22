"""Batched sampling with a preallocated KV cache for the embedded trainer's models (Qwen2,
Qwen3, Llama), without ``transformers``' ``generate`` (issue 40).

What it computes is ``generate``'s multinomial sampling rule at temperature T and top-p:
* the model's forward (``decoder.Decoder``: the model's own weights, read at every call,
  equal to transformers' forward within float tolerance); positions follow ``generate``'s
  rule (the attention mask's cumulative sum; a generated token's position is the prompt's
  length plus its index);
* the same filter: float32 logits of the last position divided by T, then top-p as
  ``TopPLogitsWarper`` has it -- a token is dropped when the probability mass of the tokens
  ranked above it is already >= top-p (the top token always stays); a tied group straddling
  the boundary is cut by count, its members in sort order;
* the same stop: after ``max_new_tokens`` or when every row has emitted EOS; pad after a
  row's EOS.

How it is faster (docs/performance.md, "The sampler"): the prompt's KV cache is computed once
per distinct prompt and shared by its ``repeats`` rows; a decode step is ``Decoder``'s fused
projections plus attention as two batched matrix products against the preallocated cache,
the query heads grouped by their key/value head (no ``repeat_kv`` copy of the cache); rows
that have ended leave the batch (the caches compacted when a quarter of the rows has ended);
the draw is an inverse-CDF draw over the top-p set found with ``topk`` (a full sort of the
rows whose nucleus is larger than its k, those rows only) instead of a sort of the vocabulary
and ``torch.multinomial``.

The random stream: one ``torch.rand(B)`` a step from the global generator, for every row
(ended rows included), so a row's tokens depend on its own uniforms and logits only: they do
not depend on when other rows end, on the compaction, or on the batch's prompt grouping.
They are not ``generate``'s tokens under the same seed (``torch.multinomial`` draws
exponentials for every row and vocabulary entry); the distribution is the same, which
``tests/generation/test_sampler.py`` checks with a chi-square test against the exact top-p
distribution and against ``generate``'s draws, and it checks the cache machinery exactly
against a cache-free reference that uses the same uniforms.

Per token it also returns the log-probability of the drawn token and the entropy of the
full distribution at temperature T (what a scoring forward at the rollout temperature
computes, from the same logits), so the trainer needs no separate behaviour forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decoder import Decoder, unsupported

TOPK = 16  # the top-p set is searched among this many tokens first (a row whose nucleus is larger: sorted whole)
COMPACT = 3 / 4  # the caches drop ended rows when at most this fraction of them is left


@dataclass
class Sample:
    sequences: torch.Tensor  # [B, P + n]: the prompts (left padded), the responses, pad after EOS
    logprobs: torch.Tensor  # [B, n] float32: log p_T(drawn token), 0 after a row's end
    entropy: torch.Tensor  # [B, n] float32: entropy of p_T at that position, 0 after a row's end
    nucleus_logmass: torch.Tensor  # [B, n] float32: log p_T(top-p set) at that position (0 at top-p 1)


class KVSampler:
    """``sample(input_ids, attention_mask, ...)`` for one ``*ForCausalLM`` model of a
    supported family (``decoder.unsupported``)."""

    unsupported = staticmethod(unsupported)

    def __init__(self, model) -> None:
        self.model = model
        self.dec = Decoder(model)

    def _decode(self, w, h, cos, sin, kc, vc, bias, at: int):
        """One layer for one new token a row, ``h [b, H]`` at position ``at`` of the caches
        ``[b, Hkv, L, d]``; ``bias [b * Hkv, 1, L]`` is 0 on keys to attend, -inf on padding."""
        dec = self.dec
        b, end = h.shape[0], at + 1
        qk, v = dec.qkv(w, h, cos, sin)
        kc[:, :, at] = qk[:, dec.q_heads:]
        vc[:, :, at] = v
        L, d, g = kc.shape[2], dec.head_dim, dec.kv_heads
        # query heads grouped by their key/value head: [b * Hkv, Hq / Hkv, d] against [b * Hkv, end, d]
        q = qk[:, :dec.q_heads].reshape(b * g, dec.q_heads // g, d)
        s = torch.baddbmm(bias[:, :, :end], q, kc.view(b * g, L, d)[:, :end].transpose(1, 2), alpha=dec.scaling)
        o = torch.bmm(s.softmax(-1), vc.view(b * g, L, d)[:, :end]).view(b, -1)
        h = h + F.linear(o, w.o_w, w.o_b)
        return dec.mlp_residual(w, h)

    def _head(self):
        head = self.model.get_output_embeddings()
        return head.weight, head.bias

    @staticmethod
    def draw(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float):
        """(token, log p_T(token), entropy of p_T, log p_T(top-p set)) per row of ``logits
        [b, V]`` for uniforms ``u [b]`` in [0, 1): the inverse-CDF draw over the top-p set in
        descending probability order. The set is searched among each row's ``TOPK`` most
        probable tokens; only the rows whose nucleus may reach past them are sorted whole, so a
        row's draw depends on its own logits and uniform alone."""
        z = logits / temperature if temperature != 1.0 else logits
        lse = torch.logsumexp(z, -1, keepdim=True)
        logp = z - lse
        p_all = logp.exp()
        entropy = -(p_all * logp).sum(-1)
        if top_p < 1.0:
            k = min(TOPK, z.shape[-1])
            tok, logmass, short = KVSampler._nucleus(*z.topk(k, -1), lse, u, top_p)
            if k < z.shape[-1] and bool(short.any()):  # these rows' nuclei may reach past k: sort them whole
                r = short.nonzero().squeeze(1)
                tok[r], logmass[r], _ = KVSampler._nucleus(*z[r].sort(-1, descending=True), lse[r], u[r], top_p)
        else:
            c = p_all.cumsum(-1)
            mass = c[:, -1]
            tok = (c <= (u * mass).unsqueeze(-1)).sum(-1).clamp_(max=p_all.shape[-1] - 1)
            logmass = torch.zeros_like(mass)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), entropy, logmass

    @staticmethod
    def _nucleus(top: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, u: torch.Tensor, top_p: float):
        """(token, log p_T(top-p set), short) for rows whose candidates ``top`` (descending logits
        at T, ids ``idx``) hold their nucleus; ``short``: the candidates' mass is under top-p, so
        a row's nucleus may hold tokens past them (the caller sorts those rows whole)."""
        p = (top - lse).exp()
        c = p.cumsum(-1)
        short = c[:, -1] < top_p
        p = p.masked_fill(c - p >= top_p, 0.0)  # mass above a token already >= top-p: dropped
        c = p.cumsum(-1)
        mass = c[:, -1]
        j = (c <= (u * mass).unsqueeze(-1)).sum(-1, keepdim=True).clamp_(max=p.shape[-1] - 1)
        return idx.gather(-1, j).squeeze(-1), mass.log(), short

    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float, top_p: float,
               max_new_tokens: int, eos_token_id: int, pad_token_id: int, repeats: int = 1) -> Sample:
        """Sample ``repeats`` responses for each prompt row (rows grouped: prompt j gives rows
        ``[j * repeats, (j + 1) * repeats)``), at most ``max_new_tokens`` each.

        The loop runs under ``torch.inference_mode`` (no view or version-counter tracking: a
        decode step is ~100 small operations, and this is ~10% of a rollout's time here,
        docs/performance.md); what it returns is cloned out of it into ordinary tensors, which
        callers may update in place and train on (an inference tensor refuses both outside
        inference mode: an in-place update raises, and so does saving one for backward)."""
        with torch.inference_mode():
            s = self._sample(input_ids, attention_mask, temperature=temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             repeats=repeats)
        return Sample(s.sequences.clone(), s.logprobs.clone(), s.entropy.clone(), s.nucleus_logmass.clone())

    def _sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float, top_p: float,
                max_new_tokens: int, eos_token_id: int, pad_token_id: int, repeats: int) -> Sample:
        if temperature <= 0:
            raise ValueError(f"KVSampler samples: temperature must be > 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"KVSampler: top_p must be in (0, 1], got {top_p}")
        if max_new_tokens < 0 or repeats < 1:
            raise ValueError(f"KVSampler: max_new_tokens must be >= 0 and repeats >= 1, got {max_new_tokens}, "
                             f"{repeats}")
        U, P = input_ids.shape
        if P == 0 or not bool(attention_mask.bool().any(-1).all()):
            raise ValueError("KVSampler: a prompt has no token (an empty prompt has no position to sample from)")
        if max_new_tokens == 0:
            seq = input_ids.repeat_interleave(repeats, 0)
            return Sample(seq, *(seq.new_zeros(len(seq), 0, dtype=torch.float32) for _ in range(3)))
        B, L, dev = U * repeats, P + max_new_tokens, input_ids.device
        dec, g = self.dec, self.dec.kv_heads
        layers = dec.layers()
        valid = attention_mask.bool()
        emb = dec.decoder.embed_tokens.weight
        # prefill: once per distinct prompt, into caches its ``repeats`` rows share
        h, kvs = dec.forward(input_ids, attention_mask, keep_kv=True)
        caches = []
        for k, v in kvs:
            kc, vc = emb.new_empty(B, g, L, dec.head_dim), emb.new_empty(B, g, L, dec.head_dim)
            kc[:, :, :P] = k.repeat_interleave(repeats, 0)
            vc[:, :, :P] = v.repeat_interleave(repeats, 0)
            caches.append((kc, vc))
        # a generated token's position: the prompt's length plus its index (generate's rule)
        pos = valid.sum(-1, keepdim=True) + torch.arange(max_new_tokens, device=dev)
        cos, sin = (t.repeat_interleave(repeats, 0) for t in dec.rope(pos))  # a prompt's rows share positions
        logits = F.linear(h[:, -1], *self._head()).float().repeat_interleave(repeats, 0)  # h is normed
        rows = torch.arange(B, device=dev)  # the batch's rows, as indices into the B outputs
        bias = torch.zeros(B, 1, L, device=dev, dtype=emb.dtype)
        bias[:, 0, :P].masked_fill_(~valid.repeat_interleave(repeats, 0), float("-inf"))
        bias = bias.repeat_interleave(g, 0)  # [B * Hkv, 1, L]
        tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=dev)
        scores = torch.zeros(3, B, max_new_tokens, dtype=torch.float32, device=dev)  # log-prob, entropy, log-mass
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        full = True  # rows is every row (no compaction yet): plain column writes, no row gather
        n = 0
        for t in range(max_new_tokens):
            u = torch.rand(B, device=dev)  # every row draws, ended ones too: the stream is the same however rows end
            tok, lp, en, lm = self.draw(logits, u if full else u[rows], temperature, top_p)
            dead = ~alive
            tok = tok.masked_fill(dead, pad_token_id)
            val = torch.stack((lp, en, lm)).masked_fill_(dead, 0.0)
            if full:
                tokens[:, t], scores[:, :, t] = tok, val
            else:
                tokens[rows, t], scores[:, rows, t] = tok, val
            alive &= tok != eos_token_id
            n = t + 1
            left = int(alive.sum())
            if left == 0 or n == max_new_tokens:
                break
            if left <= COMPACT * len(rows):  # drop the ended rows
                keep = alive.nonzero().squeeze(1)
                rows, tok, alive, cos, sin = rows[keep], tok[keep], alive[keep], cos[keep], sin[keep]
                caches = [(kc[keep], vc[keep]) for kc, vc in caches]
                bias = bias.view(-1, g, 1, L)[keep].view(-1, 1, L)
                full = False
            at = P + t
            h = F.embedding(tok, emb)
            cos_t, sin_t = cos[:, t], sin[:, t]
            for w, (kc, vc) in zip(layers, caches):
                h = self._decode(w, h, cos_t, sin_t, kc, vc, bias, at)
            logits = F.linear(dec.norm(h), *self._head()).float()
        seq = torch.cat([input_ids.repeat_interleave(repeats, 0), tokens[:, :n]], 1)
        return Sample(seq, *scores[:, :, :n])
