"""Causal core attention for megatron-core's local layer spec that never builds an
[S, S] tensor or a [B, 1, S, S] mask (docs/megatron.md, "Attention").

megatron-core 0.16.1's local ``DotProductAttention`` materialises the scores and the
probabilities of every head ([b * heads, S, S]) and takes an explicit boolean mask; it
also refuses packed (THD) sequences. :class:`FlashCoreAttention` replaces it in the
layer spec (``megatron.attention: flash``, the default) and calls, in order of
preference:

* CUDA with flash-attn installed and bf16/fp16 activations: ``flash_attn_varlen_func``
  for packed sequences, ``flash_attn_func`` for a padded batch (causal, native GQA);
* otherwise ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True``
  and no mask, so torch picks its flash / memory-efficient kernel (CPU included), with
  ``enable_gqa``; packed sequences run one SDPA call per sequence.

The module is causal-only. A padded batch must hold each row's tokens from position 0
(right padding): pad positions then sit after every real token, so no real token sees
them, and each pad row still has itself to attend to (no fully masked row, no NaN).
``megatron.schedule`` right-aligns micro-batches itself; an explicit attention mask is
refused rather than silently ignored.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:  # megatron-core is the ``megatron`` extra: this module is only imported with it
    from megatron.core.transformer.module import MegatronModule
except ImportError:  # pragma: no cover - the extra is missing; building the spec says so
    MegatronModule = torch.nn.Module  # type: ignore[misc,assignment]


def _flash_attn():
    """flash-attn's (varlen, dense) functions, or None when it is not installed."""
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func, flash_attn_func


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _flash_attn() is not None


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of [B, heads, S, d] queries over [B, groups, S, d] keys/values
    (groups divide heads: grouped-query attention without repeating K/V)."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[S, B, heads, d] queries, [S, B, groups, d] keys/values (Megatron's sbhd layout) ->
    [S, B, heads * d]; rows right-padded."""
    S, B, nq, d = q.shape
    if _use_flash(q):
        _, dense = _flash_attn()
        out = dense(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), softmax_scale=scale, causal=True)
        return out.transpose(0, 1).reshape(S, B, nq * d)
    out = sdpa_causal(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), scale)  # [B, nq, S, d]
    return out.permute(2, 0, 1, 3).reshape(S, B, nq * d)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float) -> torch.Tensor:
    """Packed (THD) causal attention: [T, heads, d] queries, [T, groups, d] keys/values,
    sequence ``i`` at rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` -> [T, heads * d]. No token
    attends across a sequence boundary."""
    T, nq, d = q.shape
    if _use_flash(q):
        varlen, _ = _flash_attn()
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        out = varlen(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), softmax_scale=scale, causal=True)
        return out.reshape(T, nq * d)
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            out[a:b] = sdpa_causal(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                   v[a:b].transpose(0, 1)[None], scale)[0].transpose(0, 1)
    return out.reshape(T, nq * d)


class FlashCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's ``SelfAttention`` (same constructor
    and forward signature as ``DotProductAttention``); see the module docstring."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("FlashCoreAttention has no context parallelism (megatron.layer_spec: te has)")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"FlashCoreAttention has no attention dropout (got {dropout}); RL fine-tuning uses 0")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("FlashCoreAttention has no sliding-window attention")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        d = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else d ** -0.5
        if config.apply_query_key_layer_scaling:
            raise ValueError("FlashCoreAttention does not apply query-key layer scaling")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("FlashCoreAttention takes no attention bias")
        if attention_mask is not None:
            raise ValueError("FlashCoreAttention is causal-only and takes no attention mask: right-pad the rows "
                             "(hapo_openrlhf.megatron.schedule does) or pack them (THD)")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must be THD, got {packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            return varlen_attention(query, key, value, cu, packed_seq_params.max_seqlen_q, self.softmax_scale)
        return padded_attention(query, key, value, self.softmax_scale)
