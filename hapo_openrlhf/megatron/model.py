"""Megatron-core GPTModel for the supported Hugging Face families -- Qwen2, Qwen3, Llama
(``families``) -- with its log-prob + entropy forward in ``schedule.logprobs_and_entropy``
and the head that computes them in ``head``.

megatron-core is imported lazily (the ``megatron`` extra); the caller initialises
``torch.distributed`` and ``megatron.core.parallel_state`` first.
"""

from __future__ import annotations

import torch

from . import head as heads
from .convert import check_parallel_layout, padded_vocab_size
from .families import family_of, llama3_rope_factor, rope_parameters, yarn_settings


def transformer_config(hf_config, *, tp: int = 1, pp: int = 1, params_dtype=torch.float32, ep: int = 1,
                       moe: dict | None = None, **overrides):
    """Megatron ``TransformerConfig`` equal to a Hugging Face config of a supported family
    (``families.family_of``, which refuses the rest by name): RMSNorm, SwiGLU,
    grouped-query attention, RoPE, ``head_dim`` as ``kv_channels``; QKV bias for Qwen2,
    QK-norm for Qwen3. Fusions default off so the same config runs on CPU; pass
    ``overrides`` (e.g. ``bias_activation_fusion=True``, ``sequence_parallel=True``) on GPUs.
    A mixture-of-experts family adds its MoE layers (``moe.moe_config_kwargs``: ``ep`` expert
    parallel ranks, ``moe`` the router / dispatcher settings)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .moe import moe_config_kwargs

    fam = family_of(hf_config)
    check_parallel_layout(hf_config, tp, pp, ep)
    H, nq = hf_config.hidden_size, hf_config.num_attention_heads
    kw = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=H, num_attention_heads=nq,
        num_query_groups=hf_config.num_key_value_heads, ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=getattr(hf_config, "head_dim", None) or H // nq, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=fam.qkv_bias, qk_layernorm=fam.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        pipeline_dtype=params_dtype,
        # hapo's losses divide by the global normaliser themselves (schedule.forward_backward)
        calculate_per_token_loss=True,
    )
    kw.update(moe_config_kwargs(hf_config, ep=ep, tp=tp, sequence_parallel=bool(overrides.get("sequence_parallel")),
                                **(moe or {})))
    kw.update(overrides)
    return TransformerConfig(**kw)


qwen2_transformer_config = transformer_config  # the name before Qwen3 and Llama


def rope_theta(hf_config) -> float:
    return float(rope_parameters(hf_config)["rope_theta"])


ATTENTIONS = ("flash", "local")
LAYER_SPECS = ("local", "te")


def layer_spec(attention: str = "flash", spec: str = "local", qk_norm: bool = False, num_experts: int | None = None,
               grouped_gemm: bool = True):
    """The transformer-layer spec: megatron-core's local spec with its ``core_attention``
    replaced by :class:`~hapo_openrlhf.megatron.attention.FlashCoreAttention`
    (``attention="flash"``) or left as Megatron's ``DotProductAttention``
    (``"local"``: [S, S] scores, explicit mask; for comparison); or the Transformer Engine
    spec (``spec="te"``; needs transformer-engine on CUDA). ``qk_norm``: RMSNorm over
    head_dim on queries and keys (Qwen3). ``num_experts``: every layer's MLP a megatron-core
    ``MoELayer``: on the local spec ``SequentialMLP`` experts (one module and two GEMMs per
    expert); with ``spec="te"`` a ``TENorm`` before the router and ``TEGroupedMLP`` experts (one
    TE ``GroupedLinear`` per projection: one grouped GEMM for all of a rank's experts), or TE
    linears in a ``SequentialMLP`` with ``grouped_gemm=False`` (for comparison)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"megatron.attention must be one of {ATTENTIONS}, got {attention!r}")
    if spec not in LAYER_SPECS:
        raise ValueError(f"megatron.layer_spec must be one of {LAYER_SPECS}, got {spec!r}")
    if spec == "te":
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, num_experts=num_experts,
                                                              moe_grouped_gemm=bool(num_experts) and grouped_gemm)
        except (ImportError, AssertionError) as e:
            raise RuntimeError(f"megatron.layer_spec: te needs transformer-engine ({e}); use layer_spec: local") from e
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    s = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts,
                                 moe_grouped_gemm=False)
    if num_experts:
        # megatron-core's local spec names the pre-MLP norm in checkpoints as TE's fused
        # ``mlp.linear_fc1.layer_norm_weight`` even for MoE layers, where its TE spec keeps a separate
        # ``pre_mlp_layernorm`` (a TENorm before the router): keep the norm's own name, so a MoE
        # checkpoint moves between the two specs as a dense one does
        s.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    if attention == "flash":
        from .attention import FlashCoreAttention

        s.submodules.self_attention.submodules.core_attention = FlashCoreAttention
    return s


def build_gpt_model(hf_config, *, tp: int = 1, pp: int = 1, pp_rank: int = 0, params_dtype=torch.float32,
                    vocab_multiple: int = 128, attention: str = "flash", spec: str = "local", head: str = "auto",
                    ep: int = 1, moe: dict | None = None, freeze_router: bool = False, routing_replay: bool = False,
                    grouped_gemm: bool = True, **overrides):
    """A GPTModel stage for this rank, for any supported family (``hf_config.model_type``:
    ``families``; Llama 3's RoPE scaling through megatron-core's own); load weights with
    ``model.load_state_dict(hf_to_megatron(...), strict=False)`` (only ``_extra_state``
    keys may be missing).

    ``attention`` / ``spec``: :func:`layer_spec`. ``head``: ``megatron.head``
    (:func:`~.head.resolve`): ``fused`` installs the fused vocabulary-parallel head on the
    last stage (:func:`~.head.install`; the stage returns hidden states), ``logits`` keeps
    Megatron's output layer (logits shards). With PP > 1 the config sets
    ``variable_seq_lengths`` (packed micro-batches differ in length). The norms are cast
    to ``params_dtype`` (megatron-core's torch norms are built in fp32, which in a bf16
    model falls back to torch's unfused norm); the optimizer keeps fp32 masters of them.
    Mixture of experts (``families``): ``ep`` expert-parallel ranks (Megatron's parallel state
    must have been set up with them), ``moe`` router / dispatcher settings
    (``moe.moe_config_kwargs``), ``freeze_router`` keeps every router's weight fixed,
    ``routing_replay`` gives every router megatron-core's ``RouterReplay`` (``taps.RouteReplay``)."""
    from megatron.core.models.gpt import GPTModel

    from .compat import fill_known_gaps, quiet_known_notices

    quiet_known_notices()  # megatron-core 0.19's GPTModel deprecation notice (compat.py)
    fill_known_gaps()  # 0.16's MoE router without Transformer Engine (compat.py)
    overrides.setdefault("variable_seq_lengths", pp > 1)
    if routing_replay:
        if not family_of(hf_config).moe:
            raise ValueError("routing replay needs a mixture-of-experts model")
        if overrides.get("moe_router_fusion"):
            # megatron-core's fused router computes its top-k in one kernel and returns before
            # compute_topk, where RouterReplay substitutes the recorded experts: replay would be skipped
            raise ValueError("routing replay (megatron.moe.routing_replay: r3) with moe_router_fusion: the fused "
                             "router returns before megatron-core's compute_topk, which is where recorded routes "
                             "are replayed, so the replay would be skipped silently; leave moe_router_fusion off")
        overrides["moe_enable_routing_replay"] = True
    if overrides["variable_seq_lengths"] and not family_of(hf_config).moe:  # megatron-core's config check asks
        overrides.setdefault("moe_token_dispatcher_type", "alltoall")  # for it even in a dense model
    cfg = transformer_config(hf_config, tp=tp, pp=pp, params_dtype=params_dtype, ep=ep, moe=moe, **overrides)
    factor = llama3_rope_factor(hf_config)
    yarn = yarn_settings(hf_config)
    for k, v in (yarn or {}).items():  # what YarnRotaryEmbedding and the attention's mscale read off the config
        setattr(cfg, k, v)
    model = GPTModel(
        config=cfg, transformer_layer_spec=layer_spec(attention, spec, qk_norm=cfg.qk_layernorm,
                                                      num_experts=cfg.num_moe_experts, grouped_gemm=grouped_gemm),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp, vocab_multiple),
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="yarn" if yarn else "rope",
        rotary_base=rope_theta(hf_config), share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0,
        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
    )
    for m in model.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            m.to(params_dtype)
    if not cfg.perform_initialization:
        mark_tensor_parallel_weights(model)
    if freeze_router:
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.requires_grad_(False)
    if cfg.num_moe_experts:
        # megatron-core tags expert weights for its expert-parallel gradient buffers and optimizer
        # (``allreduce=False``) only at EP > 1; at EP 1 they join the dense ones, and the optimizer's
        # state -- a checkpoint's structure -- then depends on EP. Tagged at every EP, the experts
        # always have their own buffers and chained optimizer (reduced over the expert-data-parallel
        # group, which at EP 1 is the data-parallel group), so a checkpoint resumes under another EP
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.allreduce = False
    if heads.resolve(head, attention) == "fused":
        heads.install(model)
    return model


build_qwen2_gpt_model = build_gpt_model  # the name before Qwen3 and Llama


def mark_tensor_parallel_weights(model) -> None:
    """megatron-core 0.16.1 tags a tensor-parallel weight (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``) only inside its random initialisation: with
    ``perform_initialization=False`` (weights loaded right after) the tags are missing,
    and everything that reads them -- the grad norm's "count each weight once", Megatron's
    clip_grads -- treats the shards as duplicates. Tag them as initialisation would."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    from megatron.core.transformer.mlp import MLP

    # SwiGLU's fc1 holds [gate; up] per rank: megatron-core's MLP gives it stride 2
    glu_fc1 = {id(m.linear_fc1) for m in model.modules() if isinstance(m, MLP) and m.config.gated_linear_unit}
    for m in model.modules():
        dim = (0 if isinstance(m, (VocabParallelEmbedding, ColumnParallelLinear)) else
               1 if isinstance(m, RowParallelLinear) else None)
        w = getattr(m, "weight", None)
        if dim is not None and w is not None and not hasattr(w, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(w, True, dim, 2 if id(m) in glu_fc1 else 1)


def attention_inputs(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [B, S], Megatron's boolean mask [B, 1, S, S], True = masked) for a
    left- or right-padded batch given its 0/1 ``attention_mask`` [B, S]: positions count
    real tokens (as Hugging Face's generate does), attention is causal and skips padding."""
    am = attention_mask.bool()
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)
    S = am.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=am.device).tril()
    allowed = causal[None] & am[:, None, :]
    return pos, ~allowed[:, None]


def default_layout(model) -> str:
    """``"thd"`` (packed) for a model built with ``attention="flash"`` (or the TE spec),
    ``"masked"`` for Megatron's local ``DotProductAttention``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for m in model.modules():
        if isinstance(m, DotProductAttention):
            return "masked"
    return "thd"
