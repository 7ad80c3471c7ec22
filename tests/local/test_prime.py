"""PRIME on the embedded trainer: the implicit PRM (local/prm.py) in each update order, its
checkpoint and exact resume, the group-accuracy filter, and the config's hostile values."""

import copy
import math

import pytest
import torch

from hapo_openrlhf.algos import prime as P
from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import Batch, LocalTrainer
from hapo_openrlhf.rundir.checkpoint import list_complete, load_checkpoint

from ..conftest import REPO, cli_in_process
from .test_trainer import STOPPED_RUN, _uninterrupted_and_resumed, records

CONFIG = str(REPO / "configs" / "cpu_tiny_prime.yaml")
TINY = ["warmup.steps=10", "trainer.steps=0", "data.synthetic.eval_size=2", "eval.n_samples=1", "trainer.threads=1",
        "rollout.max_new_tokens=12", "eval.max_new_tokens=12", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "algorithm.accuracy_filter.oversample=1.0", "prm.lr=1e-3"]


def _trainer(tmp_path, *extra):
    t = LocalTrainer(load_config(CONFIG, [*TINY, *extra]), tmp_path / "run")
    t.run_warmup()
    return t


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_update_orders_as_the_recipe_names_them(tmp_path):
    """``none`` scores and never trains; ``after`` returns the update's own (pre-step) q, which is 0
    on the first step (phi starts as its reference); ``before`` trains, then scores again: its q is a
    fresh no-grad forward of the updated PRM, equal to an independent update of a copy."""
    t = _trainer(tmp_path)
    b, _ = t.collect()
    ro, outcome, group = b.rollout, b.correct, b.group_index
    mask = ro.response_mask_BR.bool()
    assert outcome.any() or (~outcome).any()

    from dataclasses import replace

    def prm(update):
        t.cfg = replace(t.cfg, prm=replace(t.cfg.prm, update=update))
        return t._build_prm()

    none = prm("none")
    start = _params(none.model)
    q, m = none.step(ro, outcome, group)
    assert bool((q == 0).all()) and not _changed(start, _params(none.model)) and "prm/loss" not in m

    after = prm("after")
    q, m = after.step(ro, outcome, group)
    assert bool((q == 0).all()) and _changed(start, _params(after.model))
    assert m["prm/loss"] == pytest.approx(math.log(2), rel=1e-6)  # sigmoid(0) against any outcome

    before = prm("before")
    twin = copy.deepcopy(before)
    q, m = before.step(ro, outcome, group)
    assert float(q[mask].abs().sum()) > 0 and bool((q[~mask] == 0).all())
    # the same update by hand: one AdamW step on the CE loss of the whole batch, then a forward
    twin.model.train()
    twin.optim.zero_grad()
    loss = P.prm_loss(twin._q(ro, twin.reference_logprobs(ro)), outcome.float(), ro.response_mask_BR, beta=twin.beta)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(twin.model.parameters(), twin.cfg.grad_clip)
    twin.optim.step()
    torch.testing.assert_close(q, twin.score(ro), rtol=0, atol=0)
    assert m["prm/loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    # the reference never moves
    torch.testing.assert_close(_params(before.ref), start, rtol=0, atol=0)


def test_prm_path_and_ref_path_load_a_saved_model_and_refuse_another_vocabulary(tmp_path):
    """prm.path / prm.ref_path: Hugging Face directories (here the warm policy saved, and a model with
    a 300-token vocabulary): the first loads as phi and its reference, the second is refused by name."""
    from dataclasses import replace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hapo_openrlhf.local.model import save_hf

    t = _trainer(tmp_path)
    save_hf(t.model, t.tok, tmp_path / "saved")
    t.cfg = replace(t.cfg, prm=replace(t.cfg.prm, path=str(tmp_path / "saved")))
    p = t._build_prm()
    torch.testing.assert_close(_params(p.model), _params(t.model), rtol=0, atol=0)
    torch.testing.assert_close(_params(p.ref), _params(t.model), rtol=0, atol=0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "other")
    t.cfg = replace(t.cfg, prm=replace(t.cfg.prm, ref_path=str(tmp_path / "other")))
    with pytest.raises(ValueError, match="prm.ref_path .* has a vocabulary of 300 tokens, the policy"):
        t._build_prm()
    t.cfg = replace(t.cfg, prm=replace(t.cfg.prm, path=str(tmp_path / "missing"), ref_path=None))
    with pytest.raises(ValueError, match="prm.path .* does not exist"):
        t._build_prm()


def test_mini_and_micro_batches(tmp_path):
    """``prm.mini_batch_size`` responses per optimizer step (two steps for a batch of 8 at 4);
    ``prm.micro_batch_size`` only splits the forwards: 1 or 8 at a time accumulate the same gradient
    (compared before AdamW, whose normalisation turns a float-rounding difference in a near-zero
    gradient into a visible one)."""
    t = _trainer(tmp_path)
    b, _ = t.collect()
    from dataclasses import replace

    t.cfg = replace(t.cfg, prm=replace(t.cfg.prm, mini_batch_size=4))
    two = t._build_prm()
    two.update(b.rollout, b.correct)
    assert [s["step"] for s in two.optim.state_dict()["state"].values()][0] == 2
    results = []
    for micro in (1, 8):
        t.cfg = replace(t.cfg, prm=replace(t.cfg.prm, mini_batch_size=None, micro_batch_size=micro))
        p = t._build_prm()
        p.update(b.rollout, b.correct)
        results.append({k: v.grad.clone() for k, v in p.model.named_parameters()})
    assert any(float(g.abs().sum()) > 0 for g in results[0].values())
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-4, atol=1e-7)


def test_a_stopped_prime_run_resumes_exactly_with_its_prm(tmp_path):
    """Stopped at step 2 (a preemption's checkpoint) and resumed: the metrics, the policy and the
    PRM with both optimizers equal the uninterrupted run's bitwise; the PRM trained (phi moved off
    its reference), and its loss and accuracies were logged every step."""
    extra = [*STOPPED_RUN, "algorithm.estimator=prime", "algorithm.estimator_params={}",
             "algorithm.accuracy_filter={enable: true, oversample: 2.0}", "prm.lr=1e-3"]
    a, b = _uninterrupted_and_resumed(tmp_path, extra)
    assert a == b
    steps = [r for r in a if "prm/loss" in r]
    assert len(steps) == 4 and all(0 <= r["prm/acc"] <= 1 and "prime/process_share" in r for r in steps)
    assert all(0 <= r["filter/rejected_frac"] <= 1 for r in steps)
    full, stopped = (load_checkpoint(list_complete(tmp_path / d / "checkpoints")[-1])[0] for d in ("full", "stopped"))
    for part in ("model", "optimizer"):
        assert _equal(full[part], stopped[part]), part
    for part in ("model", "ref", "optimizer"):
        assert _equal(full["prm"][part], stopped["prm"][part]), part
    assert _changed(full["prm"]["model"], full["prm"]["ref"])


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_applies_a_new_prm_lr_and_refuses_a_new_prm_start(tmp_path):
    """A resume trains at this run's prm.lr (announced and applied); a changed prm.path or
    prm.ref_path, which the checkpoint's trained PRM would silently override, is refused by name."""
    out = tmp_path / "run"
    base = ["--config", CONFIG, "--output-dir", str(out), *[x for s in TINY for x in ("--set", s)]]
    res = cli_in_process(["train", *base, "--set", "trainer.steps=2", "--set", "trainer.save_every=1"])
    assert res.returncode == 0, res.stderr[-2000:]
    res = cli_in_process(["train", *base, "--resume", "--set", "trainer.steps=3", "--set", "prm.lr=5e-4"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "prm.lr: 0.001 -> 0.0005" in res.stderr
    shard = load_checkpoint(list_complete(out / "checkpoints")[-1])[0]
    assert [g["lr"] for g in shard["prm"]["optimizer"]["param_groups"]] == [5e-4]
    res = cli_in_process(["train", *base, "--resume", "--set", "trainer.steps=4", "--set", f"prm.path={out}"])
    assert res.returncode == 2 and "holds the implicit PRM trained from its own starting weights" in res.stderr
    assert "prm.path: None ->" in res.stderr


def test_a_damaged_prm_in_the_newest_checkpoint_falls_back_to_an_older_one(tmp_path):
    """The newest checkpoint's PRM state damaged (a NaN in its weights): the resume names it and
    resumes from the older checkpoint, whose PRM loads."""
    import torch as T

    from hapo_openrlhf.rundir.checkpoint import save_checkpoint

    out = tmp_path / "run"
    base = ["--config", CONFIG, "--output-dir", str(out), *[x for s in TINY for x in ("--set", s)]]
    res = cli_in_process(["train", *base, "--set", "trainer.steps=2", "--set", "trainer.save_every=1",
                          "--set", "trainer.keep_last=3"])
    assert res.returncode == 0, res.stderr[-2000:]
    newest = list_complete(out / "checkpoints")[-1]
    shard, meta = load_checkpoint(newest)
    name = next(iter(shard["prm"]["model"]))
    shard["prm"]["model"][name] = shard["prm"]["model"][name].clone().fill_(float("nan"))
    import shutil

    shutil.rmtree(newest)
    save_checkpoint(out / "checkpoints", 2, {0: shard}, meta, 3)
    res = cli_in_process(["train", *base, "--resume", "--set", "trainer.steps=3"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "implicit PRM's model weights are not a mapping of finite tensors" in res.stderr
    assert "resumed from" in res.stderr and "step_00000001" in res.stderr
    assert T.isfinite(load_checkpoint(list_complete(out / "checkpoints")[-1])[0]["prm"]["model"][name]).all()


def _fake_batch(correct_rows, lengths, G, T=12):
    """A Batch of len(correct_rows) // G groups with the given outcomes and response lengths."""
    from hapo_openrlhf.generation.rollout import Rollout

    B = len(correct_rows)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    seq = torch.cat([torch.full((B, 3), 5), torch.where(mask.bool(), 7, 0)], dim=1)
    ro = Rollout(seq, torch.cat([torch.ones(B, 3, dtype=torch.long), mask], 1), mask, 3, [str(i) for i in range(B)],
                 torch.zeros(B, dtype=torch.bool))
    c = torch.tensor(correct_rows, dtype=torch.bool)
    return Batch(ro, c.float(), c, torch.arange(B // G).repeat_interleave(G))


def test_the_accuracy_filter_keeps_passing_groups_first_in_sampled_order(tmp_path):
    """``oversample`` 2 at 3 prompts a step: 6 groups sampled at once (accuracy 1/4, 0, 3/4, 1, 2/4
    with an 11-token response (>= max_new_tokens - 1: truncated), 2/4); groups 0, 2 and 5 pass and are
    the batch, in sampled order; 3 of 6 rejected; 6 prompts consumed."""
    t = _trainer(tmp_path, "rollout.prompts_per_step=3", "algorithm.accuracy_filter.oversample=2.0")
    G = 4
    outcomes = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1, 0]
    lengths = [5] * 24
    lengths[17] = 11
    fake = _fake_batch(outcomes, lengths, G)
    seen = []

    def sample(problems):
        seen.append(len(problems))
        return fake

    t._sample = sample
    before = t.state.consumed_prompts
    t.next_prompts = lambda n, _n=t.next_prompts: _n(n)
    batch, metrics = t.collect()
    assert seen == [6] and t.state.consumed_prompts - before == 6
    assert batch.correct.tolist() == [bool(x) for x in outcomes[0:4] + outcomes[8:12] + outcomes[20:24]]
    assert batch.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert metrics == {"filter/rejected_frac": pytest.approx(3 / 6), "filter/failing_kept_frac": 0.0}
    # too few pass: failing groups fill in, in sampled order, and are counted
    t.cfg = load_config(CONFIG, [*TINY, "rollout.prompts_per_step=3", "algorithm.accuracy_filter.oversample=2.0",
                                 "algorithm.accuracy_filter.lower=0.5", "algorithm.accuracy_filter.upper=0.5"])
    batch, metrics = t.collect()
    assert batch.correct.tolist() == [bool(x) for x in outcomes[20:24] + outcomes[0:4] + outcomes[4:8]]
    assert metrics["filter/failing_kept_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("sets,named", [
    (["algorithm.estimator_params={beta: 0}"], "prime.beta must be > 0"),
    (["algorithm.estimator_params={beta: .nan}"], "beta must be a finite number"),
    (["algorithm.estimator_params={reward_gt_coef: -5}"], "prime.reward_gt_coef must be >= 0"),
    (["algorithm.accuracy_filter.lower=-0.1"], "accuracy_filter.lower must be a group accuracy in \\[0, 1\\]"),
    (["algorithm.accuracy_filter.upper=1.5"], "accuracy_filter.upper must be a group accuracy in \\[0, 1\\]"),
    (["algorithm.accuracy_filter={lower: 0.8, upper: 0.2}"], "lower \\(0.8\\) is above upper \\(0.2\\)"),
    (["algorithm.accuracy_filter.oversample=0.5"], "oversample must be a finite number >= 1"),
    (["algorithm.accuracy_filter.oversample=.inf"], "accuracy_filter.oversample: expected a finite number, got inf"),
    (["algorithm.dynamic_sampling=true"], "dynamic_sampling and algorithm.accuracy_filter are two filters"),
    (["prm.update=reverse"], "prm.update"),
    (["prm.loss=dpo"], "prm.loss 'dpo' is one of the recipe's losses this project does not build"),
    (["prm.loss=mse"], "prm.loss"),
    (["prm.lr=0"], "prm.lr must be a finite number > 0"),
    (["prm.grad_clip=.nan"], "prm.grad_clip: expected a finite number, got nan"),
    (["prm.mini_batch_size=0"], "prm.mini_batch_size must be null"),
])
def test_hostile_prime_settings_are_one_clear_line(tmp_path, sets, named):
    res = cli_in_process(["train", "--config", CONFIG, "--output-dir", str(tmp_path / "o"),
                          *[x for s in sets for x in ("--set", s)]])
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hapo: error:"), res.stderr
    import re

    assert re.search(named, lines[0]), lines[0]
    assert not (tmp_path / "o").exists()


def test_prime_logs_its_metrics_and_hapo_list_shows_it(tmp_path):
    import json

    res = cli_in_process(["list"])
    assert res.returncode == 0
    listed = json.loads(res.stdout)
    assert "prime" in listed["estimators"] and "prime" not in listed["not_implemented"]
    out = tmp_path / "run"
    res = cli_in_process(["train", "--config", CONFIG, "--output-dir", str(out),
                          *[x for s in [*TINY, "trainer.steps=2"] for x in ("--set", s)]])
    assert res.returncode == 0, res.stderr[-2000:]
    steps = [r for r in records(out) if "prm/loss" in r]
    for key in ("prm/loss", "prm/grad_norm", "prm/acc", "prm/acc_heldout", "prm/outcome_acc_heldout",
                "prime/process_share", "prime/process_reward", "prime/q_sum", "filter/rejected_frac"):
        assert all(key in r and math.isfinite(r[key]) for r in steps), key
