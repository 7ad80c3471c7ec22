"""The Megatron policy actor under context parallelism (issue 58): the whole actor -- its parallel
state with CP, the old-log-prob pass, the behaviour entropy the controller shapes advantages with,
three losses' training steps, the distributed optimizer over DP x CP, the saved model -- at
``megatron.context_parallel`` 2 on two ranks equals the same actor at CP 1 on one rank, on Transformer
Engine's spec (the TE 2.20.2 stand-in with its CP attention, tests/megatron/te_stub), packed (THD)
micro-batches. Each CP rank forwards its share of every packed sequence (TE's load-balanced split);
the values are gathered over CP before the loss, so every family runs on the whole micro-batch:

* **HAPO**: its token-level advantages from the behaviour entropy of the actor's own pass (the
  experience maker's input), then the clipped surrogate;
* **STARE** (C2): the loss itself selects the most surprising tokens of each micro-batch;
* **EAPO-entropic**: advantages from the 10th/90th percentiles of the whole batch's behaviour entropy.

The three run one after another on the same actor (two optimizer steps each), as the same sequence
at CP 1. A tiny Qwen3-MoE with rollout routing replay runs at EP 2 x CP 2 against EP 1 x CP 1; a run
saved at one CP size resumes at the other; the token budget under CP and the refusals are tested
here too. The model at CP 2 against CP 1 and Hugging Face, gradients, checkpoints and the memory
per rank: tests/megatron/test_context_parallel.py; the split and the TE stand-in's attention:
test_cp_split.py; OpenRLHF's loop at CP 2: test_e2e_megatron_cp.py."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise RuntimeError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed")
    pytest.skip("megatron-core not installed (the megatron extra)", allow_module_level=True)

from tests.integrations.openrlhf.test_megatron_actor import _args, _experiences, _free_port, _tiny_model_dir  # noqa: E402

CP_TE = ["megatron.layer_spec=te", "openrlhf.packing_samples=true"]
STARE = ["algorithm.loss=stare", "algorithm.loss_params={variant: C2, top_ratio: 0.3, eps_low: 0.2, eps_high: 0.28}"]
PHASES = (("hapo", "hapo", {"alpha": 0.2, "phi": 2.0}, []), ("stare", None, {}, STARE),
          ("eapo_entropic", "eapo_entropic", {"kappa": 1.386}, []))


def _shaped(estimator, params, exps, entropies):
    """The step's advantages by ``estimator`` from the behaviour entropy the actor returned, over every
    row of the step at once (EAPO's percentiles are the whole batch's), two prompts per experience."""
    from hapo_openrlhf.algos.advantages import AdvantageInputs, compute_advantages

    mask = torch.cat([e.action_mask for e in exps]).float()
    rewards = torch.cat([(e.rewards > 0.5).float() for e in exps])
    groups = torch.arange(2 * len(exps)).repeat_interleave(2)
    inputs = AdvantageInputs(rewards=rewards, response_mask=mask, entropy=torch.cat(entropies).float() * mask,
                             group_index=groups, correct=rewards > 0.5)
    return compute_advantages(estimator, inputs, **params).split([e.action_mask.shape[0] for e in exps])


def _cp_worker(rank, world, port, phases, args_by_phase, model_dir, data, out_dir, routes=None):
    from tests.megatron.cuda_shim import install

    install()
    import torch.distributed as dist

    from hapo_openrlhf.config.loader import transported
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import fingerprint, loss_from_config
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    first = args_by_phase[0]
    actor = MegatronPolicyActorImpl(world, rank, "127.0.0.1", port)
    actor.init_model_from_pretrained(SimpleNamespace(args=first, is_rank_0=lambda: rank == 0), str(model_dir),
                                     max_steps=6, vllm_engines=None)
    from megatron.core import parallel_state as ps

    # the tokens this rank's model forwards: its share of each packed micro-batch under CP
    record = {"phases": [], "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
              "tokens": 0}
    if getattr(actor.model, "embedding", None) is not None:  # the first pipeline stage
        actor.model.embedding.register_forward_hook(
            lambda mod, args, kwargs, out: record.__setitem__("tokens", record["tokens"] + kwargs["input_ids"].numel()),
            with_kwargs=True)
    for (name, estimator, params, _), args, exps in zip(phases, args_by_phase, data, strict=True):
        actor.loss_fn = loss_from_config(transported(args.hapo))
        if name == "stare":  # the controller's state for the step (what the experience maker sends)
            actor.set_loss_state({"gate_on": True, "reweight_w": 1.5, "reweight_m": 0.5})
        if routes is not None:  # R3: what the controller sends before the step's first forward
            actor.set_routes(routes)
        lps = [actor.forward(e.sequences, e.action_mask, e.attention_mask) for e in exps]
        ents = [actor.pop_behaviour(fingerprint(e.sequences, e.attention_mask))[0] for e in exps]
        advs = _shaped(estimator, params, exps, ents) if estimator else [e.advantages for e in exps]
        for e, lp, a in zip(exps, lps, advs):
            e.advantages = a.float() * e.action_mask
            e.action_log_probs = lp - 0.3 * e.advantages  # off-policy enough that some ratios clip
            actor.append(e)
        status = actor.fit()
        record["phases"].append({"name": name, "lps": lps, "ents": ents, "advs": advs, "status": status})
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    # the load-balancing loss this rank's routers computed in the training passes, per layer (before the
    # coefficient; megatron-core's tracker, never reduced here): at CP 2 each rank's share of every sequence
    lb = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    record["load_balancing"] = None if lb is None else lb["values"].detach().clone()
    record["weights"] = {k: v.detach().clone() for k, v in actor.model.state_dict().items()
                         if not k.endswith("_extra_state")}
    torch.save(record, Path(out_dir) / f"cp{world}_rank{rank}.pt")
    dist.destroy_process_group()


# with megatron-core's load-balancing loss: its token counts are reduced over TP x CP by the router
MOE_R3 = (("hapo", "hapo", {"alpha": 0.2, "phi": 2.0},
           ["megatron.moe.routing_replay=r3", "megatron.moe.aux_loss_coeff=0.1"]),)


@pytest.mark.parametrize("family, pp", [("qwen3", 1), ("qwen3_moe", 1)], ids=["dense", "moe_ep2_r3"])
def test_actor_at_context_parallel_2_equals_context_parallel_1(tmp_path, family, pp):
    """Dense: HAPO, STARE and EAPO-entropic, two optimizer steps each. A tiny Qwen3-MoE (4 experts,
    top-2) with rollout routing replay: at CP 2 its two ranks are also its two expert-parallel ranks
    (EP carved out of DP x CP: each holds two experts, and each rank's share of every sequence
    crosses the all-to-all dispatcher), the recorded routes cut by the split as the tokens are;
    against EP 1 x CP 1 on one rank -- the router statistics and the replay's counts included.
    The MoE case trains with megatron-core's load-balancing loss (0.1): each CP rank's routers compute
    theirs on their share of the tokens. (``pp``: the pipeline's stages each pass their CP share on; megatron-core cannot start PP x CP in
    the actor's rank order, so it is refused at load -- test_dryrun.py -- and the cases here run PP 1.)"""
    from tests.integrations.openrlhf.test_megatron_actor import _recorded_routes
    from tests.megatron._dist import spawn_te

    moe = family == "qwen3_moe"
    phases = MOE_R3 if moe else PHASES if pp == 1 else PHASES[:1]
    model_dir = _tiny_model_dir(tmp_path / "model", False, family)
    # the same rows at both sizes: 4 experiences of 4 rows per phase (two optimizer steps of 8 rows);
    # every CP rank receives the whole micro-batch (OpenRLHF's duplicate actors) and keeps its share
    data = [_experiences(4, seed=11 + i) for i in range(len(phases))]
    table = _recorded_routes(model_dir, data[0])[1] if moe else None
    got = {}
    for cp in (1, 2):
        layout = [f"megatron.context_parallel={cp}", f"megatron.pipeline_parallel={pp}",
                  f"openrlhf.actor_gpus_per_node={cp * pp}", *([f"megatron.expert_parallel={cp}"] if moe else [])]
        args = [_args(tmp_path / f"cp{cp}_{name}", [*CP_TE, *layout, *sets])[1] for name, _, _, sets in phases]
        out = tmp_path / f"out{cp}"
        out.mkdir()
        spawn_te("tests.integrations.openrlhf.test_megatron_actor_cp:_cp_worker", cp * pp, cp * pp, _free_port(),
                 phases, args, model_dir, [[copy.deepcopy(e) for e in d] for d in data], str(out), table,
                 process_group=False)
        got[cp] = [torch.load(out / f"cp{cp * pp}_rank{r}.pt") for r in range(cp)]  # the first stage's CP ranks
    one, (two, two_b) = got[1][0], got[2]
    # CP 2 really split the sequences: each rank forwarded its half of every (padded) packed sequence
    assert (one["cp"], two["cp"], two_b["cp"]) == (1, 2, 2) and two["ep"] == (2 if moe else 1)
    assert two["tokens"] == two_b["tokens"] and 0.5 * one["tokens"] < two["tokens"] < 0.65 * one["tokens"], (
        one["tokens"], two["tokens"])
    for p1, p2, p2b in zip(one["phases"], two["phases"], two_b["phases"], strict=True):
        name = p1["name"]
        for k in ("lps", "ents", "advs"):  # every CP rank answers with the whole batch's values
            for a, b, c in zip(p1[k], p2[k], p2b[k], strict=True):
                # the advantages normalise the entropy within a group, whose spread on this random
                # model is ~0.01 nats: the log-probs' 1e-6 differences come out ~100 times larger
                torch.testing.assert_close(b, a, rtol=0, atol=2e-5 if k != "advs" else 5e-4, msg=f"{name} {k}")
                torch.testing.assert_close(c, b, rtol=0, atol=0, msg=f"{name} {k}: the CP ranks differ")
        assert p2["status"] == p2b["status"], name
        for k, v in p1["status"].items():
            assert p2["status"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (name, k)
        assert p1["status"]["actor_grad_norm"] > 0 and 0 < p1["status"]["ppo_clip_ratio"] < 1, name
        if name == "stare":  # the loss's own selection ran (its metrics reached the status)
            assert any(k.startswith("stare/") for k in p1["status"]), sorted(p1["status"])
    if moe:  # the replay ran on every token at both sizes, and the rollout's routes differ from the router's
        st = one["phases"][0]["status"]
        assert 0.05 < st["moe/rollout_routes_differed_fraction"] < 0.95 and "moe/router_entropy" in st, st
        # the load-balancing loss ran in every training pass: each CP rank's routers computed theirs on
        # their share of the tokens against the expert counts of the whole sequence (reduced over CP), so
        # the two ranks' losses add up to the one rank's, layer by layer (and the weights below agree)
        lb1, lb2 = one["load_balancing"], two["load_balancing"] + two_b["load_balancing"]
        assert lb1.shape == (2,) and bool((lb1 > 0.5).all()), lb1  # about 1 per micro-batch when balanced
        torch.testing.assert_close(lb2, lb1, rtol=1e-5, atol=0)
        assert not torch.equal(two["load_balancing"], two_b["load_balancing"])
    elif pp == 1:  # the shaped advantages are not the raw ones: the behaviour entropy entered them
        assert not torch.equal(one["phases"][0]["advs"][0], one["phases"][2]["advs"][0])
    for k, v in one["weights"].items():  # the model after the optimizer steps, on both CP ranks
        if moe and ".experts." in k:  # each CP (= EP) rank holds two of the four experts
            continue
        for w in (two["weights"][k], two_b["weights"][k]):
            assert float((w - v).abs().max()) <= 2e-6, (k, float((w - v).abs().max()))
    if moe:  # the experts: rank r's local expert j is expert 2 r + j at EP 1
        checked = 0
        for k in (k for k in two["weights"] if ".experts." in k):
            for r, w in enumerate((two["weights"][k], two_b["weights"][k])):
                want = one["weights"][_global_expert_name(k, r, 2)]
                assert float((w - want).abs().max()) <= 2e-6, (k, r)
                checked += 1
        assert checked >= 2 * 2 * 2 * 2, checked  # two layers x two projections x two local experts x two ranks


def _global_expert_name(name: str, rank: int, per: int) -> str:
    """A local expert's parameter name on expert-parallel rank ``rank`` (``per`` experts each) -> its
    name at EP 1: TE's grouped GEMM (``experts.linear_fc1.weight<j>``) or SequentialMLP
    (``experts.local_experts.<j>.``)."""
    import re

    if "local_experts." in name:
        return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + per * rank}.", name)
    return re.sub(r"weight(\d+)$", lambda m: f"weight{int(m.group(1)) + per * rank}", name)


def test_token_budget_counts_each_context_parallel_ranks_share():
    """``train.max_tokens_per_gpu`` under CP counts what one CP rank holds: each row padded to a
    multiple of 2 CP (x TP with sequence parallelism), divided by CP -- so a budget of 16 takes
    twice the rows at CP 2 that it takes at CP 1, and a row's padding counts against it."""
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    def groups(cp, tp=1, sp=False, lengths=(13, 9, 7, 6, 3, 3)):
        me = SimpleNamespace(token_budget=16, layout="thd", cp=cp, tp=tp, moe=False, ep=1,
                             model=SimpleNamespace(config=SimpleNamespace(sequence_parallel=sp)))
        return MegatronPolicyActorImpl._row_groups(me, list(lengths), 4)

    assert groups(1) == [[0, 4], [1, 2], [3, 5]]  # 13 + 3, 9 + 7, 6 + 3 real tokens (first fit, longest first)
    # CP 2: rows padded to multiples of 4 (16, 12, 8, 8, 4, 4), each rank holding half (8, 6, 4, 4, 2, 2)
    assert groups(2) == [[0, 1, 4], [2, 3, 5]]
    # CP 2 x TP 2 with sequence parallelism: multiples of 8 (16, 16, 8, 8, 8, 8) -> 8, 8, 4, 4, 4, 4 per rank
    assert groups(2, 2, True) == [[0, 1], [2, 3, 4, 5]]


@pytest.mark.parametrize("sets, problem", [
    (["megatron.context_parallel=2", "openrlhf.packing_samples=true"], "needs megatron.layer_spec: te"),
    (["megatron.context_parallel=2", *CP_TE, "openrlhf.packing_samples=false"], "needs openrlhf.packing_samples"),
    (["megatron.context_parallel=2", *CP_TE, "megatron.pipeline_parallel=2", "openrlhf.actor_gpus_per_node=4"],
     "context_parallel 2 with pipeline_parallel 2 cannot start"),
    (["megatron.context_parallel=3", *CP_TE], "tensor_parallel x context_parallel x pipeline_parallel (1 x 3 x 1 = 3) "
                                              "must divide the actor world size"),
    (["megatron.context_parallel=2", *CP_TE, "megatron.cp_comm_type=a2a+p2p"], "a2a+p2p (hierarchical"),
    (["megatron.context_parallel=2", *CP_TE, "megatron.cp_comm_type=ring"], "must be p2p, all_gather or a2a"),
    (["megatron.context_parallel=0", *CP_TE], "must be an integer >= 1"),
    (["megatron.context_parallel=2", *CP_TE, "megatron.expert_parallel=4"],
     "expert_parallel 4 must divide the data-parallel size x context_parallel 2"),
])
def test_context_parallel_settings_refused_by_name(tmp_path, sets, problem):
    from hapo_openrlhf.config import load_config
    from tests.integrations.openrlhf.test_megatron_actor import CFG

    with pytest.raises(ValueError, match=None) as e:
        load_config(CFG, ["backend=megatron", "model.path=/unused", "openrlhf.actor_gpus_per_node=2", *sets])
    assert problem in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_te_lacking_the_comm_type_refused_by_name():
    from hapo_openrlhf.megatron.context_parallel import te_problem

    assert te_problem("p2p", "2.20.2") is None and te_problem("a2a", "1.10.0") is None
    assert te_problem("all_gather", "1.11.0+abc123") is None
    assert "cp_comm_type a2a needs transformer-engine >= 1.10.0, installed 1.9.0" in te_problem("a2a", "1.9.0")
    assert "would run p2p instead" in te_problem("all_gather", "1.8")
    assert ">= 1.7.0, installed 1.6.0" in te_problem("p2p", "1.6.0")
    assert "transformer-engine is not installed" in te_problem("p2p", None)
    assert "not a version" in te_problem("p2p", "dev-build")


def test_a2a_needs_heads_divisible_by_context_parallel():
    from hapo_openrlhf.config import MegatronConfig
    from hapo_openrlhf.megatron.families import check_actor_family
    from tests.megatron.test_convert import tiny_model

    hf = tiny_model("qwen3", False).config  # 4 attention heads, 2 key/value heads
    m = MegatronConfig(layer_spec="te", context_parallel=2, cp_comm_type="a2a")
    assert check_actor_family(hf, m).label  # 4 / 2 and 2 / 2: fine
    with pytest.raises(ValueError, match=r"key/value heads over the CP ranks: 2 / tensor_parallel 1 is not a multiple of "
                                         r"context_parallel 4 \(use p2p or all_gather\)"):
        check_actor_family(hf, MegatronConfig(layer_spec="te", context_parallel=4, cp_comm_type="a2a"))
    moe = __import__("tests.megatron.test_moe", fromlist=["tiny_moe"]).tiny_moe().config
    assert check_actor_family(moe, MegatronConfig(layer_spec="te", context_parallel=2, expert_parallel=2)).moe


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)], ids=["cp2_to_cp1", "cp1_to_cp2"])
def test_actor_resumes_across_context_parallel_sizes(tmp_path, saved, resumed):
    """OpenRLHF's requeue path onto another CP size, two ranks each time (TE spec, packed): CP 2 x DP 1
    -> CP 1 x DP 2 and back. The distributed optimizer shards over DP x CP (2 both ways), so its
    dp_reshardable state moves; the weights load bitwise, the controller's client states come back,
    and the next optimizer step equals the uninterrupted run's (loss, grad norm, the weights it
    writes). At DP 2 each rank trains its half of the second batch, as OpenRLHF's controller deals it."""
    from tests.integrations.openrlhf.test_megatron_actor import _args as args_of, check_resumed_run
    from tests.megatron._dist import spawn_te

    _, args_a = args_of(tmp_path, [*CP_TE, f"megatron.context_parallel={saved}"])
    _, args_b = args_of(tmp_path, [*CP_TE, f"megatron.context_parallel={resumed}"])
    assert args_a.ckpt.path == args_b.ckpt.path
    model_dir = _tiny_model_dir(tmp_path / "model", False, "qwen3")
    data = _experiences(4, seed=5)
    batches = [data[:2], data[2:]]
    out = tmp_path / "out"
    out.mkdir()
    target = "tests.integrations.openrlhf.test_megatron_actor:_resume_worker"
    spawn_te(target, 2, 2, _free_port(), args_a, model_dir, batches, str(out), "first", True, saved == 1,
             process_group=False)
    spawn_te(target, 2, 2, _free_port(), args_b, model_dir, batches, str(out), "resume", True, resumed == 1,
             process_group=False)
    layout = json.loads((Path(args_a.ckpt.path) / "_actor" / "step_1" / "hapo_layout.json").read_text())
    assert layout["context_parallel"] == saved and layout["data_parallel"] == 2 // saved
    check_resumed_run(out)
