"""PRIME end to end on OpenRLHF 0.11.2 (issue 59): OpenRLHF's own controller loop with the implicit
PRM as its own Ray actor group (``actors/prm_actor.py``, in OpenRLHF's critic slot: its own DeepSpeed
engine, optimizer, reference and checkpoint), trained online in the recipe's ``update: before``
order while the experience is made (``controller/prm.py``), on a real Ray local cluster with the
shim's CPU rollout engine. Checked: the advantages reaching the loss are the registry's PRIME
advantages from the logged q and outcomes; the PRM trained (q left 0, where an untrained PRM -- its
own reference -- scores exactly 0) and logged its loss and held-out metrics; a run resumed from its
step-1 checkpoint (policy and PRM, both optimizers) scores step 2's responses bitwise as the
uninterrupted run did, and its update agrees up to the order the engine returned the batch's groups
in (which sets the order DeepSpeed sums the micro-batches' gradients)."""

import math
import shutil

import pytest
import torch

from tests.integrations.openrlhf.e2e_util import jsonl, run_e2e

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
PRIME = ["algorithm.estimator=prime", "algorithm.estimator_params={beta: 0.05}", "algorithm.loss=ppo",
         "algorithm.overlong={enable: false}", "prm.update=before", "prm.lr=0.001", "trainer.steps=2",
         "trainer.save_every=1"]


def _run(out, dump, model, *sets):
    return run_e2e(out, dump, [*PRIME, f"model.path={model}", *sets], engine="cpu")


def _registry_prime(d):
    from hapo_openrlhf import algos

    inputs = algos.AdvantageInputs(rewards=d["rewards"], response_mask=d["response_mask"], entropy=d["entropy"],
                                   group_index=d["group_index"], correct=d["rewards"] > 0.5,
                                   process_q=d["process_q"])
    return algos.run_estimator("prime", inputs, beta=0.05).advantages


def test_prime_trains_its_prm_group_and_resumes_exactly(tmp_path, warm_model):
    out, dump = tmp_path / "run", tmp_path / "dump"
    p = _run(out, dump, warm_model)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    m = jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2]
    for r in m:  # the PRM's update and its held-out metrics, every step; the policy trained on PRIME's advantages
        assert r["prm/loss"] > 0 and r["prm/grad_norm"] > 0 and 0 <= r["prm/acc_heldout"] <= 1, r
        assert r["prm/skipped_steps"] == 0, r  # the non-finite guard's count (test_prm_nonfinite.py), logged
        assert "prime/process_share" in r and "prm/outcome_acc_heldout" in r and r["actor_grad_norm"] > 0, r
    # step 1's update starts from the PRM's reference: q = 0, sigmoid(0) = 1/2 for every response, loss ln 2
    assert m[0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    # the advantages are the registry's PRIME advantages of the logged q and outcomes, and those reached the loss
    loss_rows = jsonl(dump / "loss_rank0.jsonl")
    assert len(loss_rows) == 2 * 16
    for step in (1, 2):
        d = torch.load(dump / f"advantages_step{step}.pt")
        mask = d["response_mask"]
        assert d["process_q"].shape == mask.shape
        # before: the PRM trained on the batch before scoring it (an untrained PRM is its reference: q == 0)
        assert float(d["process_q"][mask].abs().max()) > 1e-4, step
        assert (float(d["prm_seen"].abs().max()) == 0) == (step == 1), step  # held out: before the step's update
        torch.testing.assert_close(d["advantages"], _registry_prime(d))
        assert float(d["advantages"][mask].abs().max()) > 0.1, step
        exp_rows = jsonl(dump / f"experiences_step{step}.jsonl")
        by_tokens = {tuple(r["tokens"]): r["advantages"] for r in exp_rows}
        for r in loss_rows[(step - 1) * 16: step * 16]:
            assert r["advantages"] == pytest.approx(by_tokens[tuple(r["tokens"])], abs=1e-6)
    # the PRM's DeepSpeed checkpoint beside the policy's (OpenRLHF's critic directory), every step
    assert {d.name for d in (out / "ckpt" / "_critic").iterdir()} >= {"global_step1", "global_step2"}

    # resume from the step-1 checkpoint (policy, PRM, both optimizers, the prompt order): step 2 again
    # (within the first episode: the shim's engine seeds a request by its prompt and the prompt's
    # occurrence in the engine's life, which a fresh engine counts from 0 again)
    again = tmp_path / "again"
    shutil.copytree(out, again)
    for d in (again / "ckpt" / "_actor", again / "ckpt" / "_critic"):  # as if killed after step 1's save
        for tag in d.iterdir():
            if tag.is_dir() and tag.name != "global_step1":
                shutil.rmtree(tag)
        (d / "latest").write_text("global_step1")
    shutil.rmtree(again / "final")
    p = _run(again, tmp_path / "dump2", warm_model)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "Loading the PRM checkpoint" in log and "Global step 2:" in log and "Global step 1:" not in log
    (dumped,) = (tmp_path / "dump2").glob("advantages_step*.pt")  # the resumed run's one step
    a, b = torch.load(dump / "advantages_step2.pt"), torch.load(dumped)
    # the same responses in the same order (controller/trainer.py's dispatch_order: the prompts' order,
    # not the engine's completion order), so the resumed step is the uninterrupted one's, bitwise: the
    # restored policy (its behaviour entropy), the restored PRM (its scores before the update, and after
    # it, with its restored optimizer), the advantages, and the policy's step on them
    rows_a = [tuple(r["tokens"]) for r in jsonl(dump / "experiences_step2.jsonl")]
    (rows,) = (tmp_path / "dump2").glob("experiences_step*.jsonl")
    assert [tuple(r["tokens"]) for r in jsonl(rows)] == rows_a
    for k in ("rewards", "response_mask", "entropy", "prm_seen", "process_q", "advantages"):
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert float(a["prm_seen"][a["response_mask"]].abs().max()) > 1e-4  # the PRM of step 1, not its reference
    resumed = jsonl(again / "metrics.jsonl")[-1]
    assert resumed["step"] == 2
    for k in ("prm/loss", "prm/grad_norm", "prm/acc_heldout", "prm/outcome_acc_heldout", "actor_grad_norm",
              "policy_loss"):
        assert resumed[k] == m[1][k], k


def test_prime_beside_the_megatron_actor_at_tp2(tmp_path, warm_model):
    """The same PRM group beside the Megatron policy at TP 2: OpenRLHF's controller hands both TP ranks
    every micro-batch (``ds.tensor_parallel_size`` carries the Megatron layout), and the PRM group,
    built from the same arguments, trains as pure data parallelism with each micro-batch on both of its
    actors alike (``prm_actor``: DeepSpeed's batch counts each row twice). One step: the advantages
    reaching the loss are the registry's from the logged q, the PRM's loss from its reference is ln 2."""
    pytest.importorskip("megatron.core")
    out, dump = tmp_path / "run", tmp_path / "dump"
    p = run_e2e(out, dump, [*PRIME, f"model.path={warm_model}", "trainer.steps=1", "backend=megatron",
                            "megatron.tensor_parallel=2", "megatron.params_dtype=fp32",
                            "openrlhf.actor_gpus_per_node=2"], engine="cpu", HAPO_SHIM_MEGATRON="1")
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    (r,) = jsonl(out / "metrics.jsonl")
    assert r["prm/loss"] == pytest.approx(math.log(2), abs=1e-6) and r["prm/grad_norm"] > 0, r
    d = torch.load(dump / "advantages_step1.pt")
    mask = d["response_mask"]
    assert float(d["process_q"][mask].abs().max()) > 1e-4 and float(d["prm_seen"].abs().max()) == 0
    torch.testing.assert_close(d["advantages"], _registry_prime(d))
    exp_rows = jsonl(dump / "experiences_step1.jsonl")
    by_tokens = {tuple(e["tokens"]): e["advantages"] for e in exp_rows}
    loss_rows = jsonl(dump / "loss_rank0.jsonl")
    assert len(loss_rows) == 16
    for e in loss_rows:
        assert e["advantages"] == pytest.approx(by_tokens[tuple(e["tokens"])], abs=1e-6)
