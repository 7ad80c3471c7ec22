"""hapo's fused LM head inside OpenRLHF's real ``Actor``: the same log-probs, entropy and
gradients as upstream's ``Actor.forward``, padded and packed, without building logits."""

import pytest
import torch


def _actor(packing: bool, temperature: float = 0.8, tie: bool = False, V: int = 101, H: int = 64):
    from openrlhf.models import Actor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="sdpa",
                      use_cache=False)  # as Actor sets it when it loads a checkpoint itself
    actor = Actor(Qwen2ForCausalLM(cfg).float(), temperature=temperature)
    actor.packing_samples = packing  # upstream only sets it when it loads the model itself
    return actor


def _batch():
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(1, 101, (3, 12), generator=g)
    attn = torch.ones_like(seq)
    attn[0, :3] = 0  # left-padded prompts
    attn[1, :1] = 0
    attn[2, 10:] = 0  # right padding after the response
    action_mask = attn[:, -5:].clone()
    return seq, attn, action_mask


def _run(actor, entropy_weight=0.3):
    seq, attn, am = _batch()
    actor.zero_grad(set_to_none=True)
    lp, out = actor(seq, am, attn, return_output=True, return_entropy=True)
    ent = out.entropy[:, -am.shape[1]:]
    g = torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
    ((lp * g).sum() + entropy_weight * (ent * am).sum()).backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    return lp.detach(), (ent * am).detach(), grads


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    assert a[2].keys() == b[2].keys() and a[2]
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_fused_forward_equals_upstream_forward(packing, tie):
    from hapo_openrlhf.integrations.openrlhf.actors.fused_head import install_fused_head

    upstream = _run(_actor(packing, tie=tie))
    actor = _actor(packing, tie=tie)
    assert install_fused_head(actor, chunk_size=7) is None
    fused = _run(actor)
    _assert_same(fused, upstream)
    if packing:  # packed (block-diagonal SDPA over one row) == padded, through the fused head
        _assert_same(fused, _run(_actor(False, tie=tie)))


def test_fused_forward_never_builds_the_logits():
    from hapo_openrlhf.integrations.openrlhf.actors.fused_head import install_fused_head

    from ...conftest import largest_tensor_numel

    V = 1000  # the [B, T, V] logits (36,000) dwarf the weights (V x H = 16,000) and a chunk (4 x V)
    actor = _actor(False, V=V, H=16)
    install_fused_head(actor, chunk_size=4)
    seq, attn, am = _batch()
    B, T = seq.shape
    n = largest_tensor_numel(lambda: actor(seq, am, attn, return_output=True, return_entropy=True)[0].sum().backward())
    assert n <= V * 16 < B * T * V / 2


def test_logits_callers_and_unsupported_heads_keep_upstream():
    from hapo_openrlhf.integrations.openrlhf.actors.fused_head import fused_head_unsupported, install_fused_head

    actor = _actor(False)
    install_fused_head(actor, chunk_size=4)
    seq, attn, _ = _batch()
    out = actor(seq, attention_mask=attn, return_output=True)  # no action_mask: the caller wants logits
    assert out["logits"].shape == (*seq.shape, 101)
    biased = _actor(False)
    biased.model.lm_head.bias = torch.nn.Parameter(torch.zeros(101))
    assert "bias" in fused_head_unsupported(biased)
    assert install_fused_head(biased, 4) is not None and "forward" not in vars(biased)
    zero3 = _actor(False)
    zero3.model.lm_head.weight.ds_id = 0  # what ZeRO-3 puts on a partitioned parameter
    assert "ZeRO-3" in fused_head_unsupported(zero3)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_policy_actor_nucleus_logmass_is_the_full_distributions(packing, fused):
    """``rollout/nucleus_logmass``'s per-token input: log P(top-p nucleus) at the response
    positions, from the fused head's hidden states or upstream's (packed) logits, equals
    the sort rule on upstream's padded logits at the rollout temperature."""
    from types import SimpleNamespace

    from hapo_openrlhf.algos.nucleus import nucleus_logmass
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import HapoPolicyModelActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.fused_head import install_fused_head

    seq, attn, am = _batch()
    A, top_p = am.shape[1], 0.9
    with torch.no_grad():
        _, ref = _actor(False)(seq, am, attn, return_output=True)
        want = nucleus_logmass(ref["logits"][:, :-1][:, -A:], top_p) * am  # logits already / T
        actor = _actor(packing)
        if fused:
            assert install_fused_head(actor, chunk_size=4, top_p=top_p) is None
        _, out = actor(seq, am, attn, return_output=True, return_entropy=packing or fused)
        host = object.__new__(HapoPolicyModelActorImpl)  # the Ray actor's state, without Ray
        host.actor, host._fused, host._nucleus_top_p, host._entropy_chunk = actor, fused, top_p, 4
        host.strategy = SimpleNamespace(ring_attn_group=None)
        got = host._nucleus_logmass(out, seq, attn, A) * am
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert float(want.min()) < -1e-3 and float(want.max()) <= 0  # the nucleus cut mass somewhere


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_paec_gets_the_head_signals_of_the_training_pass(packing, fused):
    """PAEC on the DeepSpeed actor: the training forward's hook hands the loss the nucleus
    entropy and top-two gap at the response positions -- from the fused head's hidden states
    or upstream's (packed) logits -- equal to the naive computation on upstream's padded
    logits; the loss is then the registry's with them."""
    from types import SimpleNamespace

    from hapo_openrlhf.algos.losses import compute_policy_loss
    from hapo_openrlhf.algos.nucleus import nucleus_logprobs
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import HapoPolicyModelActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.fused_head import install_fused_head
    from hapo_openrlhf.integrations.openrlhf.actors.loss import HapoPolicyLoss

    seq, attn, am = _batch()
    A, top_p = am.shape[1], 0.8
    with torch.no_grad():
        _, ref = _actor(False)(seq, am, attn, return_output=True)
        z = ref["logits"][:, :-1][:, -A:]  # already / T
        lp = nucleus_logprobs(z, top_p)
        want_ent = -(lp.exp() * torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))).sum(-1)
        top = torch.log_softmax(z, -1).topk(2, -1).values
        want_gap = top[..., 0] - top[..., 1]
    params = dict(beta=1.0, rho_min=2.0, top_p=top_p, mask="product", softness=0.0)
    actor = _actor(packing)
    host = object.__new__(HapoPolicyModelActorImpl)  # the Ray actor's state, without Ray
    host.actor, host._fused, host._entropy_chunk = actor, fused, 4
    host.strategy = SimpleNamespace(ring_attn_group=None)
    host.loss_fn = HapoPolicyLoss("paec", params)
    host.loss_fn.loss_state = {"h_low": 50.0}
    if fused:
        assert install_fused_head(actor, chunk_size=4) is None
        actor._hapo_signals_top_p = host.loss_fn.signals_top_p
    actor.register_forward_hook(host._training_forward_hook, with_kwargs=True)
    actor.train()
    # as upstream's training_step calls it
    new, out = actor(seq, am, attention_mask=attn, return_output=True, return_entropy=True)
    ent, gap = host.loss_fn.pending_signals
    m = am.bool()
    torch.testing.assert_close(ent[:, -A:][m], want_ent[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(gap[:, -A:][m], want_gap[m], rtol=0, atol=1e-5)
    assert not ent.requires_grad and not gap.requires_grad
    old = new.detach() - 0.05
    adv = torch.randn(new.shape, generator=torch.Generator().manual_seed(1))
    got = host.loss_fn(new, old, adv, action_mask=am)[0]
    want, _ = compute_policy_loss("paec", new, old, adv, am, entropy=out.entropy[:, -A:], nucleus_entropy=ent[:, -A:],
                                  top2_gap=gap[:, -A:], loss_state={"h_low": 50.0}, **params)
    torch.testing.assert_close(got, want)
    assert host.loss_fn.pending_signals is None  # consumed: never reused by the next micro-batch
