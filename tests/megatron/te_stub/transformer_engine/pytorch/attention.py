"""transformer_engine.pytorch.attention (stand-in): ``DotProductAttention`` of TE 2.20.2 in
torch (SDPA), for the layouts and mask types megatron-core's TE spec uses.

Context parallelism (issue 58): given ``cp_group``, the THD layout's inputs are this CP rank's
share of the packed batch as TE's ``attn_forward_func_with_cp`` takes it -- each sequence padded to
a multiple of 2 CP (``cu_seqlens_q_padded``, global, like ``cu_seqlens_q``), cut into 2 CP chunks,
rank r holding chunks r and 2 CP - 1 - r in that order (TE's DualChunkSwap,
``thd_get_partitioned_indices``) -- and the output is exact attention over the whole sequence for
the rank's own tokens, zero on padding. TE computes it with a ring of K/V exchanges overlapped with
compute (``p2p``), an all-gather (``all_gather``) or head-scattering all-to-alls (``a2a``); all three
give that result, which the stand-in computes one way: it all-gathers K and V inside the CP group
(backward: the gathered gradient all-reduced, each rank keeping its share). What it cannot show is
TE's: the overlap, the kernels' numerics, memory per rank. CP on the ``sbhd`` / ``bshd`` layouts is
refused by name. ``a2a+p2p`` (``cp_group`` = [a2a group, p2p group]) fails on THD as TE's
``attn_forward_func_with_cp`` fails (the same assertions, TE 1.12 to 2.x: THD is not supported with
the hierarchical implementation); on the other layouts the stand-in refuses it with them."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .module import _ExtraState

_CAUSAL = {"causal", "padding_causal"}
_KNOWN = {"causal", "padding_causal", "no_mask", "padding"}
# TE's cp_comm_type values the stand-in computes (exact attention; see the module docstring)
_CP_COMM = ("p2p", "all_gather", "a2a")


def _partitioned_indices(cu_seqlens_padded: list[int], cp: int, rank: int) -> torch.Tensor:
    """Where CP rank ``rank``'s tokens sit in the padded packed batch: per sequence, chunk ``rank``
    then chunk 2 CP - 1 - ``rank`` of its 2 CP equal chunks (TE ``thd_get_partitioned_indices``)."""
    out = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
        if (end - start) % (2 * cp):
            raise ValueError(f"a THD sequence padded to {end - start} tokens does not split into 2 x {cp} chunks "
                             f"(TE: every sequence length must be, or be padded to be, divisible by cp_size * 2)")
        c = (end - start) // (2 * cp)
        out += [torch.arange(start + k * c, start + (k + 1) * c) for k in (rank, 2 * cp - 1 - rank)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class _GatherCP(torch.autograd.Function):
    """[T_rank, ...] -> [CP, T_rank, ...]: every CP rank's share (all-gather); backward: the
    gradient of the gathered tensor summed over the group (all-reduce), this rank's share kept."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group, ctx.rank = group, torch.distributed.get_rank(group)
        parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


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
                       "softcap": bool(softcap),
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
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p",
                                   load_balancing_strategy=None) -> None:
        """TE's (``load_balancing_strategy``: TE's default, DualChunkSwap, the only one the stand-in
        computes; ``None`` here stands for it)."""
        strategy = getattr(load_balancing_strategy, "name", load_balancing_strategy)
        unsupported = {f"cp_comm_type {cp_comm_type!r}": cp_group is not None and cp_comm_type not in (*_CP_COMM,
                                                                                                          "a2a+p2p"),
                       f"load_balancing_strategy {strategy!r}": strategy not in (None, "DUAL_CHUNK_SWAP")}
        if any(unsupported.values()):
            raise NotImplementedError(f"the Transformer Engine stand-in's attention does not implement "
                                      f"{[k for k, v in unsupported.items() if v]}")
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (cp_group, cp_global_ranks,
                                                                                   cp_stream, cp_comm_type)

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
        if self.cp_group is not None and self.cp_comm_type == "a2a+p2p":  # TE's attn_forward_func_with_cp
            assert isinstance(self.cp_group, list) and len(self.cp_group) == 2, \
                "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!"
            assert fmt != "thd", f"{fmt} format is not supported with hierarchical CP implementation yet!"
            raise NotImplementedError(f"the Transformer Engine stand-in's attention does not implement context "
                                      f"parallelism on qkv_format {fmt!r} (THD only)")
        cp = 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)
        if cp > 1:
            if fmt != "thd":
                raise NotImplementedError(f"the Transformer Engine stand-in's attention does not implement context "
                                          f"parallelism on qkv_format {fmt!r} (THD only)")
            if "padding" not in mask_type:  # TE asserts the same
                raise ValueError(f"THD format requires padding mask type, got {mask_type}!")
            return self._thd_cp(q, k, v, cu_seqlens_q, cu_seqlens_q_padded, causal, cp)
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

    def _thd_cp(self, q, k, v, cu_seqlens_q, cu_seqlens_q_padded, causal: bool, cp: int) -> torch.Tensor:
        """This CP rank's tokens [T / CP, h, d] -> their attention output [T / CP, h * d] (module docstring)."""
        if cu_seqlens_q is None:
            raise ValueError("thd attention needs cu_seqlens_q")
        real = cu_seqlens_q.tolist()
        padded = (cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q).tolist()
        rank = torch.distributed.get_rank(self.cp_group)
        mine = _partitioned_indices(padded, cp, rank)
        if mine.numel() != q.shape[0]:
            raise ValueError(f"CP rank {rank} holds {q.shape[0]} tokens; cu_seqlens_q_padded gives it {mine.numel()}")
        # K and V of the whole padded batch, in its order, from every rank's share
        where = torch.cat([_partitioned_indices(padded, cp, r) for r in range(cp)])
        order = torch.empty_like(where)
        order[where] = torch.arange(where.numel())
        k_all, v_all = (_GatherCP.apply(t, self.cp_group).flatten(0, 1)[order] for t in (k, v))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        groups = q.shape[1] // k.shape[1]
        for a, n in zip(padded[:-1], (e - s for s, e in zip(real[:-1], real[1:]))):
            rel = mine - a
            held = ((rel >= 0) & (rel < n)).nonzero().flatten()  # this rank's real tokens of the sequence
            if n == 0 or held.numel() == 0:
                continue
            ks, vs = (t[a:a + n].repeat_interleave(groups, dim=1) for t in (k_all, v_all))  # [n, h, d]
            scores = torch.einsum("ihd,jhd->hij", q[held], ks) * self.softmax_scale
            if causal:
                scores = scores.masked_fill(torch.arange(n)[None, None, :] > rel[held][None, :, None], float("-inf"))
            out[held] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), vs)
        return out.reshape(q.shape[0], -1)

    def _sdpa(self, q, k, v, keep, causal: bool) -> torch.Tensor:
        if keep is not None and causal:
            S = q.shape[-2]
            keep = keep & torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal, scale=self.softmax_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
