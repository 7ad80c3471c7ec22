"""Batched sampling with a preallocated KV cache for the embedded trainer's models
(Qwen2, Qwen3, Llama), without ``transformers``' ``generate`` (issue 40).

What it computes is ``generate``'s multinomial sampling, step for step:
* the same modules: the model's own embedding, norms, projections, QK-norms, MLPs, rotary
  table, ``apply_rotary_pos_emb`` and transformers' own SDPA attention function, called on
  the same shapes (the cache is preallocated once, ``[B, kv_heads, P + R, head_dim]``, and
  each step attends to its filled prefix, as ``DynamicCache`` would hand it over);
* the same sampling rule: float32 logits of the last position, ``TemperatureLogitsWarper``
  (``scores / T``, skipped at T = 1), ``TopPLogitsWarper`` (ascending sort, cumulative
  softmax, remove ``<= 1 - top_p``, keep the top token; skipped at top-p 1), softmax,
  ``torch.multinomial`` on the whole batch every step -- finished rows draw too and get the
  pad token, so the random stream advances as ``generate``'s does;
* the same stop: after ``max_new_tokens`` or when every row has emitted EOS.

What it leaves out is ``generate``'s per-step machinery: building a 4-D mask, cache objects,
``prepare_inputs_for_generation``, logits-processor and stopping-criteria lists. Position ids
follow ``generate``'s rule (the attention mask's cumulative sum; a generated token's position
is the prompt's length plus its index). ``tests/local/test_sampler.py`` checks the tokens equal
``generate``'s under the same seed, and that the random stream ends where ``generate``'s does.
"""

from __future__ import annotations

import sys

import torch

SUPPORTED = ("qwen2", "qwen3", "llama")


def _prefill_mask(valid_BP: torch.Tensor) -> torch.Tensor:
    """transformers' SDPA mask for a left-padded prompt (True = attend): causal plus key
    padding, ``[B, 1, P, P]``. A padded query attends to itself (no all-masked row, no NaN in
    the cache); its output reaches no real token."""
    k = torch.arange(valid_BP.shape[1], device=valid_BP.device)
    m = (k[None, :] <= k[:, None])[None] & valid_BP[:, None, :]
    m |= torch.eye(len(k), dtype=torch.bool, device=k.device)[None]
    return m[:, None]


class KVSampler:
    """``sample(input_ids, attention_mask, ...)`` for one ``*ForCausalLM`` model of a
    supported family (its weights are read live: no copy, training changes them)."""

    @staticmethod
    def unsupported(config) -> str | None:
        """Why a model with this config cannot be sampled here (None: it can)."""
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED:
            return f"model_type {kind!r} is not supported (only {', '.join(SUPPORTED)})"
        if getattr(config, "use_sliding_window", False):
            return "sliding-window attention is not supported"
        return None

    def __init__(self, model) -> None:
        why = self.unsupported(model.config)
        if why:
            raise ValueError(f"KVSampler: {why}")
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.attend = sdpa_attention_forward
        self.head_dim = attn.head_dim
        self.kv_heads = model.config.num_key_value_heads
        self.qk_norm = hasattr(attn, "q_norm")

    def _layer(self, layer, h, cos, sin, k_cache, v_cache, start: int, mask):
        """One decoder layer over the new positions ``[start, start + q)``; writes their keys
        and values into the caches and attends to ``[0, start + q)``."""
        attn = layer.self_attn
        res = h
        x = layer.input_layernorm(h)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        end = start + x.shape[1]
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        out, _ = self.attend(attn, q, k_cache[:, :, :end], v_cache[:, :, :end], mask, dropout=0.0,
                             scaling=attn.scaling)
        h = res + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h, cos, sin, caches, start: int, mask) -> torch.Tensor:
        for layer, (kc, vc) in zip(self.layers, caches):
            h = self._layer(layer, h, cos, sin, kc, vc, start, mask)
        last = self.decoder.norm(h[:, -1:])
        return self.model.get_output_embeddings()(last)[:, -1].to(dtype=torch.float32, copy=True)

    @staticmethod
    def _warp(scores: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        if temperature != 1.0:
            scores = scores / temperature
        if top_p < 1.0:
            s, idx = torch.sort(scores, descending=False)
            drop = s.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
            drop[..., -1:] = 0
            scores = scores.masked_fill(drop.scatter(1, idx, drop), -float("inf"))
        return scores

    @torch.no_grad()
    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float, top_p: float,
               max_new_tokens: int, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
        """``[B, P + n]`` token ids, ``n <= max_new_tokens`` (the prompt, left padded, then the
        responses; pad after a row's EOS), like ``generate``'s ``sequences``."""
        if temperature <= 0:
            raise ValueError(f"KVSampler samples: temperature must be > 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"KVSampler: top_p must be in (0, 1], got {top_p}")
        B, P = input_ids.shape
        dev = input_ids.device
        L = P + max_new_tokens
        valid = torch.ones(B, L, dtype=torch.bool, device=dev)
        valid[:, :P] = attention_mask.bool()
        pos = valid.long().cumsum(-1) - 1
        pos = pos.masked_fill(~valid, 1)  # generate's rule for padding (its positions reach no real token)
        probe = self.decoder.embed_tokens.weight
        cos, sin = self.decoder.rotary_emb(probe[:1].expand(B, 1, -1), pos)
        caches = [(probe.new_empty(B, self.kv_heads, L, self.head_dim), probe.new_empty(B, self.kv_heads, L, self.head_dim))
                  for _ in self.layers]
        out = torch.empty(B, L, dtype=input_ids.dtype, device=dev)
        out[:, :P] = input_ids
        unfinished = torch.ones(B, dtype=torch.long, device=dev)
        # no padding: no mask (SDPA's own causal path, as transformers passes it); with padding,
        # a decode step's mask is the keys' validity so far (its query is the newest key)
        padded = not bool(attention_mask.all())
        h = self.decoder.embed_tokens(input_ids)
        logits = self._logits(h, cos[:, :P], sin[:, :P], caches, 0, _prefill_mask(valid[:, :P]) if padded else None)
        n = 0
        for t in range(max_new_tokens):
            probs = torch.softmax(self._warp(logits, temperature, top_p), dim=-1)
            nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
            nxt = nxt * unfinished + pad_token_id * (1 - unfinished)
            out[:, P + t] = nxt
            n = t + 1
            unfinished = unfinished & (nxt != eos_token_id).long()
            if int(unfinished.max()) == 0 or n == max_new_tokens:
                break
            at = P + t
            h = self.decoder.embed_tokens(nxt[:, None])
            logits = self._logits(h, cos[:, at:at + 1], sin[:, at:at + 1], caches, at,
                                  valid[:, None, None, :at + 1] if padded else None)
        return out[:, :P + n]
