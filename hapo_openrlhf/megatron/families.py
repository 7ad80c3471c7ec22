"""The Hugging Face model families the Megatron back end builds and converts, and what
each one needs: one place for the model builder (``model.build_gpt_model``), the weight
converter (``convert``), ``hapo doctor`` and the actor's start-up checks.

Every supported family is a dense decoder with pre-norm RMSNorm, SwiGLU, grouped-query
attention and RoPE, which megatron-core's GPTModel expresses with its own config flags:

=========  ========  =======  ============================  ==================================
family     QKV bias  QK-norm  head_dim                      RoPE
=========  ========  =======  ============================  ==================================
qwen2      yes       no       hidden / heads (or the key)   default
qwen3      no        yes      the config's (may differ)     default
llama      no        no       the config's (may differ)     default or llama3 (Llama 3.1-3.3)
qwen3_moe  no        yes      the config's (may differ)     default
=========  ========  =======  ============================  ==================================

``qwen3_moe`` (Qwen3-MoE) replaces every layer's MLP with a mixture of experts: a top-k
softmax router (``mlp.gate``, no bias, no shared expert) over ``num_experts`` SwiGLU experts
of width ``moe_intermediate_size``; ``norm_topk_prob`` renormalises the k probabilities
(megatron-core's router: top-k before the softmax), else they are the softmax's over all
experts (``moe_router_pre_softmax``). Layouts with dense layers between sparse ones
(``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused.

:func:`family_of` refuses, by name and before any weight is read, a ``model_type``
outside this table and a supported family's variant that the GPTModel built here would
compute differently from Hugging Face: biases beyond Qwen2's QKV bias
(``attention_bias`` / ``mlp_bias``), sliding-window layers, an activation other than
SiLU, and RoPE scaling other than llama3 with megatron-core's fixed low/high frequency
factors and original context (megatron-core 0.16.1 takes only the factor; the other
three are constants in ``RotaryEmbedding._apply_scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MegatronConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    label: str
    qkv_bias: bool  # q/k/v projections carry a bias (o_proj and the MLP never do)
    qk_norm: bool  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3)
    moe: bool = False  # every layer's MLP is a mixture of experts (Qwen3-MoE)


FAMILIES = {
    "qwen2": Family("qwen2", "Qwen2 / Qwen2.5", qkv_bias=True, qk_norm=False),
    "qwen3": Family("qwen3", "Qwen3 (dense)", qkv_bias=False, qk_norm=True),
    "llama": Family("llama", "Llama 2 / 3.x", qkv_bias=False, qk_norm=False),
    "qwen3_moe": Family("qwen3_moe", "Qwen3-MoE", qkv_bias=False, qk_norm=True, moe=True),
}


@dataclass(frozen=True)
class MoE:
    num_experts: int
    top_k: int
    ffn: int  # each expert's intermediate size
    norm_topk_prob: bool


def num_experts(hf_config) -> int:
    """The expert count of a MoE config: ``num_experts`` (Qwen's releases write it in config.json)
    or ``num_local_experts`` (what transformers 5.15 writes for it: Qwen3MoeConfig's attribute_map),
    from a config object or a raw config.json namespace alike; 0 when neither is there."""
    for key in ("num_experts", "num_local_experts"):
        v = getattr(hf_config, key, None)
        if v:
            return int(v)
    return 0


def moe_of(hf_config) -> MoE | None:
    """The mixture-of-experts dimensions of a MoE family's config (None for a dense family)."""
    if not check_model_type(getattr(hf_config, "model_type", None)).moe:
        return None
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
               if getattr(hf_config, k, None) is None] + ([] if num_experts(hf_config) else ["num_experts"])
    if missing:
        raise ValueError(f"the {getattr(hf_config, 'model_type', None)} config lacks {', '.join(missing)}")
    return MoE(num_experts(hf_config), int(hf_config.num_experts_per_tok), int(hf_config.moe_intermediate_size),
               bool(hf_config.norm_topk_prob))
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# megatron-core 0.16.1's llama3 RoPE scaling: only ``factor`` is a parameter
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_model_type(model_type) -> Family:
    """The family of a Hugging Face ``model_type``, or a named refusal listing the supported ones."""
    if model_type not in FAMILIES:
        names = ", ".join(f"{k} ({f.label})" for k, f in FAMILIES.items())
        raise ValueError(f"backend: megatron supports Hugging Face model_type {names}; got {model_type!r}. "
                         f"Use backend: openrlhf (DeepSpeed, any Hugging Face causal LM) for other families")
    return FAMILIES[model_type]


def rope_parameters(hf_config) -> dict:
    """The config's RoPE parameters (transformers 5's ``rope_parameters``; older
    configs' ``rope_scaling`` / ``rope_theta``)."""
    raw = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"the model config's rope_parameters / rope_scaling must be a mapping, got {type(raw).__name__}")
    rp = dict(raw)
    rp.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def llama3_rope_factor(hf_config) -> float | None:
    """megatron-core's ``rope_scaling_factor`` for a llama3-scaled config, None without scaling."""
    rp = rope_parameters(hf_config)
    return float(rp["factor"]) if rp["rope_type"] == "llama3" else None


def yarn_settings(hf_config) -> dict | None:
    """megatron-core's YaRN settings (its ``YarnRotaryEmbedding``, read from the config's ``yarn_*``
    attributes) for a YaRN-scaled config, None without YaRN. transformers' ``_compute_yarn_parameters``
    and megatron-core compute the same frequencies -- interpolated by ``factor`` below the correction
    range of ``beta_fast`` / ``beta_slow`` rotations in the ``original_max_position_embeddings``,
    extrapolated above, a linear ramp between (``truncate``: its ends rounded outwards, megatron-core's
    ``correction_range_round_to_int``) -- and scale cos and sin by the same attention factor,
    0.1 mscale ln(factor) + 1 over the same with ``mscale_all_dim`` (absent: mscale 1, mscale_all_dim 0).
    ``factor`` absent: max_position_embeddings / original, as transformers takes it."""
    rp = rope_parameters(hf_config)
    if rp["rope_type"] != "yarn":
        return None
    original = int(rp["original_max_position_embeddings"])
    factor = rp.get("factor")
    factor = float(factor) if factor is not None else hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then uses 0.1 ln(factor) + 1 alone
        mscale, mscale_all_dim = 1.0, 0.0
    return {"yarn_rotary_scaling_factor": factor, "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(rp.get("beta_fast") or 32), "yarn_beta_slow": float(rp.get("beta_slow") or 1),
            "yarn_mscale": float(mscale), "yarn_mscale_all_dim": float(mscale_all_dim),
            "yarn_correction_range_round_to_int": bool(rp.get("truncate", True))}


def _yarn_problems(rp: dict) -> list[str]:
    """What in a YaRN config megatron-core's YarnRotaryEmbedding cannot reproduce."""
    problems = []
    if rp.get("original_max_position_embeddings") is None:
        problems.append("YaRN RoPE scaling without original_max_position_embeddings")
    if rp.get("attention_factor") is not None:
        problems.append(f"YaRN with an explicit attention_factor {rp['attention_factor']} (megatron-core derives "
                        f"it from factor, mscale and mscale_all_dim)")
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("YaRN on a partial rotary dimension")
    return problems


def family_of(hf_config) -> Family:
    """The config's family after every check of the module docstring (named refusals)."""
    fam = check_model_type(getattr(hf_config, "model_type", None))
    mt = fam.model_type
    problems = []
    if getattr(hf_config, "attention_bias", False) and not fam.qkv_bias:
        problems.append("attention_bias: true (a bias on q/k/v and o_proj; the Megatron model has none)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias: true")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r} (SwiGLU needs silu)")
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if getattr(hf_config, "use_sliding_window", False) or layer_types - {"full_attention"}:
        problems.append("sliding-window attention layers")
    if fam.moe:
        e, k = num_experts(hf_config), int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
        if e < 1 or not 1 <= k <= e:
            problems.append(f"num_experts_per_tok {k} must be between 1 and num_experts {e}")
        if getattr(hf_config, "mlp_only_layers", None) or int(getattr(hf_config, "decoder_sparse_step", 1)) != 1:
            problems.append("dense MLP layers between the sparse ones (mlp_only_layers / decoder_sparse_step > 1)")
    rp = rope_parameters(hf_config)
    kind = rp["rope_type"]
    if kind == "llama3":
        if mt != "llama":
            problems.append(f"llama3 RoPE scaling on a {mt} model")
        diff = {k: rp.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if rp.get(k) is None or float(rp[k]) != v}
        if diff:
            problems.append(f"llama3 RoPE scaling with {diff} (megatron-core 0.16.1 fixes "
                            f"{MEGATRON_LLAMA3_ROPE}; only the factor is free)")
    elif kind == "yarn":
        problems += _yarn_problems(rp)
    elif kind != "default":
        problems.append(f"RoPE scaling {kind!r} (supported: none, yarn, or llama3 on llama)")
    if problems:
        raise ValueError(f"backend: megatron cannot build this {fam.label} config exactly: " + "; ".join(problems)
                         + ". Use backend: openrlhf (DeepSpeed) for it")
    return fam


def check_moe_layout(hf_config, tp: int, ep: int) -> list[str]:
    """What keeps a MoE config from splitting ``tp`` x ``ep`` ways (empty for a dense family)."""
    moe = moe_of(hf_config)
    if moe is None:
        return [f"expert parallel size {ep} needs a mixture-of-experts model"] if ep != 1 else []
    problems = []
    if ep < 1 or moe.num_experts % ep:
        problems.append(f"num_experts {moe.num_experts} is not divisible by expert parallel size {ep}")
    if moe.ffn % tp:
        problems.append(f"moe_intermediate_size {moe.ffn} is not divisible by tensor parallel size {tp} "
                        f"(expert tensor parallelism is TP)")
    return problems


def check_actor_family(hf_config, megatron: MegatronConfig | None = None) -> Family:
    """:func:`family_of`, and whether the Megatron policy actor can lay the model out under
    ``megatron`` (the run config's ``megatron`` section; the defaults when None): a
    mixture of experts must split its experts ``expert_parallel`` ways and each expert's FFN
    ``tensor_parallel`` ways, and at TP > 1 it needs ``sequence_parallel`` (which needs Transformer
    Engine's spec; the config loader checks that); a dense model takes no ``expert_parallel``.
    One line per problem, before any weight is read."""
    fam = family_of(hf_config)
    m = megatron if megatron is not None else MegatronConfig()
    tp, ep = m.tensor_parallel, m.expert_parallel
    problems = check_moe_layout(hf_config, tp, ep)
    if not fam.moe and m.moe.routing_replay != "off":
        problems.append("megatron.moe.routing_replay replays a mixture of experts' routes, and this model is dense "
                        "(set routing_replay: off)")
    cp = m.context_parallel
    if cp > 1 and m.cp_comm_type == "a2a":  # TE's a2a swaps the sequence split for a head split inside the CP group
        heads = {"attention heads": hf_config.num_attention_heads, "key/value heads": hf_config.num_key_value_heads}
        for what, n in heads.items():
            if n % tp or (n // tp) % cp:
                problems.append(f"cp_comm_type a2a splits each tensor-parallel rank's {what} over the CP ranks: "
                                f"{n} / tensor_parallel {tp} is not a multiple of context_parallel {cp} "
                                f"(use p2p or all_gather)")
    if fam.moe and tp > 1 and not m.sequence_parallel:
        problems.append(f"a mixture of experts at tensor_parallel {tp} needs sequence parallelism "
                        f"(megatron.sequence_parallel: true, with layer_spec: te), or expert_parallel with "
                        f"tensor_parallel 1")
    if problems:
        raise ValueError(f"backend: megatron cannot lay out this {fam.label} model: " + "; ".join(problems))
    return fam
