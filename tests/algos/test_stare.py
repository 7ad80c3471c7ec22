"""STARE (SPEC 2.8, issue 39) against what its official code computes.

The reference is hp-luo/STARE ``verl/trainer/ppo/core_algos.py``: the functions marked
"mirrors" restate what ``compute_stare_token_weights``, ``compute_policy_loss_stare`` and
``STAREController.update`` compute (read with the search tool, not copied), one token at
a time in Python, with torch.topk where the reference selects with it."""

import math

import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.stare import StareController, stare_omega, stare_thresholds, top_count


def _batch(seed, B=7, T=9):
    """Uneven lengths (garbage in the padding), positive, negative and zero advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.0, 0.7, -0.3][:B]).unsqueeze(-1).expand(B, T).clone()
    logp = -torch.rand(B, T, generator=g) * 4  # distinct values: no ties
    old = logp + 0.05 * torch.randn(B, T, generator=g)
    logp[~mask], old[~mask], adv[~mask] = 7.0, -3.0, 5.0
    return logp, old, adv, mask


def _mirror_weights(logp, adv, mask, variant, ratio, w, m, gate):
    """mirrors core_algos.py ``compute_stare_token_weights``: candidates by advantage sign,
    k = max(1, int(n P + 0.999999)) capped at n, torch.topk of -log_prob over the
    candidates in flattened order; W on L+, M on L- (C2) when the gate is on."""
    s = -logp.detach()
    out = torch.ones_like(adv)
    for sign, weight, used in ((1, w, True), (-1, m, variant == "C2")):
        cand = [(i, t) for i in range(adv.shape[0]) for t in range(adv.shape[1])
                if mask[i, t] and (adv[i, t] > 0 if sign > 0 else adv[i, t] < 0)]
        if not cand or ratio <= 0 or not used:
            continue
        k = min(max(1, int(len(cand) * ratio + 0.999999)), len(cand))
        top = torch.topk(torch.tensor([float(s[i, t]) for i, t in cand]), k=k, largest=True).indices
        if gate:
            for j in top.tolist():
                out[cand[j]] = weight
    return out


def _mirror_controller(entropies, **kw):
    """mirrors ``STAREController.update`` over a sequence of steps: (gate, W, M) after each."""
    W, M, gate, out = kw["reweight_w"], kw["reweight_m"], True, []
    for h in entropies:
        if math.isfinite(h):
            gate = h < kw["target_entropy"]
            if kw["adaptive"] and kw["alpha"] != 0:
                sgn = (kw["target_entropy"] > h) - (kw["target_entropy"] < h)
                W = min(max(W + kw["alpha"] * sgn, 1.0), kw["w_max"])
                M = min(max(M - kw["alpha"] * sgn, kw["m_min"]), 1.0)
        out.append((gate, W, M))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.37, 1.0])
@pytest.mark.parametrize("gate", [True, False])
def test_omega_equals_the_reference(seed, variant, ratio, gate):
    logp, _, adv, mask = _batch(seed)
    mine, _, _ = stare_omega(-logp, adv, mask, variant=variant, ratio=ratio, gate=gate, w=1.1, m=0.9)
    ref = _mirror_weights(logp, adv, mask, variant, ratio, 1.1, 0.9, gate)
    assert torch.equal(mine[mask], ref[mask])


@pytest.mark.parametrize("variant", ["O1", "C2"])
def test_the_loss_is_the_references_dual_clip_surrogate_times_omega(variant):
    """mirrors ``compute_policy_loss_stare``: dual clip (c = 10), the rollout weight, then
    omega, token-mean over the valid tokens."""
    logp, old, adv, mask = _batch(11)
    logp.requires_grad_(True)
    iw = torch.rand(adv.shape, generator=torch.Generator().manual_seed(2)) + 0.5
    loss, _ = algos.LOSSES.call("stare", logprobs=logp, old_logprobs=old, advantages=adv, response_mask=mask,
                                aggregation="token-mean", token_weight=iw, variant=variant, top_ratio=0.2)
    ratio = torch.exp((logp - old).clamp(-20, 20))
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 10.0), pg)
    ref = (pg * iw * _mirror_weights(logp, adv, mask, variant, 0.2, 1.1, 0.9, True))[mask].sum() / mask.sum()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-7)


def test_the_ceil_and_at_least_one_rule():
    assert [top_count(n, 0.1) for n in (0, 1, 3, 10, 11, 20, 21)] == [0, 1, 1, 1, 2, 2, 3]
    assert top_count(5, 0.0) == 0 and top_count(5, 1.0) == 5
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    s = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.2, 0.8]])
    omega, lp, ln = stare_omega(s, adv, torch.ones(2, 3, dtype=torch.bool), variant="C2", ratio=0.1, gate=True,
                                w=1.1, m=0.9)
    assert lp.tolist() == [[False, True, False], [False] * 3] and ln.tolist() == [[False] * 3, [False, False, True]]
    assert torch.equal(omega, torch.tensor([[1, 1.1, 1], [1, 1, 0.9]]))


def test_ties_at_the_boundary_go_to_the_earlier_position_and_the_count_is_the_references():
    """torch.topk (the reference) breaks ties at the k-th value in an unspecified order; we
    break them by position. The count is the reference's, and a tie that does not straddle
    the boundary selects the same tokens."""
    s = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.2, 0.1, 0.1, 0.3, 0.4]])
    adv, mask = torch.ones_like(s), torch.ones_like(s, dtype=torch.bool)
    _, lp, _ = stare_omega(s, adv, mask, variant="O1", ratio=0.3, gate=True, w=1.1, m=0.9)  # k = 4
    assert lp[0].nonzero().squeeze(-1).tolist() == [0, 1, 2, 3]  # 2.0, then three of the four 1.0s: the first three
    ref = _mirror_weights(-s, adv, mask, "O1", 0.3, 1.1, 0.9, True)
    assert int((ref == 1.1).sum()) == int(lp.sum()) == 4
    _, lp5, _ = stare_omega(s, adv, mask, variant="O1", ratio=5 / 11, gate=True, w=1.1, m=0.9)  # k = 5: all tied in
    assert torch.equal(lp5, _mirror_weights(-s, adv, mask, "O1", 5 / 11, 1.1, 0.9, True) == 1.1)


def test_gate_off_is_the_host_loss_exactly():
    logp, old, adv, mask = _batch(5)
    common = dict(old_logprobs=old, advantages=adv, response_mask=mask, aggregation="token-mean",
                  eps_low=0.2, eps_high=0.28, dual_clip=10.0)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    la, _ = algos.compute_policy_loss("stare", a, loss_state={"gate_on": False, "reweight_w": 1.5}, **common)
    lb, _ = algos.compute_policy_loss("ppo", b, **common)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)


def test_the_adaptive_controller_over_five_steps_equals_the_reference():
    kw = dict(target_entropy=0.3, reweight_w=1.1, reweight_m=0.9, adaptive=True, alpha=0.2, w_max=1.5, m_min=0.5)
    steps = [0.5, 0.2, 0.25, math.nan, 0.3, 0.1]
    ctl = StareController(**kw)
    got = []
    for h in steps:
        ctl.update(h)
        got.append((ctl.gate_on, ctl.reweight_w, ctl.reweight_m))
    want = _mirror_controller(steps, **kw)
    assert [g for g, *_ in got] == [g for g, *_ in want] == [False, True, True, True, False, True]
    for (_, w1, m1), (_, w2, m2) in zip(got, want):
        assert w1 == pytest.approx(w2) and m1 == pytest.approx(m2)
    assert (got[-1][1], got[-1][2]) == pytest.approx((1.5, 0.5))  # clipped at w_max / m_min
    fixed = StareController(**{**kw, "adaptive": False})
    for h in steps:
        fixed.update(h)
    assert (fixed.reweight_w, fixed.reweight_m, fixed.gate_on) == (1.1, 0.9, True)


def test_the_step_state_round_trips_and_batch_selection_equals_one_micro_batch_on_policy():
    logp, _, adv, mask = _batch(3)
    params = {"selection": "batch", "top_ratio": 0.25, "target_entropy": 5.0}
    ent = torch.where(mask, 0.75, float("nan"))  # token-mean 0.75 (padding never counts)
    state, persisted, metrics = algos.loss_step_state("stare", params, {}, entropy=ent, response_mask=mask,
                                                      old_logprobs=logp, advantages=adv, loss_mask=mask)
    assert metrics == {"stare/batch_entropy": 0.75} and persisted["gate_on"] is True
    assert state["threshold_pos"] == stare_thresholds(-logp, adv, mask, 0.25)["threshold_pos"]
    common = dict(advantages=adv, response_mask=mask, aggregation="token-mean", top_ratio=0.25)
    by_batch, _ = algos.compute_policy_loss("stare", logp, logp, selection="batch", loss_state=state, **common)
    by_micro, _ = algos.compute_policy_loss("stare", logp, logp, loss_state=persisted, **common)
    assert torch.equal(by_batch, by_micro)  # distinct surprisals: the same tokens either way
    assert algos.loss_step_state("ppo", {}, {}, entropy=ent, response_mask=mask, old_logprobs=logp, advantages=adv,
                                 loss_mask=mask) == (None, {}, {})
    with pytest.raises(ValueError, match="selection='batch' needs the step's thresholds"):
        algos.compute_policy_loss("stare", logp, logp, selection="batch", **common)


@pytest.mark.parametrize("params, named", [
    ({"top_ratio": 1.5}, "top_ratio must be in \\[0, 1\\]"), ({"top_ratio": -0.1}, "top_ratio"),
    ({"reweight_w": 0.9}, "reweight_w must be >= 1"), ({"reweight_m": 1.2}, "reweight_m must be in \\(0, 1\\]"),
    ({"reweight_m": 0.0}, "reweight_m"), ({"w_max": 1.0}, "w_max must be >= reweight_w"),
    ({"m_min": 0.95}, "m_min must be in"), ({"alpha": -0.01}, "alpha must be >= 0"),
    ({"target_entropy": float("nan")}, "target_entropy must be a finite number"),
    ({"reweight_w": float("inf")}, "reweight_w must be a finite number"), ({"top_ratio": "0.1"}, "top_ratio"),
    ({"variant": "O2"}, "variant must be one of"), ({"selection": "rank"}, "selection one of"),
    ({"adaptive": "yes"}, "adaptive must be true or false"), ({"dual_clip": 1.0}, "dual_clip must be > 1"),
])
def test_hostile_parameters_are_named(params, named):
    with pytest.raises(ValueError, match=named):
        algos.LOSSES.check_params("stare", params)



def test_a_restored_controller_keeps_its_state_and_takes_the_new_settings():
    old = StareController(target_entropy=0.3, reweight_w=1.3, reweight_m=0.7, adaptive=True, alpha=0.1)
    old.update(0.1)
    new = StareController(target_entropy=0.05, reweight_w=1.1, reweight_m=0.9, adaptive=True, alpha=0.2)
    new.load_state_dict(old.state_dict())
    assert (new.reweight_w, new.reweight_m, new.gate_on) == pytest.approx((1.4, 0.6, True))
    assert (new.target_entropy, new.alpha) == (0.05, 0.2)
    new.update(0.1)  # above the new target: the gate closes, W and M step back by the new alpha
    assert (new.gate_on, new.reweight_w, new.reweight_m) == pytest.approx((False, 1.2, 0.8))


def test_micro_batch_selection_reads_the_host_once():
    """selection micro_batch: one host read per call of the loss (both candidate counts in one
    ``tolist``) -- each ``nonzero`` / ``.item()`` / ``tolist`` is a device sync on a GPU -- and
    the same tokens as the reference's per-set selection."""
    from torch.utils._python_dispatch import TorchDispatchMode

    logp, _, adv, mask = _batch(3)
    surprisal = -logp
    reads = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero"):
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    orig = torch.Tensor.tolist

    def tolist(t):
        reads.append("tolist")
        with torch.utils._python_dispatch._disable_current_modes():
            return orig(t)

    torch.Tensor.tolist = tolist
    try:
        with Count():
            omega, l_pos, l_neg = stare_omega(surprisal, adv, mask, variant="C2", ratio=0.3, gate=True, w=1.2, m=0.8)
    finally:
        torch.Tensor.tolist = orig
    assert reads == ["tolist"], reads
    want = _mirror_weights(logp, adv, mask, "C2", 0.3, 1.2, 0.8, True)
    torch.testing.assert_close(omega[mask], want[mask])
