"""Weights of the supported families (Qwen2, Qwen3, Llama: ``families``) between the
Hugging Face layout and Megatron-core's GPTModel layout, split for tensor (TP) and
pipeline (PP) parallelism. Pure tensor code: no process group is needed, so conversion
can run offline on one machine.

Megatron layout (local layer spec, per TP rank ``r`` of ``tp``, PP stage ``s`` of ``pp``):

* ``embedding.word_embeddings.weight`` — vocabulary rows ``r``-th slice of the
  padded vocabulary (first stage only).
* ``decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}`` — Q, K and V fused
  **per query group**: for each KV head ``g``, the ``nq / nkv`` query heads of that
  group, then ``k_g``, then ``v_g``; TP gives each rank ``nkv / tp`` whole groups.
  The bias (Qwen2 only) is fused the same way.
* ``...self_attention.{q,k}_layernorm.weight`` — Qwen3's q_norm / k_norm over head_dim,
  replicated.
* ``...linear_proj.weight`` — o_proj, split along its input dimension (row parallel).
* ``...mlp.linear_fc1.weight`` — ``[gate_r; up_r]``: each rank holds its slice of
  gate_proj stacked on its slice of up_proj (SwiGLU).
* ``...mlp.linear_fc2.weight`` — down_proj, split along its input dimension.
* ``...input_layernorm.weight``, ``...pre_mlp_layernorm.weight``,
  ``decoder.final_layernorm.weight`` (last stage) — replicated.
* ``output_layer.weight`` — lm_head rows, last stage; with tied embeddings it
  exists only when the last stage is not also the first (Megatron then keeps a
  copy of the embedding there).

Transformer Engine's layer spec (``spec="te"``) fuses each layer's two norms into the
linear layer after them (``TELayerNormColumnParallelLinear``; ``input_layernorm`` and
``pre_mlp_layernorm`` become ``IdentityOp``): the same replicated tensors are then named
``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``
(:data:`TE_NORM_NAMES`). Everything else -- the fused QKV and [gate; up] layouts, Qwen3's
``q_layernorm`` / ``k_layernorm`` (``TENorm``), the final norm -- keeps its name and layout.
Megatron's distributed checkpoints already use the TE names for both specs (the local
spec's ``sharded_state_dict_keys_map``), so a checkpoint moves between specs unchanged.

Layers are split evenly over stages (Megatron's default offset): stage ``s`` holds
global layers ``s * L/pp ... (s+1) * L/pp - 1`` as local ``0 ... L/pp - 1``.
"""

from __future__ import annotations

from typing import Mapping

import torch

# the families (model_type -> what the layout needs) live in one module; re-exported here
from .families import SUPPORTED_MODEL_TYPES, check_model_type, family_of  # noqa: F401
from . import moe as moes
from .moe import to_grouped_gemm_names, to_sequential_names  # noqa: F401 - the converters' API as before


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron's rule: pad the vocabulary to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def _dims(hf_config):
    H = hf_config.hidden_size
    nq, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d = getattr(hf_config, "head_dim", None) or H // nq
    return H, nq, nkv, d


def check_parallel_layout(hf_config, tp: int, pp: int, ep: int = 1) -> None:
    _, nq, nkv, _ = _dims(hf_config)
    L, F = hf_config.num_hidden_layers, hf_config.intermediate_size
    problems = []
    if nkv % tp:
        problems.append(f"num_key_value_heads {nkv} is not divisible by tensor parallel size {tp}")
    if nq % nkv:
        problems.append(f"num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}")
    if not family_of(hf_config).moe and F % tp:
        problems.append(f"intermediate_size {F} is not divisible by tensor parallel size {tp}")
    problems += moes.check_moe_layout(hf_config, tp, ep)
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


SPECS = ("local", "te")
# the local spec's per-layer norm -> the Transformer Engine spec's fused norm (module docstring)
TE_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_FROM_TE = {v: k for k, v in TE_NORM_NAMES.items()}


def _check_spec(spec: str) -> None:
    if spec not in SPECS:
        raise ValueError(f"megatron layer spec must be one of {SPECS}, got {spec!r}")


def _rename_layer_key(key: str, names: Mapping[str, str]) -> str:
    """``decoder.layers.{i}.<name>`` (or a bare layer key) renamed through ``names``."""
    head, dot, rest = key.partition("decoder.layers.")
    i, _, name = (rest.partition(".") if dot else ("", "", key))
    if name in names:
        return f"{head}{dot}{i}.{names[name]}" if dot else names[name]
    return key


def te_norm_names(moe: bool = False) -> dict[str, str]:
    """The layer norms Transformer Engine's spec fuses into the next linear: a mixture of experts'
    ``pre_mlp_layernorm`` stays a norm of its own (the router and every expert read its output;
    megatron-core's TE spec builds a ``TENorm`` there), so only the input norm is renamed."""
    return {k: v for k, v in TE_NORM_NAMES.items() if not (moe and k.startswith("pre_mlp_layernorm"))}


def to_spec(sd: Mapping[str, torch.Tensor], spec: str, moe: bool = False,
            grouped_gemm: bool = True) -> dict[str, torch.Tensor]:
    """A Megatron state dict in the local spec's names, renamed for ``spec`` (``moe``: a mixture
    of experts' layers, :func:`te_norm_names`; on the TE spec its experts in TEGroupedMLP's names
    unless ``grouped_gemm`` is off)."""
    _check_spec(spec)
    if spec == "local":
        return dict(sd)
    names = te_norm_names(moe)
    out = {_rename_layer_key(k, names): v for k, v in sd.items()}
    return to_grouped_gemm_names(out) if moe and grouped_gemm else out


def to_local_names(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Megatron state dict of either spec in the local spec's names (what the converters read)."""
    return to_sequential_names({_rename_layer_key(k, _FROM_TE): v for k, v in sd.items()})


def spec_of(sd: Mapping[str, object]) -> str:
    """``"te"`` when the state dict's layers hold Transformer Engine's fused norms, else ``"local"``."""
    return "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in sd) else "local"


def hf_to_megatron(hf: Mapping[str, torch.Tensor], hf_config, *, tp: int = 1, tp_rank: int = 0, pp: int = 1,
                   pp_rank: int = 0, vocab_multiple: int = 128, spec: str = "local", ep: int = 1,
                   ep_rank: int = 0, grouped_gemm: bool = True) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one (TP rank, PP stage, EP rank) from a Hugging Face state dict
    of a supported family (refused by name otherwise, before any tensor is touched), named for
    the layer ``spec`` (``local`` or ``te``). MoE experts: ``moe.hf_layer_to_megatron`` (either
    Hugging Face layout)."""
    _check_spec(spec)
    fam = family_of(hf_config)
    check_parallel_layout(hf_config, tp, pp, ep)
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
        if fam.qkv_bias:
            qb = hf[p + "self_attn.q_proj.bias"].view(nkv, g * d)
            kb = hf[p + "self_attn.k_proj.bias"].view(nkv, d)
            vb = hf[p + "self_attn.v_proj.bias"].view(nkv, d)
            out[m + "self_attention.linear_qkv.bias"] = split(torch.cat([qb, kb, vb], 1), 0).reshape(-1)
        if fam.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = split(hf[p + "self_attn.o_proj.weight"], 1)
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        if fam.moe:
            out.update({m + k: v for k, v in moes.hf_layer_to_megatron(hf, i, hf_config, tp=tp, tp_rank=tp_rank,
                                                                        ep=ep, ep_rank=ep_rank).items()})
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [split(hf[p + "mlp.gate_proj.weight"], 0), split(hf[p + "mlp.up_proj.weight"], 0)])
        out[m + "mlp.linear_fc2.weight"] = split(hf[p + "mlp.down_proj.weight"], 1)
    return to_spec(out, spec, moe=fam.moe, grouped_gemm=grouped_gemm)


def megatron_to_hf(shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]], hf_config, *, tp: int,
                   pp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    """Merge every (pp_rank, tp_rank) -- with ``ep`` > 1 every (pp_rank, ep_rank, tp_rank) --
    -> Megatron state dict (either layer spec) back into one Hugging Face state dict of the
    config's family (vocabulary padding dropped; MoE experts under the checkpoint's per-expert
    names, ``moe.to_fused_names`` gives transformers' in-memory ones)."""
    keys = layer_keys(hf_config)
    want = [(s, e, r) if ep > 1 else (s, r) for s in range(pp) for e in range(ep) for r in range(tp)]
    missing = [k for k in want if k not in shards]
    if missing:
        raise ValueError(f"megatron_to_hf: missing shards {'(pp_rank, ep_rank, tp_rank)' if ep > 1 else '(pp_rank, tp_rank)'} "
                         f"{missing}")
    full = {k if ep > 1 else (k[0], 0, k[1]): to_local_names(sd) for k, sd in shards.items()}
    shards = {(s, r): full[(s, 0, r)] for s in range(pp) for r in range(tp)}  # EP rank 0 holds every dense tensor
    check_parallel_layout(hf_config, tp, pp, ep)
    moe = family_of(hf_config).moe
    H, nq, nkv, d = _dims(hf_config)
    Vhf = hf_config.vocab_size

    def cat(stage: int, key: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[(stage, r)][key] for r in range(tp)], dim)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": cat(0, "embedding.word_embeddings.weight", 0)[:Vhf]}
    out["model.norm.weight"] = shards[(pp - 1, 0)]["decoder.final_layernorm.weight"].clone()
    if not hf_config.tie_word_embeddings:
        out["lm_head.weight"] = cat(pp - 1, "output_layer.weight", 0)[:Vhf]
    for stage in range(pp):
        for local, i in enumerate(_stage_layers(hf_config.num_hidden_layers, pp, stage)):
            m = f"decoder.layers.{local}."
            out.update(_layer_to_hf(i, {k: [shards[(stage, r)][m + k] for r in range(tp)] for k in keys},
                                    hf_config))
            if moe:
                parts = {(e, r): {k[len(m):]: v for k, v in full[(stage, e, r)].items() if k.startswith(m + "mlp.")}
                         for e in range(ep) for r in range(tp)}
                out.update(moes.megatron_layer_to_hf(parts, i, hf_config))
    return out


# a Qwen2 layer's Megatron tensors (without the "decoder.layers.{i}." prefix) and the
# dimension TP splits them along (None: replicated); layer_keys() for any family
LAYER_KEYS = {"self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
              "self_attention.linear_proj.weight": 1, "input_layernorm.weight": None,
              "pre_mlp_layernorm.weight": None, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1}


def layer_keys(hf_config) -> dict[str, int | None]:
    """:data:`LAYER_KEYS` for the config's family: no QKV bias outside Qwen2, QK-norm weights for Qwen3."""
    fam = family_of(hf_config)
    keys = {k: v for k, v in LAYER_KEYS.items() if (fam.qkv_bias or not k.endswith("linear_qkv.bias"))
            and not (fam.moe and k.startswith("mlp."))}  # a MoE layer's experts: moe.megatron_layer_to_hf
    if fam.moe:
        keys["mlp.router.weight"] = None  # replicated over TP and EP
    if fam.qk_norm:
        keys.update({"self_attention.q_layernorm.weight": None, "self_attention.k_layernorm.weight": None})
    return keys


def _layer_to_hf(i: int, parts: Mapping[str, list[torch.Tensor]], hf_config) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of global layer ``i`` from its Megatron tensors, one per TP rank."""
    H, nq, nkv, d = _dims(hf_config)
    g = nq // nkv
    p = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    qkv = torch.cat(parts["self_attention.linear_qkv.weight"], 0).view(nkv, (g + 2) * d, H)
    out[p + "self_attn.q_proj.weight"] = qkv[:, : g * d].reshape(-1, H).clone()
    out[p + "self_attn.k_proj.weight"] = qkv[:, g * d : (g + 1) * d].reshape(-1, H).clone()
    out[p + "self_attn.v_proj.weight"] = qkv[:, (g + 1) * d :].reshape(-1, H).clone()
    if "self_attention.linear_qkv.bias" in parts:
        qkvb = torch.cat(parts["self_attention.linear_qkv.bias"], 0).view(nkv, (g + 2) * d)
        out[p + "self_attn.q_proj.bias"] = qkvb[:, : g * d].reshape(-1).clone()
        out[p + "self_attn.k_proj.bias"] = qkvb[:, g * d : (g + 1) * d].reshape(-1).clone()
        out[p + "self_attn.v_proj.bias"] = qkvb[:, (g + 1) * d :].reshape(-1).clone()
    if "self_attention.q_layernorm.weight" in parts:
        out[p + "self_attn.q_norm.weight"] = parts["self_attention.q_layernorm.weight"][0].clone()
        out[p + "self_attn.k_norm.weight"] = parts["self_attention.k_layernorm.weight"][0].clone()
    out[p + "self_attn.o_proj.weight"] = torch.cat(parts["self_attention.linear_proj.weight"], 1)
    out[p + "input_layernorm.weight"] = parts["input_layernorm.weight"][0].clone()
    out[p + "post_attention_layernorm.weight"] = parts["pre_mlp_layernorm.weight"][0].clone()
    if "mlp.router.weight" in parts:  # a mixture of experts: the router here, the experts in moe
        out[p + "mlp.gate.weight"] = parts["mlp.router.weight"][0].clone()
        return out
    fc1 = [t.chunk(2, 0) for t in parts["mlp.linear_fc1.weight"]]
    out[p + "mlp.gate_proj.weight"] = torch.cat([a for a, _ in fc1])
    out[p + "mlp.up_proj.weight"] = torch.cat([b for _, b in fc1])
    out[p + "mlp.down_proj.weight"] = torch.cat(parts["mlp.linear_fc2.weight"], 1)
    return out


def hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor's name and shape (the config's family), in the order
    :func:`stream_hf_tensors` produces them (so a receiver can allocate before the data arrives)."""
    fam = family_of(hf_config)
    H, nq, nkv, d = _dims(hf_config)
    F, V = hf_config.intermediate_size, hf_config.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (nq * d, H), p + "self_attn.k_proj.weight": (nkv * d, H),
                    p + "self_attn.v_proj.weight": (nkv * d, H)})
        if fam.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (nq * d,), p + "self_attn.k_proj.bias": (nkv * d,),
                        p + "self_attn.v_proj.bias": (nkv * d,)})
        if fam.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        out.update({p + "self_attn.o_proj.weight": (H, nq * d), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
        if fam.moe:
            out.update(moes.hf_layer_shapes(i, hf_config))
        else:
            out.update({p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                        p + "mlp.down_proj.weight": (H, F)})
    out["model.norm.weight"] = (H,)
    if not hf_config.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out


def stream_hf_tensors(model, hf_config, fn, *, dst: int = 0) -> int:
    """Collective over the whole job: call ``fn(name, tensor)`` on global rank ``dst``
    for every Hugging Face tensor of the model, one tensor at a time, in
    :func:`hf_shapes` order; returns how many (0 on other ranks).

    Nothing is pickled and no whole-model copy is made: for each layer (and the
    embedding / final norm / head) the owning pipeline stage all-gathers its TP shards
    on the device, its TP rank 0 converts them to the Hugging Face layout, and each
    tensor goes to ``dst`` with a point-to-point send (``dst``'s own stage hands it
    over directly). Peak extra memory: one layer's weights. Only the data-parallel
    replica that holds ``dst`` (which must be its TP rank 0 on the first stage) takes
    part; the other replicas wait at the closing barrier. A mixture-of-experts model's
    experts come from the expert-parallel ranks that hold them (``moe.ExpertStream``),
    after each layer's other tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    moe = family_of(hf_config).moe
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    rank = dist.get_rank()
    sent = 0
    in_mp = dst in dist.get_process_group_ranks(ps.get_model_parallel_group())
    experts = None
    if moe:  # who holds which experts: every rank's (stage, EP rank, expert-TP rank, expert-DP rank)
        experts = moes.ExpertStream(model, hf_config, dst)
    if in_mp or (experts is not None and experts.takes_part):
        tp_rank, stage = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        if rank == dst and (tp_rank, stage) != (0, 0):
            raise ValueError(f"stream_hf_tensors: rank {dst} must be TP rank 0 of the first pipeline stage")
        tp_group = ps.get_tensor_model_parallel_group()
        # on dst: the global rank of each stage's TP rank 0 (dst's pipeline group, by stage)
        owners = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if rank == dst else None
        sd = to_local_names({k: v for k, v in model.state_dict(keep_vars=True).items()
                             if not k.endswith("_extra_state")})
        shapes, keys = hf_shapes(hf_config), layer_keys(hf_config)
        if not in_mp:  # an expert-parallel rank outside dst's replica: only its experts go out
            tp_rank, owners = -1, None
        ref = next(model.parameters())

        def gather(t: torch.Tensor, dim) -> list[torch.Tensor]:
            if dim is None or tp == 1:
                return [t.detach()]
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
            return parts

        def emit(s: int, names: list[str], make) -> None:
            """Stage ``s`` produces ``names``: ``make()`` (a collective over the stage's TP
            group) converts them; TP rank 0 sends each to dst."""
            nonlocal sent
            if not in_mp:
                return
            items = make() if stage == s else {}
            owner = stage == s and tp_rank == 0
            if rank == dst:
                for n in names:
                    if owner:
                        t = items[n]
                    else:
                        t = torch.empty(shapes[n], dtype=ref.dtype, device=ref.device)
                        dist.recv(t, src=owners[s])
                    fn(n, t)
                    sent += 1
            elif owner:
                for n in names:
                    dist.send(items[n].contiguous(), dst=dst)

        V, tied = hf_config.vocab_size, bool(hf_config.tie_word_embeddings)
        emit(0, ["model.embed_tokens.weight"],
             lambda: {"model.embed_tokens.weight": torch.cat(gather(sd["embedding.word_embeddings.weight"], 0))[:V]})
        for s in range(pp):
            for local, i in enumerate(_stage_layers(hf_config.num_hidden_layers, pp, s)):
                def layer(i=i, local=local):
                    parts = {k: gather(sd[f"decoder.layers.{local}." + k], dim) for k, dim in keys.items()}
                    return _layer_to_hf(i, parts, hf_config) if tp_rank == 0 else {}

                emit(s, [n for n in shapes if n.startswith(f"model.layers.{i}.") and ".experts." not in n], layer)
                if experts is not None:
                    sent += experts.emit(s, i, local, fn)

        def head():
            out = {"model.norm.weight": sd["decoder.final_layernorm.weight"].detach()}
            if not tied:
                out["lm_head.weight"] = torch.cat(gather(sd["output_layer.weight"], 0))[:V]
            return out

        emit(pp - 1, ["model.norm.weight"] + ([] if tied else ["lm_head.weight"]), head)
    dist.barrier()
    return sent


def gather_hf_state_dict(model, hf_config, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective over the whole job: the Hugging Face state dict of the model, on global
    rank ``dst`` as CPU tensors in the parameters' dtype (None on every other rank),
    built with :func:`stream_hf_tensors` (no pickled shards). Peak host memory on
    ``dst``: one full copy of the weights (what saving a model needs)."""
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    stream_hf_tensors(model, hf_config, lambda n, t: out.__setitem__(n, t.detach().cpu().clone()), dst=dst)
    return out if dist.get_rank() == dst else None
