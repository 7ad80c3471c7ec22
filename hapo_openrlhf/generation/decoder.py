"""The embedded trainer's forward for Qwen2 / Qwen3 / Llama decoders, written with the model's
own weights (issue 40): the sampler's prefill and decode step, and the scoring and training
forwards over padded batches, without spending arithmetic on padding.

It computes what the Hugging Face model computes -- embedding, RMS norms, Q/K/V/O projections
(biases included), QK-norms (Qwen3), the rotary table of the model's ``rotary_emb`` (its
scaling included), SDPA attention with the causal and key-padding mask, the MLP with the
model's activation, the final norm -- and differs in how:
* the projections and MLPs run on the real tokens only (``[N, H]``, the padding dropped);
  attention runs on the padded ``[B, L]`` layout (it is a small part at these sizes);
* the Q/K/V and gate/up projections are one matrix product each (the weights concatenated
  once per forward; the concatenation is differentiable, so gradients reach each weight);
* the norms are ``torch.rms_norm``; the rotary embedding is applied to queries and keys
  together, ``rotate_half(x) * sin`` as ``flip(halves of x) * (sign * sin)``.

``tests/generation/test_decoder.py`` checks hidden states, log-probs, entropy and every weight's
gradient against transformers' own model (float tolerance) for every family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("qwen2", "qwen3", "llama")


def unsupported(model) -> str | None:
    """Why this model cannot run here (None: it can); callers fall back to the Hugging Face
    forward / ``generate``."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not supported (only {', '.join(SUPPORTED)})"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention is not supported"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        return "attention dropout is not supported"
    for layer in model.get_decoder().layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if type(lin) is not torch.nn.Linear:  # quantised or adapter-wrapped layers: not plain weights
                return f"layer {type(lin).__name__} is not a plain torch.nn.Linear"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"output layer {type(head).__name__} is not a plain torch.nn.Linear"
    return None


@dataclass
class Layer:
    """One decoder layer's weights, the projections concatenated."""

    ln1: torch.Tensor
    eps1: float
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [Hq + Hkv, d]: q_norm's weight for query heads, k_norm's for key heads
    qk_eps: float
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    eps2: float
    gu_w: torch.Tensor
    gu_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    act: object


def _cat_bias(*linears) -> torch.Tensor | None:
    bs = [m.bias for m in linears]
    if all(b is None for b in bs):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(bs, linears)])


class Decoder:
    """Forwards of one ``*ForCausalLM`` model of a supported family; its weights are read at
    every call (training changes them)."""

    def __init__(self, model) -> None:
        why = unsupported(model)
        if why:
            raise ValueError(f"local decoder: {why}")
        self.model = model
        self.decoder = model.get_decoder()
        attn = self.decoder.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.q_heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.scaling = attn.scaling
        half = self.head_dim // 2
        self.sign = torch.cat([torch.full((half,), -1.0), torch.ones(half)]).to(self.decoder.embed_tokens.weight.device)

    def layers(self) -> list[Layer]:
        out = []
        for layer in self.decoder.layers:
            a, m = layer.self_attn, layer.mlp
            qk_norm = None
            if hasattr(a, "q_norm"):
                qk_norm = torch.cat([a.q_norm.weight.expand(self.q_heads, -1), a.k_norm.weight.expand(self.kv_heads, -1)])
            out.append(Layer(
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), _cat_bias(a.q_proj, a.k_proj, a.v_proj),
                qk_norm, a.q_norm.variance_epsilon if qk_norm is not None else 0.0,
                a.o_proj.weight, a.o_proj.bias,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), _cat_bias(m.gate_proj, m.up_proj),
                m.down_proj.weight, m.down_proj.bias, m.act_fn))
        return out

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sign * sin) ``[*pos.shape, d]`` for integer positions ``pos`` (2-D)."""
        emb = self.decoder.embed_tokens.weight
        cos, sin = self.decoder.rotary_emb(emb[:1].expand(pos.shape[0], 1, -1), pos)
        return cos, sin * self.sign.to(sin.dtype)

    def qkv(self, w: Layer, h, cos, sin):
        """Queries and keys with the rotary embedding, and values: ``[..., Hq + Hkv, d]``,
        ``[..., Hkv, d]`` for hidden states ``[..., H]`` and ``cos``/``sin`` ``[..., d]``."""
        x = F.rms_norm(h, (h.shape[-1],), w.ln1, w.eps1)
        qkv = F.linear(x, w.qkv_w, w.qkv_b).unflatten(-1, (-1, self.head_dim))
        nqk = self.q_heads + self.kv_heads
        qk, v = qkv[..., :nqk, :], qkv[..., nqk:, :]
        if w.qk_norm is not None:
            qk = F.rms_norm(qk, (self.head_dim,), None, w.qk_eps) * w.qk_norm
        half = qk.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # rotate_half without its sign (in sin)
        return torch.addcmul(qk * cos.unsqueeze(-2), half, sin.unsqueeze(-2)), v

    @staticmethod
    def mlp_residual(w: Layer, h):
        x = F.rms_norm(h, (h.shape[-1],), w.ln2, w.eps2)
        g, u = F.linear(x, w.gu_w, w.gu_b).chunk(2, dim=-1)
        return h + F.linear(w.act(g) * u, w.down_w, w.down_b)

    def norm(self, h):
        return self.decoder.norm(h)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, keep_kv: bool = False,
                prompt_len: int | None = None):
        """(last hidden states ``[B, L, H]`` after the final norm, 0 on padding; with
        ``keep_kv`` each layer's keys and values ``[B, Hkv, L, d]``, 0 on padding) of a
        padded batch; positions are the mask's cumulative sum (``generate``'s and the
        scoring forward's rule). Differentiable.

        ``prompt_len``: columns ``[0, prompt_len)`` are prompts, the rest responses (a
        rollout's layout). Rows whose prompts are equal (ids and mask: a group's G samples)
        then share one forward of the prompt -- its hidden states and keys/values, which no
        response token can change (causal attention) -- and only the responses run per row;
        the gradient through the shared prompt is the sum over its rows, as in the per-row
        forward."""
        if prompt_len is not None and not keep_kv and 0 < prompt_len < input_ids.shape[1]:
            shared = self._shared_prompt_forward(input_ids, attention_mask, prompt_len)
            if shared is not None:
                return shared
        return self._rows_forward(input_ids, attention_mask, keep_kv)

    def _mask(self, keep_q: torch.Tensor, keep_k: torch.Tensor, offset: int) -> torch.Tensor:
        """``[B, 1, Lq, Lk]`` attention mask: query i (at key position ``offset + i``)
        attends to valid keys at or before it; a padded query attends to itself only (no
        all-masked row, no NaN)."""
        Lq, Lk = keep_q.shape[1], keep_k.shape[1]
        iq = torch.arange(Lq, device=keep_q.device)[:, None] + offset
        ik = torch.arange(Lk, device=keep_q.device)[None, :]
        return (((ik <= iq)[None] & keep_k[:, None, :]) | (ik == iq)[None])[:, None]

    def _layer_heads(self, w: Layer, h, cos, sin, keep):
        """Queries, keys and values ``[B, heads, Lq, d]`` of one layer for the real tokens
        ``h [N, H]`` scattered to the padded layout ``keep [B, Lq]`` (0 on padding)."""
        nqk = self.q_heads + self.kv_heads
        qk, v = self.qkv(w, h, cos, sin)
        heads = h.new_zeros(*keep.shape, nqk + self.kv_heads, self.head_dim).index_put((keep,), torch.cat([qk, v], 1))
        q, k, v = heads[:, :, :self.q_heads], heads[:, :, self.q_heads:nqk], heads[:, :, nqk:]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend_residual(self, w: Layer, h, q, k, v, mask, keep):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                           enable_gqa=self.q_heads != self.kv_heads)
        h = h + F.linear(o.transpose(1, 2)[keep].flatten(1), w.o_w, w.o_b)
        return self.mlp_residual(w, h)

    def _shared_prompt_forward(self, input_ids, attention_mask, P: int):
        B, L = input_ids.shape
        pmask = attention_mask[:, :P]
        _, group = torch.unique(torch.cat([input_ids[:, :P] * pmask, pmask], 1), dim=0, return_inverse=True)
        U = int(group.max()) + 1
        if U == B:  # no two rows share a prompt
            return None
        first = torch.zeros(U, dtype=torch.long, device=group.device).scatter_reduce_(
            0, group, torch.arange(B, device=group.device), "amin", include_self=False)
        h_prompt, kvs = self._rows_forward(input_ids[first, :P], pmask[first], keep_kv=True)
        keep_p = pmask.bool()
        keep = attention_mask[:, P:].bool()
        pos = (attention_mask.long().cumsum(-1) - 1)[:, P:]
        cos, sin = self.rope(pos[keep][None])
        cos, sin = cos[0], sin[0]
        h = F.embedding(input_ids[:, P:][keep], self.decoder.embed_tokens.weight)  # [N, H]: real response tokens
        mask = self._mask(keep, torch.cat([keep_p, keep], 1), offset=P)
        for w, (kp, vp) in zip(self.layers(), kvs):
            q, k, v = self._layer_heads(w, h, cos, sin, keep)
            k, v = torch.cat([kp[group], k], 2), torch.cat([vp[group], v], 2)
            h = self._attend_residual(w, h, q, k, v, mask, keep)
        out = h.new_zeros(B, L - P, h.shape[-1]).index_put((keep,), self.norm(h))
        return torch.cat([h_prompt[group], out], 1)

    def _rows_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep_kv: bool):
        B, L = input_ids.shape
        keep = attention_mask.bool()
        if not bool(keep.any(-1).all()):
            raise ValueError("local decoder: a row has no attended token")
        pos = attention_mask.long().cumsum(-1) - 1
        cos, sin = self.rope(pos[keep][None])
        cos, sin = cos[0], sin[0]
        h = F.embedding(input_ids[keep], self.decoder.embed_tokens.weight)  # [N, H]: the real tokens
        mask = self._mask(keep, keep, offset=0)
        kvs = []
        for w in self.layers():
            q, k, v = self._layer_heads(w, h, cos, sin, keep)
            h = self._attend_residual(w, h, q, k, v, mask, keep)
            if keep_kv:
                kvs.append((k, v))
        out = h.new_zeros(B, L, h.shape[-1]).index_put((keep,), self.norm(h))
        return (out, kvs) if keep_kv else out
