"""The Megatron model variants only a GPU runs for real: Transformer Engine's layer spec and a
mixture of experts, each against Hugging Face."""

from __future__ import annotations

from pathlib import Path


from .common import check_in_child, one_rank_job, ranks_child


def smoke_te_spec(work: Path) -> dict:
    """Transformer Engine's layer spec on the real TE (docs/megatron.md, "Transformer Engine";
    on CPU only a stand-in of TE is tested): :func:`te_spec_check` in a child process on one GPU."""
    return check_in_child(work, "te_spec_check", ("megatron", "transformer_engine"))


def smoke_context_parallel(work: Path) -> dict:
    """Context parallelism through the real TE (docs/megatron.md, "Context parallelism"): on two GPUs,
    :func:`te_spec_check` at ``context_parallel_size`` 2 -- each rank forwarding its share of every
    packed sequence through TE's ring attention, the values gathered -- against Hugging Face, as the
    TE-spec check is at CP 1. Skipped, saying so, with one GPU."""
    import importlib.util

    import torch

    if any(importlib.util.find_spec(m) is None for m in ("megatron", "transformer_engine")):
        return {"ok": True, "skipped": "needs megatron and transformer_engine"}
    if torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": "needs two GPUs (context parallelism splits a sequence over ranks)"}
    code = "import json; from hapo_openrlhf.gpu_smoke import te_spec_check; print(json.dumps(te_spec_check('cuda', 2)))"
    rcs, res = ranks_child(work, "context_parallel", code, world=2)
    return {**res, "ok": not any(rcs) and res.get("ok", False)}


def te_spec_check(device: str = "cuda", cp: int = 1) -> dict:
    """A tiny fp32 Qwen3 (QK-norm) GPTModel built from Transformer Engine's layer spec, loaded
    with the converter's TE names: its log-probs and entropy against the Hugging Face model's
    (packed THD through TE's attention), and the streamed Hugging Face weights against the
    ones it was loaded from (``stream_exact``; at CP 1). One rank of an initialised job (torch.distributed
    from the environment unless it is up); ``cp`` > 1: the job's ranks split each sequence
    (context parallelism; the values gathered on every rank). ``device="cpu"`` runs it under the TE
    stand-in (tests/megatron/test_te_spec.py, test_context_parallel.py)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..megatron.convert import gather_hf_state_dict, hf_to_megatron
    from ..megatron.model import build_gpt_model
    from ..megatron.schedule import logprobs_and_entropy

    cuda = one_rank_job(device, cp)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=48,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).to(device)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
    extra = {"context_parallel_size": cp} if cp > 1 else {}
    model = build_gpt_model(cfg, spec="te", perform_initialization=False, use_cpu_initialization=not cuda,
                            **extra).to(device)
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), cfg, spec="te"), strict=False)
    loaded = not unexpected and all(k.endswith("_extra_state") for k in missing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (3, 40), generator=g).to(device)
    am = torch.ones_like(ids)
    am[1, :9] = 0  # left padding
    am[2, -7:] = 0  # a shorter response
    with torch.no_grad():
        lp, en = logprobs_and_entropy(model, ids, am, vocab_size=512)
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        z = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
        ref = torch.log_softmax(z, -1)
        ref_lp, ref_en = ref.gather(-1, ids[:, 1:, None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    valid = (am[:, :-1] * am[:, 1:]).bool()
    lp_err = float((lp[valid] - ref_lp[valid]).abs().max())
    en_err = float((en[valid] - ref_en[valid]).abs().max())
    exact = None
    if cp == 1:  # the weight stream's collectives are TP's and PP's: CP does not change them
        sd = gather_hf_state_dict(model, cfg)
        ref_sd = hf.state_dict()
        exact = sd is None or all(torch.equal(t, ref_sd[n].cpu()) for n, t in sd.items())
    return {"ok": loaded and exact is not False and lp_err < 2e-3 and en_err < 2e-3, "loaded_strict": loaded,
            "stream_exact": exact, "logprob_max_abs_err": lp_err, "entropy_max_abs_err": en_err, "cp": cp}


def smoke_moe(work: Path) -> dict:
    """A mixture of experts on megatron-core's CUDA path (docs/megatron.md, "Mixture of experts"):
    :func:`moe_check` in a child process on one GPU."""
    return check_in_child(work, "moe_check", ("megatron",))


def moe_check(device: str = "cuda") -> dict:
    """A tiny fp32 Qwen3-MoE (4 experts, top-2) GPTModel -- local spec, FlashCoreAttention on packed
    THD rows, megatron-core's all-to-all dispatcher and fp32 router -- against transformers'
    ``Qwen3MoeForCausalLM``: log-probs and entropy, the router statistics of the same forward
    (entropy against the Hugging Face router's), and the streamed Hugging Face weights, experts
    included, against the ones it was loaded from. One rank of an initialised job; ``device="cpu"``
    runs it on gloo (tests/megatron/test_moe.py)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from ..megatron.convert import gather_hf_state_dict, hf_to_megatron
    from ..megatron.model import build_gpt_model
    from ..megatron.moe import reduce_route_stats, to_checkpoint_names
    from ..megatron.schedule import forward_backward
    from ..megatron.taps import RouterStats

    cuda = one_rank_job(device)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(cfg).to(device)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # decisive routing: no near tie between the k-th and the next expert
    model = build_gpt_model(cfg, perform_initialization=False, use_cpu_initialization=not cuda).to(device)
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), cfg), strict=False)
    loaded = not unexpected and all(k.endswith("_extra_state") for k in missing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (3, 40), generator=g).to(device)
    am = torch.ones_like(ids)
    am[1, :9] = 0  # left padding
    am[2, -7:] = 0  # a shorter response
    stats: dict = {}
    router_logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: router_logits.append(out[0].detach()))
             for layer in hf.model.layers]
    with torch.no_grad():
        (lp, en), = forward_backward(model, [{"input_ids": ids, "attention_mask": am}], None, vocab_size=512,
                                     forward_only=True, layout="thd", taps=[RouterStats(stats)])
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        z = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
    for h in hooks:
        h.remove()
    ref = torch.log_softmax(z, -1)
    ref_lp, ref_en = ref.gather(-1, ids[:, 1:, None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    valid = (am[:, :-1] * am[:, 1:]).bool()
    lp_err = float((lp[valid] - ref_lp[valid]).abs().max())
    en_err = float((en[valid] - ref_en[valid]).abs().max())
    real = am.bool().reshape(-1)
    logp = [torch.log_softmax(x.float()[real], -1) for x in router_logits]
    want_router = float(sum(-(q.exp() * q).sum() for q in logp) / sum(q.shape[0] for q in logp))
    got_router = reduce_route_stats(stats, cfg)["moe/router_entropy"]
    sd = gather_hf_state_dict(model, cfg)
    ref_sd = to_checkpoint_names(hf.state_dict(), cfg)
    exact = sd is None or (set(sd) == set(ref_sd) and all(torch.equal(t, ref_sd[n].cpu()) for n, t in sd.items()))
    router_err = abs(got_router - want_router)
    return {"ok": loaded and exact and lp_err < 2e-3 and en_err < 2e-3 and router_err < 1e-4,
            "loaded_strict": loaded, "stream_exact": exact, "logprob_max_abs_err": lp_err,
            "entropy_max_abs_err": en_err, "router_entropy_abs_err": router_err}
