"""Every tensor the algorithm core creates lives on its inputs' device.

A CPU proxy for "tensors created on the wrong device" (which only a GPU shows: a
CUDA batch meeting a CPU buffer): with ``torch.set_default_device("meta")``, any
factory call without ``device=`` makes a meta tensor, and mixing it with the CPU
inputs raises. Each registered estimator and loss, the quadrant metrics, the DAPO
helpers and the fused / vocab-parallel heads run here with CPU inputs and must
return CPU results. (Before the fix, kl_cov and clip_cov failed this.)
"""

import contextlib

import pytest
import torch

from hapo_openrlhf import algos


@contextlib.contextmanager
def default_device_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _batch(seed=0, B=8, T=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[5, 2:] = 0
    return dict(
        rewards=torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0]),
        response_mask=mask,
        entropy=torch.rand(B, T, generator=g) * 2,
        group_index=torch.arange(2).repeat_interleave(4),
        correct=torch.tensor([True, False, False, True, True, True, False, False]),
        logprobs=-torch.rand(B, T, generator=g),
        response_ids=torch.randint(0, 3, (B, T), generator=g),  # a tiny vocabulary: LESS finds segments
        process_q=torch.randn(B, T, generator=g),  # PRIME's implicit PRM
        step=3,
    )


def _on_cpu(x):
    if isinstance(x, torch.Tensor):
        assert x.device.type == "cpu", x.device
    elif isinstance(x, dict):
        for v in x.values():
            _on_cpu(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _on_cpu(v)


def test_meta_default_device_catches_a_factory_call_without_device():
    # the proxy itself: a buffer made without device= is meta, and mixing it with CPU raises
    with default_device_meta(), pytest.raises(RuntimeError, match="device"):
        torch.zeros(3).index_add_(0, torch.tensor([0, 1], device="cpu"), torch.ones(2, device="cpu"))


@pytest.mark.parametrize("name", algos.list_estimators())
def test_every_estimator_is_device_safe(name):
    b = _batch()
    inputs = algos.AdvantageInputs(rewards=b["rewards"], response_mask=b["response_mask"], entropy=b["entropy"],
                                   group_index=b["group_index"], correct=b["correct"], step=b["step"],
                                   response_ids=b["response_ids"], process_q=b["process_q"])
    ref = algos.run_estimator(name, inputs)
    with default_device_meta():
        out = algos.run_estimator(name, inputs)
        extra = []
        if name == "hapo":  # every code path: the old form, an ablation through each split
            extra = [algos.run_estimator(name, inputs, form="multiplicative", normalize="mean_ratio"),
                     algos.run_estimator(name, inputs, ablate=["PHR", "NLR"]),
                     algos.run_estimator(name, inputs, ablate=["PLR"], split="quantile"),
                     algos.run_estimator(name, inputs, ablate=["NHR"], split="value", threshold=0.5)]
        if name == "prime":  # the reverse accumulation, the whole-response score, no normalisation
            extra = [algos.run_estimator(name, inputs, lam=0.5, granularity="whole", norm="none")]
    for o in [out, *extra]:
        _on_cpu(o.advantages)
        _on_cpu(o.loss_mask)
    torch.testing.assert_close(out.advantages, ref.advantages)


CORRECTIONS = [None, {"level": "token", "mode": "clip", "threshold": (0.0, 2.0)},
               {"level": "seq", "gating": "binary_kl", "threshold": (0.05,)}]


@pytest.mark.parametrize("correction", CORRECTIONS, ids=["plain", "token_tis", "seq_binary_kl"])
@pytest.mark.parametrize("name", algos.list_losses())
def test_every_loss_is_device_safe(name, correction):
    """Every loss, with and without the rollout/training mismatch correction."""
    b = _batch()
    lp = b["logprobs"].requires_grad_(True)
    old = lp.detach() + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    kw = {"kl_cov": dict(k_ratio=0.3), "clip_cov": dict(clip_ratio=0.3, cov_lb=-10.0, cov_ub=10.0),
          "rsi_s": dict(lower=0.2, upper=5.0),
          "paec": dict(beta=1.0, rho_min=2.0, top_p=0.9, mask="product", softness=0.1, loss_state={"h_low": 10.0},
                       nucleus_entropy=b["entropy"] * 0.5, top2_gap=b["entropy"].abs())}.get(name, {})
    if correction is not None:
        kw.update(is_correction=correction, rollout_logprobs=old - 0.1)
    with default_device_meta():
        loss, metrics = algos.compute_policy_loss(
            name, lp, old, adv, b["response_mask"], entropy=b["entropy"].requires_grad_(True),
            ref_logprobs=old, kl_coef=0.1, generator=torch.Generator(device="cpu").manual_seed(3), **kw)
        loss.backward()
    _on_cpu(loss)
    _on_cpu(lp.grad)
    assert torch.isfinite(loss) and all(isinstance(v, float) for v in metrics.values())


def test_clip_cov_draws_from_a_cpu_generator_whatever_the_tokens_device():
    # the same generator state gives the same dropped tokens on any device (here: CPU
    # tensors, with the draw forced through the generator's device)
    b = _batch()
    lp, old = b["logprobs"], b["logprobs"] + 0.01
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    kw = dict(clip_ratio=0.3, cov_lb=-10.0, cov_ub=10.0, aggregation="token-mean")
    m1 = algos.compute_policy_loss("clip_cov", lp, old, adv, b["response_mask"],
                                   generator=torch.Generator().manual_seed(5), **kw)[1]
    with default_device_meta():
        m2 = algos.compute_policy_loss("clip_cov", lp, old, adv, b["response_mask"],
                                       generator=torch.Generator(device="cpu").manual_seed(5), **kw)[1]
    assert m1 == m2 and m1["actor/clip_cov_frac"] > 0


def test_quadrants_dapo_and_group_statistics_are_device_safe():
    b = _batch()
    m, H, gi = b["response_mask"], b["entropy"], b["group_index"]
    adv = algos.compute_advantages("grpo", algos.AdvantageInputs(rewards=b["rewards"], response_mask=m, entropy=H,
                                                                 group_index=gi))
    with default_device_meta():
        outs = [algos.entropy_cut(H, m, gi), algos.entropy_cut(H, m, split="quantile"),
                algos.entropy_cut(H, m, split="value", threshold=0.3),
                algos.entropy_threshold(H, torch.zeros(m.shape, device="cpu")),
                algos.group_mean_std(b["rewards"], gi), algos.group_token_entropy_stats(H, m, gi),
                algos.informative_groups(b["rewards"], gi), algos.overlong_penalty(m.sum(-1), 6, 2)]
        met = algos.quadrant_metrics(adv, H, m, algos.entropy_cut(H, m, gi), polarity=torch.sign(adv.sum(-1)))
        masks = algos.quadrant_masks(torch.sign(adv.sum(-1)), H, m, algos.entropy_cut(H, m, gi))
        delta = algos.quadrant_entropy_change(masks, H, H + 0.1)
    _on_cpu(outs)
    _on_cpu(masks)
    assert all(isinstance(v, float) for v in {**met, **delta}.values())


@pytest.mark.parametrize("fused", ["logprobs_entropy", "token_loss", "chunked_logits", "vocab_parallel"])
def test_heads_are_device_safe_forward_and_backward(fused):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 10, (2, 5), generator=g)  # id 10 is vocabulary padding
    with default_device_meta():
        if fused == "logprobs_entropy":
            lp, ent = algos.fused_logprobs_entropy(hidden, weight, labels, temperature=0.7, chunk_size=3)
            (lp.sum() + ent.sum()).backward()
        elif fused == "token_loss":
            total, lp, ent = algos.fused_token_loss(hidden, weight, labels, lambda lp, en, sl: -(lp.sum() + en.sum()),
                                                    temperature=0.7, chunk_size=4)
            total.backward()
        elif fused == "chunked_logits":
            lp, ent = algos.logprobs_and_entropy(hidden @ weight.t(), labels, chunk_size=3, temperature=0.7)
            (lp.sum() + ent.sum()).backward()
        else:
            lp, ent = algos.vocab_parallel_logprobs_entropy(hidden @ weight.t(), labels, vocab_start=0,
                                                            vocab_size=10, chunk_size=3)
            (lp.sum() + ent.sum()).backward()
    _on_cpu([lp, ent, hidden.grad, weight.grad])


def test_megatron_row_layouts_are_device_safe():
    """The Megatron schedule's packed / padded index maps (``schedule.RowLayout``)."""
    pytest.importorskip("megatron.core")
    from hapo_openrlhf.megatron.schedule import RowLayout

    ids = torch.randint(0, 50, (3, 7))
    am = torch.ones(3, 7, dtype=torch.long)
    am[1, :3] = 0
    am[2, 5:] = 0
    with default_device_meta():
        for layout in ("thd", "padded"):
            lay = RowLayout.of(am, layout, pad_to=4)
            inputs = lay.model_inputs(ids)
            src, dst = lay._maps()
            for t in (inputs["input_ids"], inputs["position_ids"], src, dst):
                _on_cpu(t)
            if layout == "thd":
                _on_cpu(inputs["packed_seq_params"].cu_seqlens_q)
