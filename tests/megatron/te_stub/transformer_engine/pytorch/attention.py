"""transformer_engine.pytorch.attention (stand-in): ``DotProductAttention`` of TE 2.20.2 in
torch (SDPA), for the layouts and mask types megatron-core's TE spec uses."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .module import _ExtraState

_CAUSAL = {"causal", "padding_causal"}
_KNOWN = {"causal", "padding_causal", "no_mask", "padding"}


class DotProductAttention(_ExtraState):
    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, bottom_right_diagonal=None, softcap: float = 0.0, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self", cp_group=None,
                 cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False, name: Optional[str] = None) -> None:
        super().__init__()
        unsupported = {"attention_dropout": attention_dropout > 0, "window_size": window_size is not None,
                       "softcap": bool(softcap), "context parallelism": cp_group is not None,
                       "softmax_type": softmax_type != "vanilla", "return_max_logit": bool(return_max_logit),
                       "cross attention": attention_type != "self"}
        if any(unsupported.values()):
            raise NotImplementedError(f"the Transformer Engine stand-in's attention does not implement "
                                      f"{[k for k, v in unsupported.items() if v]}")
        self.tp_size = tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        self.hidden_size_per_attention_head_k = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.hidden_size_per_attention_head_k ** -0.5
        self.layer_number = layer_number

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                qkv_format: Optional[str] = None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type: Optional[str] = None, window_size=None, bottom_right_diagonal=None,
                softcap=None, checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                pad_between_seqs=None, fp8_output: bool = False, bf16_backward: bool = False, num_splits=1,
                score_mod=None, score_mod_bprop=None, score_mod_tensors=None, score_mod_bprop_tensors=None,
                qkv_layer=None, kv_layer=None, qkv_interleave_dim: int = -3, thd_attention_policies=None,
                thd_attention_policy_dispatch: str = "auto") -> torch.Tensor:
        fmt = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        unsupported = {"core_attention_bias": core_attention_bias_type != "no_bias", "alibi": alibi_slopes is not None,
                       "inference_params": inference_params is not None, "fp8_output": fp8_output,
                       "score_mod": score_mod is not None, "fused qkv input": qkv_layer is not None or kv_layer is not None,
                       f"attn_mask_type {mask_type!r}": mask_type not in _KNOWN,
                       "window_size": window_size is not None}
        if any(unsupported.values()):
            raise NotImplementedError(f"the Transformer Engine stand-in's attention does not implement "
                                      f"{[k for k, v in unsupported.items() if v]}")
        q, k, v = query_layer, key_layer, value_layer
        causal = mask_type in _CAUSAL
        if fmt == "thd":
            if cu_seqlens_q is None:
                raise ValueError("thd attention needs cu_seqlens_q")
            starts = (cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q).tolist()
            lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
            out = torch.zeros_like(q)  # tokens outside every sequence (padding between them): zero
            for a, n in zip(starts[:-1], lens):
                if n > 0:
                    out[a:a + n] = self._sdpa(q[a:a + n].transpose(0, 1)[None], k[a:a + n].transpose(0, 1)[None],
                                              v[a:a + n].transpose(0, 1)[None], None, causal)[0].transpose(0, 1)
            return out.reshape(q.shape[0], -1)
        if fmt == "sbhd":
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        elif fmt == "bshd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:
            raise NotImplementedError(f"the Transformer Engine stand-in's attention has no qkv_format {fmt!r}")
        mask = None
        if mask_type.startswith("padding") and attention_mask is not None:
            mask = ~attention_mask  # TE: True = masked out
        out = self._sdpa(q, k, v, mask, causal)  # [b, h, s, d]
        out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)
        return out.reshape(*out.shape[:2], -1)

    def _sdpa(self, q, k, v, keep, causal: bool) -> torch.Tensor:
        if keep is not None and causal:
            S = q.shape[-2]
            keep = keep & torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal, scale=self.softmax_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
