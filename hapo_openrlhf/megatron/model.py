"""Megatron-core GPTModel for the Qwen2 family, and its log-prob + entropy forward.

megatron-core is imported lazily (the ``megatron`` extra); the caller initialises
``torch.distributed`` and ``megatron.core.parallel_state`` first.
"""

from __future__ import annotations

import torch

from ..algos.entropy import DEFAULT_CHUNK
from ..algos.vocab_parallel import vocab_parallel_logprobs_entropy
from .convert import check_parallel_layout, padded_vocab_size


def qwen2_transformer_config(hf_config, *, tp: int = 1, pp: int = 1, params_dtype=torch.float32, **overrides):
    """Megatron ``TransformerConfig`` equal to a Hugging Face ``Qwen2Config``: RMSNorm,
    SwiGLU, bias on QKV only, grouped-query attention, RoPE. Fusions default off so
    the same config runs on CPU; pass ``overrides`` (e.g. ``bias_activation_fusion=True``,
    ``sequence_parallel=True``) on GPUs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel_layout(hf_config, tp, pp)
    H, nq = hf_config.hidden_size, hf_config.num_attention_heads
    kw = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=H, num_attention_heads=nq,
        num_query_groups=hf_config.num_key_value_heads, ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=getattr(hf_config, "head_dim", None) or H // nq, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        pipeline_dtype=params_dtype,
        # hapo's losses divide by the global normaliser themselves (schedule.forward_backward)
        calculate_per_token_loss=True,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def rope_theta(hf_config) -> float:
    rp = getattr(hf_config, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def build_qwen2_gpt_model(hf_config, *, tp: int = 1, pp: int = 1, pp_rank: int = 0, params_dtype=torch.float32,
                          vocab_multiple: int = 128, **overrides):
    """A GPTModel stage (local layer spec) for this rank; load weights with
    ``model.load_state_dict(hf_to_megatron(...), strict=False)`` (only ``_extra_state``
    keys may be missing)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = qwen2_transformer_config(hf_config, tp=tp, pp=pp, params_dtype=params_dtype, **overrides)
    return GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp, vocab_multiple),
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=rope_theta(hf_config), share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
    )


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


def logprobs_and_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, vocab_size: int,
                         temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK, tp_group=None,
                         tp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropy [B, S-1] (fp32) of a single-stage (or last-stage
    with ``pp == 1``) GPTModel whose output layer is vocabulary-parallel: each TP rank
    reduces its own vocabulary shard (``vocab_parallel_logprobs_entropy``), the full
    vocabulary is never gathered."""
    pos, mask = attention_inputs(attention_mask)
    logits = model(input_ids=input_ids, position_ids=pos, attention_mask=mask)  # [B, S, V / tp]
    return shard_logprobs_entropy(logits, input_ids, vocab_size=vocab_size, temperature=temperature,
                                  chunk_size=chunk_size, tp_group=tp_group, tp_rank=tp_rank)


def shard_logprobs_entropy(logits: torch.Tensor, input_ids: torch.Tensor, *, vocab_size: int, temperature: float,
                           chunk_size: int, tp_group, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropy [B, S-1] from this rank's output shard
    ``logits [B, S, V / tp]`` (the shift and the shard's vocabulary offset in one place)."""
    return vocab_parallel_logprobs_entropy(
        logits[:, :-1], input_ids[:, 1:], vocab_start=tp_rank * logits.shape[-1], vocab_size=vocab_size,
        group=tp_group, temperature=temperature, chunk_size=chunk_size)
