import math

import pytest
import torch

from hapo_openrlhf.algos import LOSSES, aggregate, compute_policy_loss, default_normalizer, k3_kl, list_losses

M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_registry_lists_every_loss_in_the_issue():
    assert {"ppo", "entro_reg", "kl_cov", "clip_cov"} <= set(list_losses())


def test_aggregations_hand_computed():
    loss = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    assert aggregate(loss, M, "token-mean").item() == pytest.approx((1 + 3 + 5) / 3)
    assert aggregate(loss, M, "seq-mean-token-mean").item() == pytest.approx((2 + 5) / 2)
    assert aggregate(loss, M, "seq-mean-token-sum-norm").item() == pytest.approx((4 / 3 + 5 / 3) / 2)
    assert aggregate(loss, M, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx((0.4 + 0.5) / 2)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(loss, M, "sum")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_split_equals_whole_gradient(agg):
    """Micro-batches with the global normaliser give the one-big-batch gradient."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    mask = (torch.rand(B, T, generator=g) < 0.7).float()
    mask[:, 0] = 1
    old = torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g) * mask
    lp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    whole, _ = compute_policy_loss("ppo", lp, old, adv, mask, aggregation=agg, eps_high=0.28)
    (gw,) = torch.autograd.grad(whole, lp)
    norm = default_normalizer(mask, agg)
    total, gs = 0.0, torch.zeros_like(lp)
    for idx in ([0, 1], [2, 3, 4], [5]):  # uneven micro-batches / "ranks"
        part, _ = compute_policy_loss("ppo", lp[idx], old[idx], adv[idx], mask[idx], aggregation=agg,
                                      normalizer=norm, norm_constant=T, eps_high=0.28)
        (g_part,) = torch.autograd.grad(part, lp)
        gs += g_part
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-5)
    assert torch.allclose(gs, gw, atol=1e-6)


def test_ppo_clip_hand_computed():
    # ratios e^{0.5}=1.6487 (A=+1: clipped at 1.28), e^{-0.5}=0.6065 (A=-1: clipped at 0.8)
    lp = torch.tensor([[0.5, -0.5]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    m = torch.ones(1, 2)
    loss, met = compute_policy_loss("ppo", lp, old, adv, m, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2, rel=1e-6)
    assert met["actor/clip_frac"] == 1.0
    # inside the trust region nothing is clipped: loss = -A * ratio
    lp2 = torch.tensor([[0.1, -0.1]])
    loss2, met2 = compute_policy_loss("ppo", lp2, old, adv, m)
    assert loss2.item() == pytest.approx((-math.exp(0.1) + math.exp(-0.1)) / 2, rel=1e-6)
    assert met2["actor/clip_frac"] == 0.0


def test_dual_clip_bounds_negative_advantage_loss():
    lp, old = torch.tensor([[3.0]]), torch.zeros(1, 1)
    adv, m = torch.tensor([[-1.0]]), torch.ones(1, 1)
    plain, _ = compute_policy_loss("ppo", lp, old, adv, m)
    dual, _ = compute_policy_loss("ppo", lp, old, adv, m, dual_clip=3.0)
    assert plain.item() == pytest.approx(math.exp(3.0))
    assert dual.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        compute_policy_loss("ppo", lp, old, adv, m, dual_clip=0.5)


def test_k3_kl_hand_computed_and_added():
    lp, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]])
    assert k3_kl(lp, ref)[0].tolist() == pytest.approx([0.0, math.e - 1 - 1])
    m = torch.ones(1, 2)
    base, _ = compute_policy_loss("ppo", lp, lp.detach(), torch.zeros(1, 2), m)
    with_kl, met = compute_policy_loss("ppo", lp, lp.detach(), torch.zeros(1, 2), m, ref_logprobs=ref, kl_coef=0.5)
    assert (with_kl - base).item() == pytest.approx(0.5 * (math.e - 2) / 2)
    assert met["actor/kl_ref"] == pytest.approx((math.e - 2) / 2)


def test_k3_kl_is_clamped_at_10_like_verl_and_has_no_gradient_there():
    """verl's low_var_kl: exp(d) - d - 1 with d = ref - logp in [-20, 20], clamped to 10.
    d = 3: e^3 - 4 = 16.09 -> 10 (no gradient); d = 2: e^2 - 3 = 4.389 (gradient 1 - e^2)."""
    lp = torch.tensor([[-3.0, -2.0]], requires_grad=True)
    kl = k3_kl(lp, torch.zeros(1, 2))
    assert kl[0].tolist() == pytest.approx([10.0, math.exp(2) - 3])
    kl.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 1 - math.exp(2)])


def test_entro_reg_subtracts_beta_entropy_with_gradient():
    lp = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    m = torch.ones(1, 2)
    loss, met = compute_policy_loss("entro_reg", lp, lp, torch.zeros(1, 2), m, entropy=ent, beta=0.1)
    assert loss.item() == pytest.approx(-0.1 * 2.0)
    loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.05, -0.05])
    with pytest.raises(ValueError, match="entro_reg needs `entropy`"):
        compute_policy_loss("entro_reg", lp, lp, torch.zeros(1, 2), m)


def test_kl_cov_penalises_top_covariance_tokens():
    # 4 valid tokens; cov = (A - mean A)(logp - mean logp); the largest is token 0
    lp = torch.tensor([[2.0, 0.0, 0.0, -2.0]], requires_grad=True)
    old = torch.tensor([[1.5, 0.0, 0.0, -2.0]])
    adv = torch.tensor([[1.0, 0.0, 0.0, -1.0]])
    m = torch.ones(1, 4)
    loss, met = compute_policy_loss("kl_cov", lp, old, adv, m, k_ratio=0.25, kl_coef_cov=1.0)
    # tokens 0 and 3 have cov 2 and 2 -> topk(1) picks one of them; token 0 has |dlogp| = 0.5
    r0 = math.exp(0.5)
    base = (-1.0 * r0 + 0 + 0 + 1.0 * 1.0) / 4
    assert met["actor/kl_cov_frac"] == pytest.approx(0.25)
    assert loss.item() in (pytest.approx(base + 0.5 / 4), pytest.approx(base))
    loss0, met0 = compute_policy_loss("kl_cov", lp, old, adv, m, k_ratio=0.0)
    assert loss0.item() == pytest.approx(base) and met0["actor/kl_cov_frac"] == 0.0
    # verl's max(1, int(k N)): k = 2e-4 of 4 tokens (int 0) still selects one token
    _, met_small = compute_policy_loss("kl_cov", lp, old, adv, m, k_ratio=2e-4)
    assert met_small["actor/kl_cov_frac"] == pytest.approx(0.25)
    # and int(k N) beyond one: k = 0.6 of 4 -> int(2.4) = 2 tokens, the two of covariance 2
    loss2, met2 = compute_policy_loss("kl_cov", lp, old, adv, m, k_ratio=0.6)
    assert met2["actor/kl_cov_frac"] == pytest.approx(0.5) and loss2.item() == pytest.approx(base + 0.5 / 4)


def test_clip_cov_detaches_a_random_in_band_token():
    lp = torch.tensor([[2.0, 0.0, 0.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 0.0, 0.0, -1.0]])
    m = torch.ones(1, 4)
    g = torch.Generator().manual_seed(0)
    # cov of tokens 0 and 3 is 2.0 (in (1, 5)); clip_ratio * 4 < 1 -> exactly one token dropped
    loss, met = compute_policy_loss("clip_cov", lp, lp.detach(), adv, m, generator=g, eps_high=0.28)
    assert met["actor/clip_cov_frac"] == pytest.approx(0.25)
    loss.backward()
    zero_grad = (lp.grad == 0).squeeze(0).tolist()
    assert zero_grad[1] and zero_grad[2]  # A = 0 tokens have no gradient anyway
    assert zero_grad[0] != zero_grad[3]  # exactly one of the two in-band tokens was detached


def test_loss_shape_and_name_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be \\[B, T\\]"):
        compute_policy_loss("ppo", x, x, torch.zeros(2), x)
    with pytest.raises(ValueError, match="unknown policy loss 'ppoo'"):
        compute_policy_loss("ppoo", x, x, x, x)
    with pytest.raises(ValueError, match="has no parameter"):
        compute_policy_loss("ppo", x, x, x, x, beta=0.1)


def test_non_finite_loss_is_a_clear_error():
    lp = torch.tensor([[float("nan")]])
    with pytest.raises(FloatingPointError, match="non-finite policy loss"):
        compute_policy_loss("ppo", lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))


def test_a_method_is_registered_in_one_statement_with_what_it_declares():
    """Issue 56: the registry entry carries a method's step state, observer, resume, restore check,
    metric keys and row-locality (no side table beside it); a field the registry does not know is
    refused at registration, naming the fields it takes."""
    from hapo_openrlhf.algos.registry import Registry

    e = {n: LOSSES.get(n) for n in LOSSES.names()}
    assert {n for n, x in e.items() if x.stateful} == {"stare", "paec"}
    assert {n for n, x in e.items() if x.observe} == {"paec"}
    assert {n for n, x in e.items() if x.resume} == {"stare", "paec"} == {n for n, x in e.items() if x.check_state}
    assert {n for n, x in e.items() if x.row_local} == {"ppo", "entro_reg"}
    assert e["rsi_s"].metrics == ("rsi/kept_frac", "rsi/index_mean") and e["ppo"].metrics == ()
    assert e["stare"].metrics[0] == "stare/gate_on" and "paec/penalty" in e["paec"].metrics
    assert LOSSES.find("no_such_loss") is None and LOSSES.find(None) is None
    reg = Registry("policy loss", fixed=("logprobs",), hooks=("metrics",))
    with pytest.raises(TypeError, match=r"unknown registration field\(s\) \['observe'\].*may declare \['metrics'\]"):
        reg.register("x", observe=lambda *a: {})
    reg.register("y", metrics=["y/a"])(lambda *, logprobs: logprobs)
    assert reg.get("y").metrics == ("y/a",) and not reg.get("y").stateful


def test_the_surrogate_building_blocks_are_public_and_no_method_imports_a_private_name():
    """The host surrogate's pieces live in algos/surrogate.py under public names, and no algos
    module imports an underscored name from another module (issue 56)."""
    import ast
    from pathlib import Path

    import hapo_openrlhf.algos as algos_pkg
    from hapo_openrlhf.algos import surrogate

    for name in ("ppo_terms", "ppo_metrics", "weighted", "check_clip", "aggregate", "default_normalizer", "k3_kl"):
        assert callable(getattr(surrogate, name))
    private = []
    for path in Path(algos_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                private += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert private == [], private
