"""Qwen2 weights between the Hugging Face layout and Megatron-core's GPTModel layout,
split for tensor (TP) and pipeline (PP) parallelism. Pure tensor code: no process
group is needed, so conversion can run offline on one machine.

Megatron layout (local layer spec, per TP rank ``r`` of ``tp``, PP stage ``s`` of ``pp``):

* ``embedding.word_embeddings.weight`` — vocabulary rows ``r``-th slice of the
  padded vocabulary (first stage only).
* ``decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}`` — Q, K and V fused
  **per query group**: for each KV head ``g``, the ``nq / nkv`` query heads of that
  group, then ``k_g``, then ``v_g``; TP gives each rank ``nkv / tp`` whole groups.
* ``...linear_proj.weight`` — o_proj, split along its input dimension (row parallel).
* ``...mlp.linear_fc1.weight`` — ``[gate_r; up_r]``: each rank holds its slice of
  gate_proj stacked on its slice of up_proj (SwiGLU).
* ``...mlp.linear_fc2.weight`` — down_proj, split along its input dimension.
* ``...input_layernorm.weight``, ``...pre_mlp_layernorm.weight``,
  ``decoder.final_layernorm.weight`` (last stage) — replicated.
* ``output_layer.weight`` — lm_head rows, last stage; with tied embeddings it
  exists only when the last stage is not also the first (Megatron then keeps a
  copy of the embedding there).

Layers are split evenly over stages (Megatron's default offset): stage ``s`` holds
global layers ``s * L/pp ... (s+1) * L/pp - 1`` as local ``0 ... L/pp - 1``.
"""

from __future__ import annotations

from typing import Mapping

import torch


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron's rule: pad the vocabulary to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def _dims(hf_config):
    H = hf_config.hidden_size
    nq, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d = getattr(hf_config, "head_dim", None) or H // nq
    return H, nq, nkv, d


def check_parallel_layout(hf_config, tp: int, pp: int) -> None:
    _, nq, nkv, _ = _dims(hf_config)
    L, F = hf_config.num_hidden_layers, hf_config.intermediate_size
    problems = []
    if nkv % tp:
        problems.append(f"num_key_value_heads {nkv} is not divisible by tensor parallel size {tp}")
    if nq % nkv:
        problems.append(f"num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}")
    if F % tp:
        problems.append(f"intermediate_size {F} is not divisible by tensor parallel size {tp}")
    if L % pp:
        problems.append(f"num_hidden_layers {L} is not divisible by pipeline parallel size {pp}")
    if problems:
        raise ValueError("unsupported parallel layout: " + "; ".join(problems))


def _stage_layers(L: int, pp: int, stage: int) -> range:
    per = L // pp
    return range(stage * per, (stage + 1) * per)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def hf_to_megatron(hf: Mapping[str, torch.Tensor], hf_config, *, tp: int = 1, tp_rank: int = 0, pp: int = 1,
                   pp_rank: int = 0, vocab_multiple: int = 128) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one (TP rank, PP stage) from a Hugging Face Qwen2 state dict."""
    check_parallel_layout(hf_config, tp, pp)
    H, nq, nkv, d = _dims(hf_config)
    g = nq // nkv
    tied = bool(hf_config.tie_word_embeddings)
    V = padded_vocab_size(hf_config.vocab_size, tp, vocab_multiple)
    first, last = pp_rank == 0, pp_rank == pp - 1

    def split(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim)[tp_rank].clone()

    out: dict[str, torch.Tensor] = {}
    emb = _pad_rows(hf["model.embed_tokens.weight"], V)
    if first:
        out["embedding.word_embeddings.weight"] = split(emb, 0)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not tied:
            out["output_layer.weight"] = split(_pad_rows(hf["lm_head.weight"], V), 0)
        elif not first:  # tied, but the head lives on another stage than the embedding
            out["output_layer.weight"] = split(emb, 0)
    for local, i in enumerate(_stage_layers(hf_config.num_hidden_layers, pp, pp_rank)):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        q = hf[p + "self_attn.q_proj.weight"].view(nkv, g * d, H)
        k = hf[p + "self_attn.k_proj.weight"].view(nkv, d, H)
        v = hf[p + "self_attn.v_proj.weight"].view(nkv, d, H)
        out[m + "self_attention.linear_qkv.weight"] = split(torch.cat([q, k, v], 1), 0).reshape(-1, H)
        qb = hf[p + "self_attn.q_proj.bias"].view(nkv, g * d)
        kb = hf[p + "self_attn.k_proj.bias"].view(nkv, d)
        vb = hf[p + "self_attn.v_proj.bias"].view(nkv, d)
        out[m + "self_attention.linear_qkv.bias"] = split(torch.cat([qb, kb, vb], 1), 0).reshape(-1)
        out[m + "self_attention.linear_proj.weight"] = split(hf[p + "self_attn.o_proj.weight"], 1)
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [split(hf[p + "mlp.gate_proj.weight"], 0), split(hf[p + "mlp.up_proj.weight"], 0)])
        out[m + "mlp.linear_fc2.weight"] = split(hf[p + "mlp.down_proj.weight"], 1)
    return out


def megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], hf_config, *, tp: int,
                   pp: int) -> dict[str, torch.Tensor]:
    """Merge every (pp_rank, tp_rank) -> Megatron state dict back into one Hugging Face
    Qwen2 state dict (vocabulary padding dropped)."""
    missing = [(s, r) for s in range(pp) for r in range(tp) if (s, r) not in shards]
    if missing:
        raise ValueError(f"megatron_to_hf: missing shards (pp_rank, tp_rank) {missing}")
    check_parallel_layout(hf_config, tp, pp)
    H, nq, nkv, d = _dims(hf_config)
    g = nq // nkv
    Vhf = hf_config.vocab_size

    def cat(stage: int, key: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[(stage, r)][key] for r in range(tp)], dim)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": cat(0, "embedding.word_embeddings.weight", 0)[:Vhf]}
    out["model.norm.weight"] = shards[(pp - 1, 0)]["decoder.final_layernorm.weight"].clone()
    if not hf_config.tie_word_embeddings:
        out["lm_head.weight"] = cat(pp - 1, "output_layer.weight", 0)[:Vhf]
    for stage in range(pp):
        for local, i in enumerate(_stage_layers(hf_config.num_hidden_layers, pp, stage)):
            p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
            qkv = cat(stage, m + "self_attention.linear_qkv.weight", 0).view(nkv, (g + 2) * d, H)
            out[p + "self_attn.q_proj.weight"] = qkv[:, : g * d].reshape(-1, H).clone()
            out[p + "self_attn.k_proj.weight"] = qkv[:, g * d : (g + 1) * d].reshape(-1, H).clone()
            out[p + "self_attn.v_proj.weight"] = qkv[:, (g + 1) * d :].reshape(-1, H).clone()
            qkvb = cat(stage, m + "self_attention.linear_qkv.bias", 0).view(nkv, (g + 2) * d)
            out[p + "self_attn.q_proj.bias"] = qkvb[:, : g * d].reshape(-1).clone()
            out[p + "self_attn.k_proj.bias"] = qkvb[:, g * d : (g + 1) * d].reshape(-1).clone()
            out[p + "self_attn.v_proj.bias"] = qkvb[:, (g + 1) * d :].reshape(-1).clone()
            out[p + "self_attn.o_proj.weight"] = cat(stage, m + "self_attention.linear_proj.weight", 1)
            out[p + "input_layernorm.weight"] = shards[(stage, 0)][m + "input_layernorm.weight"].clone()
            out[p + "post_attention_layernorm.weight"] = shards[(stage, 0)][m + "pre_mlp_layernorm.weight"].clone()
            fc1 = [shards[(stage, r)][m + "mlp.linear_fc1.weight"].chunk(2, 0) for r in range(tp)]
            out[p + "mlp.gate_proj.weight"] = torch.cat([a for a, _ in fc1])
            out[p + "mlp.up_proj.weight"] = torch.cat([b for _, b in fc1])
            out[p + "mlp.down_proj.weight"] = cat(stage, m + "mlp.linear_fc2.weight", 1)
    return out


def gather_hf_state_dict(model, hf_config, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective over the whole job: the Hugging Face state dict of the model, on global
    rank ``dst`` (None on every other rank). The shards of the data-parallel replica that
    holds ``dst`` are sent to it (CPU copies, in the parameters' dtype) and merged with
    :func:`megatron_to_hf`; other replicas only take part in the barrier. Peak host memory
    on ``dst``: one full copy of the weights."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    group = ps.get_model_parallel_group()
    members = dist.get_process_group_ranks(group)
    if dst in members:
        sd = {k: v.detach().cpu() for k, v in model.state_dict().items()
              if not k.endswith("_extra_state") and v is not None}
        mine = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), sd)
        got = [None] * len(members) if dist.get_rank() == dst else None
        dist.gather_object(mine, got, dst=dst, group=group)
    dist.barrier()
    if dist.get_rank() != dst:
        return None
    return megatron_to_hf({(s, r): d for s, r, d in got}, hf_config, tp=tp, pp=pp)
