"""PAEC's head signals through megatron-core's GPTModel and hapo's schedule: at TP=1 and
TP=2 on gloo, from the fused vocabulary-parallel head and from the logits head, the
nucleus entropy, the top-two log-prob gap and the surprisal (-log p of the sampled token)
that reach the loss equal the naive computation on the Hugging Face model's full
vocabulary; the signals are detached and build no [T, V/TP] tensor."""

import pytest
import torch

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import tiny_qwen2

T, TOP_P = 0.8, 0.7


def _batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 259, (3, 10), generator=g)
    am = torch.ones(3, 10, dtype=torch.long)
    am[1, :3] = 0  # left padding, as rollouts are
    am[2, -2:] = 0  # and right padding
    return ids, am


def _naive(hf, ids, am):
    from hapo_openrlhf.algos.nucleus import nucleus_logprobs

    hf = hf.double()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        z = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1] / T
    lp = nucleus_logprobs(z, TOP_P)
    ent = -(lp.exp() * torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))).sum(-1)
    top = torch.log_softmax(z, -1).topk(2, -1).values
    s = -torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return ent.double(), (top[..., 0] - top[..., 1]).double(), s.double()


def _worker(rank, world, head, out):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward
    from hapo_openrlhf.megatron.taps import HeadSignals

    from ..conftest import largest_new_tensor_numel

    init_megatron(tp=world)
    hf = tiny_qwen2(False, layers=1)
    model = build_qwen2_gpt_model(hf.config, tp=world, head=head)
    load_hf_into(model, hf, tp=world, tp_rank=rank)
    ids, am = _batch()
    got = {}

    def loss_fn(lp, en, mb):
        ne, gap = mb["head_signals"]
        assert not ne.requires_grad and not gap.requires_grad
        got.update(ent=ne, gap=gap, s=-lp.detach())
        return lp.sum() * 0, {}

    forward_backward(model, [{"input_ids": ids, "attention_mask": am}], loss_fn, vocab_size=259, temperature=T,
                     chunk_size=4, taps=[HeadSignals(TOP_P)])
    # the signals' own allocations: no tensor of T x V/TP (the logits head's shard is handed in)
    from hapo_openrlhf.megatron.head import is_installed, output_weight, token_head_signals

    H = hf.config.hidden_size
    x = torch.randn(1, 200, H if is_installed(model) else output_weight(model).shape[0])
    n = largest_new_tensor_numel(lambda: token_head_signals(
        x[:, :-1], top_p=TOP_P, weight=output_weight(model) if is_installed(model) else None, vocab_size=259, temperature=T,
        chunk_size=8, tp_group=ps.get_tensor_model_parallel_group(), tp_rank=rank))
    if rank == 0:
        torch.save({**{k: v.detach() for k, v in got.items()}, "largest": n,
                    "shard": output_weight(model).shape[0]}, out)


@pytest.mark.parametrize("world, head", [(1, "fused"), (2, "fused"), (1, "logits"), (2, "logits")])
def test_signals_at_tp_equal_the_full_vocabulary(tmp_path, world, head):
    out = tmp_path / "sig.pt"
    spawn(_worker, world, world, head, str(out))
    res = torch.load(out)
    ids, am = _batch()
    want_ent, want_gap, want_s = _naive(tiny_qwen2(False, layers=1), ids, am)
    valid = (am[:, :-1] * am[:, 1:]).bool()
    torch.testing.assert_close(res["ent"].double()[valid], want_ent[valid], rtol=0, atol=2e-5)
    torch.testing.assert_close(res["gap"].double()[valid], want_gap[valid], rtol=0, atol=2e-5)
    torch.testing.assert_close(res["s"].double()[valid], want_s[valid], rtol=0, atol=2e-5)
    assert float(want_gap[valid].min()) >= 0 and float(want_ent[valid].max()) > 0
    # the largest tensor they allocate is one chunk's [8, V/TP] block, never [200, V/TP]
    assert res["largest"] <= 8 * res["shard"] < 200 * res["shard"]
