"""Megatron-core GPTModel (Qwen2, Qwen3, Llama via hapo's converter) at TP=1 and TP=2 on gloo:
log-probs, entropy and every parameter gradient equal the Hugging Face model's,
computed from vocabulary shards (the full vocabulary is never gathered)."""

import pytest
import torch
import torch.distributed as dist

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import hf_logprobs_entropy, tiny_model, tiny_qwen2

T = 0.8


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (3, 12), generator=g)
    am = torch.ones(3, 12, dtype=torch.long)
    am[1, :4] = 0  # left padding, as rollouts are
    am[2, :7] = 0
    w_lp, w_en = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    return ids, am, w_lp, w_en


def _both_real(am):
    """Next-token targets whose input position is a real token too (the prediction made
    at a padding position is not defined the same way by the two attention masks)."""
    return (am[:, :-1] * am[:, 1:]).bool()


def _hf_reference(model, ids, am, w_lp, w_en):
    lp, en = hf_logprobs_entropy(model, ids, am, T)
    m = _both_real(am).double()
    ((lp * w_lp * m).sum() + (en * w_en * m).sum()).backward()
    return lp.detach(), en.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank, world, tied, out, layout="thd", head="auto", family="qwen2"):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import megatron_to_hf
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.head import is_installed, resolve
    from hapo_openrlhf.megatron.schedule import allreduce_tp_replicated_grads, logprobs_and_entropy

    init_megatron(tp=world)
    hf = tiny_model(family, tied, layers=2)
    model = build_gpt_model(hf.config, tp=world, attention="local" if layout == "masked" else "flash", head=head)
    load_hf_into(model, hf, tp=world, tp_rank=rank)
    # RoPE frequencies: megatron-core's own (llama3 scaling through its rope_scaling_factor) == transformers'
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.float(), hf.model.rotary_emb.inv_freq.float(),
                               rtol=1e-6, atol=0)
    assert is_installed(model) == (resolve(head, "local" if layout == "masked" else "flash") == "fused")
    ids, am, w_lp, w_en = _batch()
    if layout != "masked":
        am[0, -2:] = 0  # right padding too (a response shorter than the batch's)
    lp, en = logprobs_and_entropy(model, ids, am, vocab_size=259, temperature=T, chunk_size=5,
                                  tp_group=ps.get_tensor_model_parallel_group(), tp_rank=rank, layout=layout)
    if layout != "masked":  # padding the token count (sequence parallelism's multiple of TP) changes nothing
        with torch.no_grad():
            lp7, en7 = logprobs_and_entropy(model, ids, am, vocab_size=259, temperature=T, chunk_size=5,
                                            tp_group=ps.get_tensor_model_parallel_group(), tp_rank=rank, layout=layout,
                                            pad_to=7)
        torch.testing.assert_close(lp7, lp.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(en7, en.detach(), rtol=1e-6, atol=1e-6)
    if layout != "masked":  # no value where there is no next real token
        assert bool((lp[~_both_real(am)] == 0).all()) and bool((en[~_both_real(am)] == 0).all())
    m = _both_real(am).float()
    ((lp * w_lp * m).sum() + (en * w_en * m).sum()).backward()
    allreduce_tp_replicated_grads(model)  # Qwen3's replicated QK-norm: each rank saw only its heads
    grads = {n.replace("module.", ""): p.grad.detach().clone() for n, p in model.named_parameters()}
    if layout == "thd":  # packed == right-aligned padded directly: values and every gradient, tightly
        model.zero_grad(set_to_none=True)
        lp2, en2 = logprobs_and_entropy(model, ids, am, vocab_size=259, temperature=T, chunk_size=5,
                                        tp_group=ps.get_tensor_model_parallel_group(), tp_rank=rank, layout="padded")
        ((lp2 * w_lp * m).sum() + (en2 * w_en * m).sum()).backward()
        allreduce_tp_replicated_grads(model)
        torch.testing.assert_close(lp2, lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(en2, en.detach(), rtol=1e-5, atol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n.replace("module.", "")], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
    everyone = [None] * world
    dist.all_gather_object(everyone, grads)
    if rank == 0:
        ref_lp, ref_en, ref_grads = _hf_reference(hf, ids, am, w_lp.double(), w_en.double())
        valid = _both_real(am)
        torch.testing.assert_close(lp.double()[valid], ref_lp[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(en.double()[valid], ref_en[valid], rtol=1e-4, atol=1e-4)
        merged = megatron_to_hf({(0, r): everyone[r] for r in range(world)}, hf.config, tp=world, pp=1)
        for n, g in ref_grads.items():
            if tied and n == "lm_head.weight":
                continue
            torch.testing.assert_close(merged[n].double(), g, rtol=1e-3, atol=1e-5, msg=n)
        torch.save({"ok": True, "n_grads": len(merged), "hf_params": len(ref_grads)}, out)


@pytest.mark.parametrize("world, tied, layout, head, family", [
    (1, True, "thd", "auto", "qwen2"), (2, True, "thd", "auto", "qwen2"), (2, False, "thd", "auto", "qwen2"),
    (2, True, "padded", "auto", "qwen2"), (1, False, "masked", "auto", "qwen2"), (2, True, "thd", "logits", "qwen2"),
    (2, False, "masked", "fused", "qwen2"),
    # Qwen3 (QK-norm, head_dim 24 != 64 / 4, no bias) and Llama 3 (llama3 RoPE scaling, head_dim 24)
    (1, False, "thd", "auto", "qwen3"), (2, True, "thd", "auto", "qwen3"), (2, False, "masked", "logits", "qwen3"),
    (1, True, "thd", "auto", "llama"), (2, False, "thd", "auto", "llama"), (2, True, "masked", "logits", "llama")])
def test_tp_logprobs_entropy_and_grads_equal_hf(tmp_path, world, tied, layout, head, family):
    """Packed (THD, flash-style varlen attention), right-aligned padded (causal, no mask)
    and Megatron's own masked DotProductAttention all equal Hugging Face, through the fused
    vocabulary-parallel head (``auto`` with flash attention) and the logits head, tied
    and untied, with the vocabulary padded (259 -> 384 or 512 rows) and T = 0.8, for
    every supported family."""
    out = tmp_path / "ok.pt"
    spawn(_worker, world, world, tied, str(out), layout, head, family)
    res = torch.load(out)
    # every Hugging Face parameter (tied: lm_head is the embedding) got its gradient (Qwen2: embed, final
    # norm, 2 x 12 per layer, lm_head)
    assert res["ok"] and res["n_grads"] == res["hf_params"] == {"qwen2": 26, "qwen3": 24, "llama": 20}[family] + (not tied)


def _largest_worker(rank, world, out):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model
    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy

    from ..conftest import largest_tensor_numel

    init_megatron(tp=world)
    hf = tiny_qwen2(True, layers=1)
    sizes = {}
    for head in ("logits", "fused"):
        model = build_qwen2_gpt_model(hf.config, tp=world, head=head)
        load_hf_into(model, hf, tp=world, tp_rank=rank)
        ids = torch.randint(0, 259, (4, 60), generator=torch.Generator().manual_seed(2))

        def step():
            lp, en = logprobs_and_entropy(model, ids, torch.ones_like(ids), vocab_size=259, chunk_size=16,
                                          tp_group=ps.get_tensor_model_parallel_group(), tp_rank=rank)
            (lp.sum() + en.sum()).backward()

        sizes[head] = largest_tensor_numel(step)
        sizes["vocab_shard"] = model.embedding.word_embeddings.weight.shape[0]  # tied: the head
    if rank == 0:
        torch.save(sizes, out)


def test_fused_head_through_the_model_never_builds_a_logits_shard(tmp_path):
    """TP=2, 4 packed rows of 60 tokens: the logits head's largest tensor is the
    [T, V/TP] shard; through the fused head no tensor reaches T x V/TP elements."""
    out = tmp_path / "sizes.pt"
    spawn(_largest_worker, 2, 2, str(out))
    sizes = torch.load(out)
    t_v = 240 * sizes["vocab_shard"]
    assert sizes["logits"] >= t_v
    assert sizes["fused"] < t_v, sizes  # its largest is the MLP activation [T, 2 x ffn / TP]
