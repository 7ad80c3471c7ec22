"""The EntroReg/PPO loss through Megatron's forward-backward schedule: several
micro-batches with the global token normaliser, at PP=2 (1F1B over gloo p2p) and
at TP=2, give the gradient of one big batch on the Hugging Face model."""

import pytest
import torch
import torch.distributed as dist

from hapo_openrlhf.algos import compute_policy_loss

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import hf_logprobs_entropy, tiny_model

T, MB, B, S = 0.9, 2, 6, 10  # 6 rows in 3 micro-batches of 2


def _data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 259, (B, S), generator=g)
    am = torch.ones(B, S, dtype=torch.long)
    for i, pad in enumerate([0, 3, 5, 0, 2, 6]):
        am[i, :pad] = 0
    mask = (am[:, :-1] * am[:, 1:]).float()  # "response" = every target whose input is real
    old = -torch.rand(B, S - 1, generator=g) * 3
    adv = torch.randn(B, S - 1, generator=g)
    return ids, am, mask, old, adv


def _loss(lp, en, old, adv, mask, normalizer):
    return compute_policy_loss("entro_reg", lp, old, adv, mask, entropy=en, beta=0.05, normalizer=normalizer)


def _reference(hf, tied):
    ids, am, mask, old, adv = _data()
    lp, en = hf_logprobs_entropy(hf, ids, am, T)
    loss, _ = _loss(lp, en, old.double(), adv.double(), mask.double(), float(mask.sum()))
    loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    if tied:  # one tensor: Hugging Face lists it once, as the embedding
        grads.pop("lm_head.weight", None)
    return float(loss), grads


def _worker(rank, tp, pp, tied, out, family="qwen2"):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import megatron_to_hf
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import allreduce_tp_replicated_grads, allreduce_tied_embedding_grads, forward_backward

    init_megatron(tp=tp, pp=pp)
    world = tp * pp
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    hf = tiny_model(family, tied, layers=4)
    model = build_gpt_model(hf.config, tp=tp, pp=pp, pp_rank=pp_rank)
    load_hf_into(model, hf, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
    ids, am, mask, old, adv = _data()
    n_global = float(mask.sum())
    mbs = [{"input_ids": ids[i : i + MB], "attention_mask": am[i : i + MB], "mask": mask[i : i + MB],
            "old": old[i : i + MB], "adv": adv[i : i + MB]} for i in range(0, B, MB)]

    def loss_fn(lp, en, mb):
        loss, m = _loss(lp, en, mb["old"], mb["adv"], mb["mask"], n_global)
        return loss, {"clip_frac": torch.tensor(m["actor/clip_frac"])}

    stats = forward_backward(model, mbs, loss_fn, vocab_size=259, temperature=T, chunk_size=7)
    allreduce_tied_embedding_grads(model)
    allreduce_tp_replicated_grads(model)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    everyone = [None] * world
    dist.all_gather_object(everyone, (pp_rank, tp_rank, grads, [float(s["loss"]) for s in stats]))
    # the old-log-prob pass: forward only, values back from the last stage
    with torch.no_grad():
        fwd = forward_backward(model, mbs, None, vocab_size=259, temperature=T, chunk_size=7)
    if rank == world - 1:
        assert len(fwd) == len(mbs) and fwd[0][0].shape == (MB, S - 1)
        want_lp, want_en = hf_logprobs_entropy(tiny_model(family, tied, layers=4), ids, am, T)
        got_lp, got_en = torch.cat([f[0] for f in fwd]), torch.cat([f[1] for f in fwd])
        valid = mask.bool()
        torch.testing.assert_close(got_lp.double()[valid], want_lp[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_en.double()[valid], want_en[valid], rtol=1e-4, atol=1e-4)
    if rank == 0:
        ref_loss, ref_grads = _reference(hf, tied)
        shards = {(s, r): g for s, r, g, _ in everyone}
        losses = [l for s, r, _, l in everyone if s == pp - 1 and r == 0][0]
        assert len(losses) == 3
        assert abs(sum(losses) - ref_loss) < 1e-5, (sum(losses), ref_loss)
        merged = megatron_to_hf(shards, hf.config, tp=tp, pp=pp)
        for n, g in ref_grads.items():
            torch.testing.assert_close(merged[n].double(), g, rtol=1e-3, atol=1e-6, msg=n)
        torch.save({"ok": True}, out)


@pytest.mark.parametrize("tp, pp, tied, family", [
    (1, 2, False, "qwen2"), (1, 2, True, "qwen2"), (2, 1, False, "qwen2"),
    (1, 2, True, "qwen3"), (2, 1, False, "qwen3"), (1, 2, False, "llama")])
def test_microbatched_loss_through_the_schedule_equals_one_big_batch(tmp_path, tp, pp, tied, family):
    """PP=2 with tied embeddings: the embedding (first stage) and head (last stage) copies'
    gradients are summed by ``allreduce_tied_embedding_grads``; Qwen3's QK-norm at TP=2 by
    ``allreduce_tp_replicated_grads``. The forward-only pass's log-probs and entropy equal Hugging
    Face's, for every family."""
    out = tmp_path / "ok.pt"
    spawn(_worker, tp * pp, tp, pp, tied, str(out), family)
    assert torch.load(out)["ok"]


def test_token_budget_batches_and_even_out_keep_every_row_once_within_the_budget():
    from hapo_openrlhf.megatron.schedule import even_out, token_budget_batches

    lengths = [9, 3, 7, 5, 2, 8]
    groups = token_budget_batches(lengths, 12)
    # first fit, longest first: [9], [8], [7, 5]; 3 joins 9, 2 joins 8; rows keep their order in a micro-batch
    assert groups == [[0, 1], [4, 5], [2, 3]]
    for n in range(3, 7):  # another rank's count: cut the fullest micro-batch in two, nearest halves
        out = even_out(groups, lengths, n)
        assert len(out) == n and sorted(r for g in out for r in g) == list(range(6))
        assert all(sum(lengths[r] for r in g) <= 12 for g in out)
        assert all(g == sorted(g) for g in out)
    assert even_out([[0, 1, 2]], [1, 1, 4], 2) == [[0, 1], [2]]  # 2 | 4 is closer to halves than 1 | 5
    assert even_out(groups, lengths, 3) == groups  # already even: unchanged
    with pytest.raises(ValueError, match="6 rows cannot make the 7 micro-batches another data-parallel rank runs"):
        even_out(groups, lengths, 7)
    with pytest.raises(ValueError, match="3 micro-batches are more than the 2 asked for"):
        even_out(groups, lengths, 2)
