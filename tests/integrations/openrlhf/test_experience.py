"""registry_advantages on OpenRLHF Experience objects split into micro-batches."""

import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.dapo import overlong_penalty
from hapo_openrlhf.integrations.openrlhf.controller.experience import registry_advantages


def _typed(cfg):
    """The typed run config of a test's config dict (the controller reads ``args.hapo`` through
    ``config.transported``)."""
    from hapo_openrlhf.config import RunConfig, from_dict

    return from_dict(RunConfig, cfg)


def _cfg(estimator="hapo", params=None, overlong=False, max_new=12):
    return {
        "rollout": {"max_new_tokens": max_new},
        "algorithm": {"estimator": estimator, "estimator_params": {"alpha": 0.2, "phi": 2.0} if params is None else params,
                      "overlong": {"enable": overlong, "cache_len": 4}, "quadrant_split": "group_mean",
                      "quadrant_quantile": 0.8, "quadrant_threshold": None},
    }


def _rollout(n_groups=3, n=4, seed=0):
    """Per-sample (reward, length, entropy row) in OpenRLHF's rollout order (groups contiguous)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_groups * n):
        L = int(torch.randint(3, 12, (1,), generator=g))
        rows.append((float(torch.rand(1, generator=g) > 0.5), L, torch.rand(L, generator=g) * 2))
    return rows


def _experiences(rows, split):
    """OpenRLHF Experience micro-batches (each padded to its own width), rows shuffled across them."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1)).tolist()
    exps, i = [], 0
    for size in split:
        idx = perm[i:i + size]
        i += size
        W = max(rows[j][1] for j in idx)
        mask = torch.zeros(size, W, dtype=torch.long)
        ent = torch.zeros(size, W)
        for r, j in enumerate(idx):
            mask[r, :rows[j][1]] = 1
            ent[r, :rows[j][1]] = rows[j][2]
        e = Experience(sequences=torch.zeros(size, W + 2, dtype=torch.long), action_mask=mask,
                       rewards=torch.tensor([rows[j][0] for j in idx]),
                       response_length=torch.tensor([rows[j][1] for j in idx]), index=idx, info={})
        e.behaviour_entropy = ent
        exps.append(e)
    return exps


def _whole_batch(rows, n):
    W = max(L for _, L, _ in rows)
    mask = torch.zeros(len(rows), W, dtype=torch.bool)
    ent = torch.zeros(len(rows), W)
    for j, (_, L, h) in enumerate(rows):
        mask[j, :L] = True
        ent[j, :L] = h
    rewards = torch.tensor([r for r, _, _ in rows])
    # the experiences' sequences are all token 0: every low-entropy run is shared (LESS clusters)
    return algos.AdvantageInputs(rewards=rewards, response_mask=mask, entropy=ent,
                                 group_index=torch.arange(len(rows)) // n, correct=rewards > 0.5,
                                 response_ids=torch.zeros(len(rows), W, dtype=torch.long))


@pytest.mark.parametrize("estimator, params", [
    ("hapo", {"alpha": 0.2, "phi": 2.0}), ("grpo", {}), ("quadrant", {"quadrants": ["PHR", "NLR"]}),
    ("forking", {"rho": 0.2}), ("hapo", {"alpha": 0.2, "phi": 2.0, "ablate": ["PLR"]}),
    # eapo_entropic's percentiles are over every valid token of the rollout batch: the whole
    # batch meets in the controller, so rows spread over micro-batches (or data-parallel
    # ranks) give the one-batch result
    ("eapo_entropic", {}), ("eapo_entropic", {"kappa": 0.5}), ("pepo", {"window": 5, "temperature": 0.6}),
    ("less", {"min_len": 2}),
])
def test_split_micro_batches_equal_the_whole_batch_registry_output(estimator, params):
    rows, n = _rollout(), 4
    exps = _experiences(rows, [5, 3, 4])
    registry_advantages(exps, _typed(_cfg(estimator, params)), n)
    want = algos.run_estimator(estimator, _whole_batch(rows, n), **params)
    for e in exps:
        for r, j in enumerate(e.index):
            L = rows[j][1]
            torch.testing.assert_close(e.advantages[r, :L], want.advantages[j, :L])
            assert float(e.advantages[r, L:].abs().sum()) == 0
            keep = want.loss_mask[j, :L] if want.loss_mask is not None else torch.ones(L, dtype=torch.bool)
            assert e.action_mask[r, :L].bool().tolist() == keep.tolist()  # quadrant masks shrink the loss
        assert e.returns is not e.advantages and torch.equal(e.returns, e.advantages)
        assert set(e.info) >= {"quadrant/threshold", "entropy/behaviour_mean", "return"}
        assert all(v.shape == (len(e.index),) for v in e.info.values())  # OpenRLHF splits info per sample


def test_overlong_penalty_is_in_the_reward_before_the_estimator():
    rows, n = _rollout(seed=2), 4
    exps = _experiences(rows, [6, 6])
    registry_advantages(exps, _typed(_cfg("grpo", {}, overlong=True, max_new=11)), n)
    inp = _whole_batch(rows, n)
    pen = overlong_penalty(torch.tensor([L for _, L, _ in rows]), 11, 4)
    assert float(pen.min()) < 0  # the test data does hit the overlong window
    want = algos.run_estimator("grpo", algos.AdvantageInputs(
        rewards=inp.rewards + pen, response_mask=inp.response_mask, entropy=inp.entropy,
        group_index=inp.group_index))
    for e in exps:
        for r, j in enumerate(e.index):
            torch.testing.assert_close(e.advantages[r, :rows[j][1]], want.advantages[j, :rows[j][1]])
            assert float(e.rewards[r]) == pytest.approx(rows[j][0] + float(pen[j]))


def test_bad_batches_are_errors():
    rows, n = _rollout(), 4
    exps = _experiences(rows[:10], [5, 5])  # 10 rows are not whole groups of 4
    with pytest.raises(ValueError, match="whole groups"):
        registry_advantages(exps, _typed(_cfg()), n)
    exps = _experiences(rows, [6, 6])
    exps[1].behaviour_entropy = exps[1].behaviour_entropy[:, :-1]
    with pytest.raises(RuntimeError, match="does not match"):
        registry_advantages(exps, _typed(_cfg()), n)
    exps = _experiences(rows, [6, 6])
    exps[0].rewards[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite reward"):
        registry_advantages(exps, _typed(_cfg()), n)


def test_mismatch_by_entropy_half_over_micro_batches():
    """With the engines' log-probs on the experiences (the correction on), the step's metrics
    split actor/vllm_kl at the published cut (each group's mean token entropy), computed on
    the whole batch however OpenRLHF cut it into micro-batches."""
    from hapo_openrlhf.algos.is_correction import mismatch_by_entropy

    rows = _rollout()
    exps = _experiences(rows, [5, 4, 3])
    g = torch.Generator().manual_seed(3)
    for e in exps:
        e.action_log_probs = -torch.rand(e.action_mask.shape, generator=g)
        e.rollout_log_probs = e.action_log_probs - 0.05 * e.behaviour_entropy  # a mismatch growing with H
    got = registry_advantages(exps, _typed(_cfg()), 4)["metrics"]
    inp = _whole_batch(rows, 4)
    _, tau = algos.split_quadrants(inp, "group_mean", 0.8, None)
    W = inp.response_mask.shape[1]
    diff = torch.zeros(len(rows), W)
    for e in exps:
        for r, j in enumerate(e.index):
            L = rows[j][1]
            diff[j, :L] = (e.rollout_log_probs - e.action_log_probs)[r, :L]
    want = mismatch_by_entropy(torch.zeros_like(diff), diff, inp.response_mask, inp.entropy, tau)
    assert set(want) == {"actor/vllm_kl_high_entropy", "actor/vllm_kl_low_entropy"}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6)
    assert got["actor/vllm_kl_high_entropy"] < got["actor/vllm_kl_low_entropy"] < 0
    # without the engines' log-probs (correction off) nothing is logged
    assert "actor/vllm_kl_high_entropy" not in registry_advantages(_experiences(rows, [12]), _typed(_cfg()), 4)["metrics"]


def test_nucleus_logmass_metric_is_the_mean_over_response_tokens():
    """rollout/nucleus_logmass: the mean of the actors' per-token log P(nucleus) over every
    response token of the batch (padding excluded), hand-computed; absent at top-p 1;
    a micro-batch without it under top-p is an error, not a silently partial mean."""
    rows = _rollout()
    exps = _experiences(rows, [5, 4, 3])
    total, count = 0.0, 0
    for e in exps:
        lm = torch.zeros(e.action_mask.shape)
        for r, j in enumerate(e.index):
            L = rows[j][1]
            lm[r, :L] = -0.01 * (j + 1)  # row j's tokens each carry -0.01 (j + 1)
            total += -0.01 * (j + 1) * L
            count += L
        lm[e.action_mask == 0] = -5.0  # padding positions must not count
        e.nucleus_logmass = lm
    got = registry_advantages(exps, _typed(_cfg()), 4)["metrics"]
    assert got["rollout/nucleus_logmass"] == pytest.approx(total / count, abs=1e-6)
    assert "rollout/nucleus_logmass" not in registry_advantages(_experiences(rows, [12]), _typed(_cfg()), 4)["metrics"]
    exps = _experiences(rows, [6, 6])
    exps[0].nucleus_logmass = torch.zeros(exps[0].action_mask.shape)
    exps[1].nucleus_logmass = None
    with pytest.raises(RuntimeError, match="nucleus log-mass missing"):
        registry_advantages(exps, _typed(_cfg()), 4)


@pytest.mark.parametrize("selection", ["micro_batch", "batch"])
def test_the_stateful_losss_step_is_over_the_whole_batch(selection):
    """STARE's controller steps once per step from the token-mean behaviour entropy of the
    whole rollout batch (every data-parallel rank's rows meet in the controller), and a
    batch-wide selection's thresholds are over all of it: rows spread over micro-batches
    give the one-batch result."""
    from hapo_openrlhf.algos.stare import stare_thresholds

    rows, n = _rollout(seed=4), 4
    exps = _experiences(rows, [5, 3, 4])
    g = torch.Generator().manual_seed(7)
    for e in exps:
        e.action_log_probs = -torch.rand(e.action_mask.shape, generator=g) * 3 * e.action_mask
    cfg = _cfg("grpo", {})
    cfg["algorithm"].update(loss="stare", loss_params={"selection": selection, "top_ratio": 0.2, "target_entropy": 0.9,
                                                       "adaptive": True})
    result = registry_advantages(exps, _typed(cfg), n, persisted={"reweight_w": 1.2, "reweight_m": 0.8})
    state, persisted, metrics = result["loss_state"], result["persisted"], result["metrics"]
    whole = _whole_batch(rows, n)
    mean = float(whole.entropy[whole.response_mask].mean())
    assert metrics["stare/batch_entropy"] == pytest.approx(mean)
    assert persisted["gate_on"] == (mean < 0.9)
    assert persisted["reweight_w"] == pytest.approx(1.2 + (0.01 if mean < 0.9 else -0.01))
    if selection == "batch":
        W = whole.response_mask.shape[1]
        s = torch.zeros(len(rows), W)
        adv = torch.zeros(len(rows), W)
        for e in exps:
            for r, j in enumerate(e.index):
                s[j, :e.action_mask.shape[1]] = -e.action_log_probs[r]
                adv[j, :e.advantages.shape[1]] = e.advantages[r]
        want = stare_thresholds(s, adv, whole.response_mask, 0.2)
        assert (state["threshold_pos"], state["threshold_neg"]) == pytest.approx(
            (want["threshold_pos"], want["threshold_neg"]))
    else:
        assert "threshold_pos" not in state
    cfg["algorithm"].update(loss="ppo", loss_params={})
    plain = registry_advantages(_experiences(rows, [5, 3, 4]), _typed(cfg), n)
    assert (plain["loss_state"], plain["persisted"]) == (None, {})
    assert not any(k.startswith("stare/") for k in plain["metrics"])


def test_eapo_kappa_decay_is_keyed_to_the_optimizer_steps_before_the_batch():
    """On OpenRLHF the experience maker passes RL steps so far x optimizer steps per RL step
    (samples / train_batch_size x ppo_epochs): kappa_t = kappa (1 - min(step / K, 1)), and a
    resumed maker (its optimizer-step count restored from the checkpoint) continues the schedule."""
    import math
    from types import SimpleNamespace

    from hapo_openrlhf.integrations.openrlhf.controller.experience import HapoExperienceMaker, optimizer_steps_per_step

    cfg = _cfg("eapo_entropic", {"decay_steps": 40})
    cfg.update(rollout={"max_new_tokens": 12, "prompts_per_step": 3, "samples_per_prompt": 4},
               openrlhf={"train_batch_size": 6}, optim={"ppo_epochs": 2})
    cfg["algorithm"].update(loss="ppo", loss_params={})
    assert optimizer_steps_per_step(_typed(cfg)) == 4  # 12 samples / 6 x 2 epochs
    maker = object.__new__(HapoExperienceMaker)
    maker.strategy = SimpleNamespace(args=SimpleNamespace(hapo=cfg, rollout=SimpleNamespace(n_samples_per_prompt=4)))
    maker.loss_state = {}
    kappas = []
    for step in (0, 1, 5, 9, 12):  # 12 x 4 = 48 optimizer steps: past K, kappa 0
        # a resumed maker: the RL steps and the optimizer steps taken, as the controller restores them
        maker._step, maker._optimizer_steps = step, 4 * step
        exps = _experiences(_rollout(), [5, 3, 4])
        maker.compute_advantages_and_returns(exps)
        kappas.append(float(exps[0].info["eapo/kappa"][0]))
        assert maker._step == step + 1 and maker._optimizer_steps == 4 * step + 4
    assert kappas == pytest.approx([math.log(4) * (1 - min(4 * s / 40, 1)) for s in (0, 1, 5, 9, 12)])
    # the advantages are the registry's at that step
    import dataclasses

    rows = _rollout()
    exps = _experiences(rows, [5, 7])
    registry_advantages(exps, _typed(cfg), 4, optimizer_step=20)
    want = algos.run_estimator("eapo_entropic", dataclasses.replace(_whole_batch(rows, 4), step=20), decay_steps=40)
    assert want.metrics["eapo/kappa"] == pytest.approx(math.log(4) / 2)
    for e in exps:
        for r, j in enumerate(e.index):
            torch.testing.assert_close(e.advantages[r, :rows[j][1]], want.advantages[j, :rows[j][1]])
