"""The embedded trainer: real CLI runs in a subprocess, exact resume after SIGKILL,
every registered estimator and loss through the real loop, bad input."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hapo_openrlhf.algos import list_estimators, list_losses
from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import LocalTrainer

from ..conftest import REPO, cli_in_process, run_cli

SMALL = [
    "warmup.steps=30", "trainer.steps=6", "trainer.save_every=2", "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4", "data.synthetic.eval_size=8", "data.synthetic.train_size=200",
    "eval.n_samples=2", "trainer.threads=1", "rollout.max_new_tokens=24", "eval.max_new_tokens=24",
]
CONFIG = str(REPO / "configs" / "cpu_tiny.yaml")


def sets(extra=()):
    out = []
    for s in [*SMALL, *extra]:
        out += ["--set", s]
    return out


def with_report() -> dict:
    """This environment with `hapo train`'s end-of-run report on (tests/conftest.py turns it off)."""
    env = dict(os.environ)
    env.pop("HAPO_NO_REPORT", None)
    return env


def records(run_dir: Path):
    """metrics.jsonl without wall-clock timings (the only thing allowed to differ)."""
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in recs]


@pytest.mark.slow
def test_cli_run_writes_metrics_tensorboard_plots_and_model(tmp_path):
    out = tmp_path / "run"
    res = run_cli(["train", "--config", CONFIG, "--output-dir", str(out), *sets()], env=with_report())
    assert res.returncode == 0, res.stderr[-3000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(last) == {"heldout_accuracy_before", "heldout_accuracy_after", "output_dir"}
    recs = records(out)
    steps = [r for r in recs if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("reward/mean", "hapo/adv_scale_mean", "quadrant/PHR/token_frac", "quadrant/NLR/entropy_delta",
                "actor/entropy", "actor/clip_frac", "actor/grad_norm", "response/length_mean"):
        assert key in steps[0], key
    # polarity is the outcome, so every response token is in exactly one quadrant
    assert all(sum(r[f"quadrant/{q}/token_frac"] for q in ("PHR", "PLR", "NHR", "NLR")) == pytest.approx(1.0)
               for r in steps)
    assert all(0 < r["quadrant/high_frac"] < 1 and 0 <= r["hapo/credit_saturated_frac"] <= 1 for r in steps)
    assert all(0.9 - 1e-6 <= r["hapo/adv_scale_min"] <= r["hapo/adv_scale_max"] <= 1.1 + 1e-6 for r in steps)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    pngs = {p.name for p in (out / "report").glob("*.png")}
    assert {"reward.png", "entropy.png", "clip_frac.png", "quadrant_share.png", "accuracy_vs_tokens.png"} <= pngs
    assert (out / "report" / "index.html").exists() and list((out / "report" / "token_credit").glob("*.html"))
    assert (out / "final_model" / "hapo.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["eval/accuracy"] == last["heldout_accuracy_before"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final_model").config.model_type == "qwen2"
    # a second start on the same directory without --resume refuses instead of clobbering
    again = run_cli(["train", "--config", CONFIG, "--output-dir", str(out), *sets()])
    assert again.returncode == 2 and "pass --resume" in again.stderr


def test_no_report_skips_only_the_report(tmp_path, monkeypatch):
    """`hapo train --no-report` (or HAPO_NO_REPORT=1, which the suite sets): the run, its files and
    its last line as with the report, no report/ directory, a line naming `hapo report`, which then
    builds it from the run's files; a value of the variable other than 0 or 1 is refused before
    anything trains."""
    monkeypatch.delenv("HAPO_NO_REPORT", raising=False)
    out = tmp_path / "run"
    small = sets(["warmup.steps=4", "trainer.steps=2", "trainer.save_every=0"])
    res = cli_in_process(["train", "--config", CONFIG, "--output-dir", str(out), *small, "--no-report"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(json.loads(res.stdout.strip().splitlines()[-1])) == {"heldout_accuracy_before",
                                                                      "heldout_accuracy_after", "output_dir"}
    assert f"hapo report {out}" in res.stdout and not (out / "report").exists()
    assert [r["step"] for r in records(out) if "reward/mean" in r] == [1, 2]
    assert (out / "final_model" / "hapo.json").exists() and (out / "summary.json").exists()
    later = cli_in_process(["report", str(out)])
    assert later.returncode == 0 and (out / "report" / "index.html").exists(), later.stderr[-2000:]
    assert (out / "report" / "reward.png").exists()
    one = ["--set", "trainer.steps=1", "--set", "warmup.steps=0"]
    for value, built in (("1", False), ("0", True)):  # the variable alone, as the suite and a Slurm job set it
        monkeypatch.setenv("HAPO_NO_REPORT", value)
        res = cli_in_process(["train", "--config", CONFIG, "--output-dir", str(tmp_path / value), *small, *one])
        assert res.returncode == 0, res.stderr[-2000:]
        assert (tmp_path / value / "report" / "index.html").exists() == built
        assert ("report: not built" in res.stdout) != built
    monkeypatch.setenv("HAPO_NO_REPORT", "yes")
    res = cli_in_process(["train", "--config", CONFIG, "--output-dir", str(tmp_path / "bad"), *small, *one])
    assert res.returncode == 2 and "HAPO_NO_REPORT must be 0 or 1" in res.stderr and "'yes'" in res.stderr
    assert not (tmp_path / "bad").exists()  # refused before the run directory was made


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    extra = ["trainer.steps=8"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    res = run_cli(["train", "--config", CONFIG, "--output-dir", str(full), *sets(extra)])
    assert res.returncode == 0, res.stderr[-3000:]

    cmd = [sys.executable, "-m", "hapo_openrlhf", "train", "--config", CONFIG, "--output-dir", str(killed), *sets(extra)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed / "checkpoints" / "step_00000004" / "meta.json"
    deadline = time.time() + 300
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert target.exists(), "the run never reached its step-4 checkpoint"
    assert not (killed / "summary.json").exists(), "killed too late: the run had finished"

    res = run_cli(["train", "--config", CONFIG, "--output-dir", str(killed), "--resume", *sets(extra)])
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = records(full), records(killed)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert a == b
    assert json.loads((full / "summary.json").read_text()) == json.loads((killed / "summary.json").read_text())


def _trainer(tmp_path, extra=()):
    cfg = load_config(CONFIG, [*SMALL, "warmup.steps=0", "trainer.save_every=0", *extra])
    t = LocalTrainer(cfg, tmp_path / "run")
    rng = random.Random(0)
    # a random model solves nothing; random rewards exercise every code path
    t.verifier.score_batch = lambda responses, answers: [float(rng.random() < 0.5) for _ in responses]
    return t


@pytest.mark.parametrize("steps", [1, 2, 3, 10])
def test_short_warmups_train(tmp_path, steps):
    """OneCycleLR cannot split fewer than ~20 steps at pct_start 0.1: short warm-ups
    (smoke tests) must still run and change the weights."""
    t = _trainer(tmp_path, [f"warmup.steps={steps}"])
    before = [p.detach().clone() for p in t.model.parameters()]
    loss = t.run_warmup()
    assert torch.isfinite(torch.tensor(loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


@pytest.mark.parametrize("name", list_estimators())
def test_every_estimator_runs_a_real_step(tmp_path, name):
    params = {"quadrant": "{quadrants: [PHR, NLR]}", "hapo": "{ablate: [PLR]}"}.get(name, "{}")
    t = _trainer(tmp_path, [f"algorithm.estimator={name}", f"algorithm.estimator_params={params}"])
    before = [p.detach().clone() for p in t.model.parameters()]
    m = t.train_step()
    assert t.state.step == 1 and torch.isfinite(torch.tensor(m["actor/loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


@pytest.mark.parametrize("name", list_losses())
def test_every_loss_runs_a_real_step(tmp_path, name):
    params = {"kl_cov": "{k_ratio: 0.05}", "entro_reg": "{beta: 0.01}", "rsi_s": "{lower: 0.1, upper: 10.0}",
              "paec": PAEC}.get(name, "{}")
    t = _trainer(tmp_path, [f"algorithm.loss={name}", f"algorithm.loss_params={params}", "algorithm.estimator=grpo",
                            "algorithm.estimator_params={}"])
    m = t.train_step()
    assert torch.isfinite(torch.tensor(m["actor/loss"]))


def test_dapo_dynamic_sampling_fills_with_informative_groups(tmp_path):
    t = _trainer(tmp_path, ["algorithm.estimator=grpo", "algorithm.estimator_params={}", "algorithm.dynamic_sampling=true",
                            "algorithm.max_gen_rounds=6", "algorithm.overlong.enable=true", "algorithm.overlong.cache_len=4"])
    batch, metrics = t.collect()
    G, P = t.cfg.rollout.samples_per_prompt, t.cfg.rollout.prompts_per_step
    assert batch.rewards.shape == (G * P,) and batch.rollout.sequences_BL.shape[0] == G * P
    assert metrics["dapo/gen_rounds"] >= 1
    # every kept group has reward variance (overlong penalty may add more)
    correct = batch.correct.view(P, G).float()
    assert ((correct.max(1).values - correct.min(1).values) > 0).all()
    # the merged batch is still a valid rollout: re-scoring it works
    m = t.train_step()
    assert "dapo/dropped_group_frac" in m


@pytest.mark.parametrize("fused,what", [(True, "log-probs"), (False, "logits")])
def test_non_finite_logits_are_a_clear_error(tmp_path, fused, what):
    t = _trainer(tmp_path, [f"model.fused_head={str(fused).lower()}"])
    batch, _ = t.collect()
    with torch.no_grad():
        t.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=f"non-finite {what}"):
        t._behaviour(batch.rollout)


def test_non_finite_sampler_log_probs_are_a_clear_error(tmp_path):
    """rollout.old_logprobs: auto takes the sampler's log-probs: a model that turned NaN is
    named as the scoring forward would name it, not trained on."""
    t = _trainer(tmp_path, [])
    with torch.no_grad():
        t.model.lm_head.weight.fill_(float("nan"))
    batch, _ = t.collect()
    assert batch.rollout.logprobs_BR is not None
    with pytest.raises(FloatingPointError, match="non-finite log-probs"):
        t._behaviour(batch.rollout, sampler=True)


def test_old_logprobs_sampler_and_forward_agree_in_a_training_step(tmp_path):
    """The same step with the sampler's log-probs and with a separate forward: the same
    rollout (one seed), old log-probs and entropy within 1e-5, and the step's metrics close."""
    steps = []
    for mode in ("sampler", "forward"):
        t = _trainer(tmp_path / mode, [f"rollout.old_logprobs={mode}", "algorithm.dynamic_sampling=false"])
        seen = {}
        orig = t._behaviour

        def spy(ro, nucleus=False, sampler=False, orig=orig, seen=seen):
            out = orig(ro, nucleus=nucleus, sampler=sampler)
            seen.setdefault("first", (ro.sequences_BL.clone(), out[0].clone(), out[1].clone()))
            return out

        t._behaviour = spy
        steps.append((t.train_step(), seen["first"]))
    (m_s, (seq_s, lp_s, en_s)), (m_f, (seq_f, lp_f, en_f)) = steps
    assert torch.equal(seq_s, seq_f)
    torch.testing.assert_close(lp_s, lp_f, atol=1e-5, rtol=0)
    torch.testing.assert_close(en_s, en_f, atol=1e-5, rtol=0)
    for k in ("reward/mean", "actor/entropy", "actor/loss", "actor/grad_norm"):
        assert m_s[k] == pytest.approx(m_f[k], rel=1e-3, abs=1e-5), k


def test_cli_errors_are_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(CONFIG).read_text().replace("prompts_per_step", "prompt_per_step"))
    res = run_cli(["train", "--config", str(bad), "--output-dir", str(tmp_path / "o")], fresh=True)
    assert res.returncode == 2
    assert "unknown config key 'rollout.prompt_per_step' (did you mean 'rollout.prompts_per_step'?)" in res.stderr
    # the loader's and the data's refusals, in this process (cli.main; issue 57)
    res = cli_in_process(["train", "--config", CONFIG, "--set", "algorithm.estimator=nope", "--output-dir", str(tmp_path / "o")])
    assert res.returncode == 2 and "unknown advantage estimator 'nope'" in res.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = cli_in_process(["train", "--config", CONFIG, "--set", f"data.train={empty}", "--set", "warmup.steps=0",
                          "--output-dir", str(tmp_path / "o")])
    assert res.returncode == 2 and "yielded no usable problems" in res.stderr
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": oops}\n')
    res = cli_in_process(["train", "--config", CONFIG, "--set", f"data.train={bad_rows}", "--set", "warmup.steps=0",
                          "--output-dir", str(tmp_path / "o")])
    assert res.returncode == 2 and "bad.jsonl:2: malformed row" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("loss,agg", [("ppo", "token-mean"), ("entro_reg", "seq-mean-token-mean"),
                                      ("ppo", "seq-mean-token-sum-norm")])
def test_loss_inside_the_fused_forward_equals_the_recomputing_head(tmp_path, loss, agg):
    """One real update with the loss's gradient computed inside the head's forward (fused_token_loss,
    chunks of whole rows, several micro-batches) == the recompute-backward fused head."""
    params = "{beta: 0.05}" if loss == "entro_reg" else "{eps_low: 0.2, eps_high: 0.28}"
    extra = [f"algorithm.loss={loss}", f"algorithm.loss_params={params}", f"algorithm.aggregation={agg}",
             "optim.micro_batch_size=6", "algorithm.entropy_chunk_size=50"]
    runs = []
    for in_forward in (True, False):
        t = _trainer(tmp_path / str(in_forward), [*extra, f"model.fused_loss_in_forward={str(in_forward).lower()}"])
        m = t.train_step()
        runs.append((m, [p.detach().clone() for p in t.model.parameters()]))
    (m1, p1), (m2, p2) = runs
    # Adam divides by sqrt(v): near-zero gradients amplify float noise, so compare to
    # well under one step of lr 1e-4 (the gradient itself is checked through grad_norm)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
    for k in ("actor/loss", "actor/clip_frac", "actor/grad_norm"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k


def test_behaviour_under_top_p_is_the_full_vocabulary_at_the_rollout_temperature(tmp_path):
    """The embedded default samples at top-p 0.95 (T 1.0); its behaviour log-probs and entropy,
    which HAPO's shaping and the PPO ratio read, are the full-vocabulary ones at the rollout
    temperature -- not the sampler's nucleus-renormalised ones (which differ where the nucleus
    cuts mass, as this checks on a temperature of 1.3)."""
    from hapo_openrlhf.algos.nucleus import nucleus_logmass

    t = _trainer(tmp_path, ["rollout.temperature=1.3"])
    assert load_config(CONFIG).rollout.top_p == 0.95 and t.cfg.rollout.top_p == 0.95
    batch, _ = t.collect()
    ro = batch.rollout
    old, ent = t._behaviour(ro)
    with torch.no_grad():
        logits = t.model(ro.sequences_BL, attention_mask=ro.attention_mask_BL,
                         position_ids=(ro.attention_mask_BL.cumsum(-1) - 1).clamp(min=0)).logits.float()
    z = logits[:, ro.prompt_len - 1:-1] / 1.3
    logp = torch.log_softmax(z, -1)
    mask = ro.response_mask_BR.bool()
    want_lp = logp.gather(-1, ro.sequences_BL[:, ro.prompt_len:, None])[..., 0]
    want_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(old[mask], want_lp[mask], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent[mask], want_ent[mask], rtol=1e-4, atol=1e-4)
    # the processed (nucleus) log-probs would sit log P(S) above these on some sampled tokens
    want_lm = nucleus_logmass(z, 0.95)
    assert float(want_lm[mask].min()) < -0.01
    # rollout/nucleus_logmass's per-token input, from the same pass (fused head and logits head)
    from dataclasses import replace

    cfg = t.cfg
    for fused in (True, False):
        t.cfg = replace(cfg, model=replace(cfg.model, fused_head=fused))
        *_, lm = t._behaviour(ro, nucleus=True)
        torch.testing.assert_close(lm[mask], want_lm[mask], rtol=0, atol=1e-5)
        assert not lm[~mask].any()
    t.cfg = cfg
    metrics = t.train_step()
    assert -0.1 < metrics["rollout/nucleus_logmass"] < 0
    t.cfg = replace(cfg, rollout=replace(cfg.rollout, top_p=1.0))
    assert len(t._behaviour(ro, nucleus=True)) == 2


STOPPED_RUN = [*SMALL, "trainer.steps=4", "warmup.steps=10", "data.synthetic.eval_size=2", "eval.n_samples=1",
               "rollout.max_new_tokens=12", "eval.max_new_tokens=12", "rollout.prompts_per_step=2",
               "algorithm.dynamic_sampling=false"]


def _uninterrupted_and_resumed(tmp_path, extra):
    """The metrics of a 4-step run, and of the same run stopped at step 2 (a preemption's
    checkpoint) then resumed with ``--resume``."""
    from hapo_openrlhf.rundir.preemption import Preempted

    full, stopped = tmp_path / "full", tmp_path / "stopped"
    LocalTrainer(load_config(CONFIG, extra), full).fit()

    class StopAt2:
        def __init__(self, t):
            self.t = t

        def warmup(self, *a, **k):
            pass

        def step(self, s, metrics):
            if s == 2:
                self.t.stop_requested = True

    t = LocalTrainer(load_config(CONFIG, extra), stopped)
    with pytest.raises(Preempted):
        t.fit(progress=StopAt2(t))
    LocalTrainer(load_config(CONFIG, extra), stopped, resume=True).fit()
    return records(full), records(stopped)


def test_a_stopped_eapo_run_with_kappa_decay_resumes_exactly(tmp_path):
    """eapo_entropic's kappa decay is keyed to the optimizer step, which every checkpoint
    holds: stopped at step 2 (a preemption's checkpoint) and resumed, the run equals the
    uninterrupted one, kappa schedule included."""
    a, b = _uninterrupted_and_resumed(tmp_path, [*STOPPED_RUN, "optim.ppo_epochs=2", "algorithm.estimator=eapo_entropic",
                                                 "algorithm.estimator_params={decay_steps: 6}"])
    assert a == b
    kappas = [r["eapo/kappa"] for r in a if "eapo/kappa" in r]
    k = 1.3862943611198906
    assert kappas == pytest.approx([k * (1 - min(s * 2 / 6, 1)) for s in range(4)])  # 2 optimizer steps per RL step


def test_a_stopped_stare_run_resumes_with_its_controller(tmp_path):
    """STARE's adaptive controller (W, M, the gate) steps once per RL step and lives in the
    checkpoint: stopped at step 2 and resumed, the run equals the uninterrupted one; without
    the controller in the checkpoint W would restart at its initial value."""
    a, b = _uninterrupted_and_resumed(tmp_path, [
        *STOPPED_RUN, "algorithm.loss=stare",
        "algorithm.loss_params={variant: C2, adaptive: true, alpha: 0.05, target_entropy: 100.0, top_ratio: 0.2}"])
    assert a == b
    steps = [r for r in a if "stare/reweight_w" in r]
    assert [r["stare/reweight_w"] for r in steps] == pytest.approx([1.15, 1.2, 1.25, 1.3])
    assert [r["stare/reweight_m"] for r in steps] == pytest.approx([0.85, 0.8, 0.75, 0.7])
    assert all(r["stare/gate_on"] == 1.0 for r in steps)
    assert any(r["stare/positive_reweight_frac"] > 0 for r in steps)  # steps with only A = 0 select nothing


# the values PAEC's paper does not publish: ours, for the tests (algos/paec.py)
PAEC = "{beta: 10.0, rho_min: 2.0, top_p: 0.9, mask: product, softness: 0.0, anchor_steps: 2}"


def test_a_stopped_paec_run_resumes_with_its_anchor(tmp_path):
    """PAEC's anchor H0 (the mean masked entropy of the first K = 2 steps) is set after step
    2 and lives in the checkpoint: stopped at step 2 and resumed, the run equals the
    uninterrupted one; the floor (rho_min H0, above H0 here so the penalty acts) applies from
    step 3, with the penalty the loss term beta max(0, H_low - H_bar)^2 reports."""
    a, b = _uninterrupted_and_resumed(tmp_path, [*STOPPED_RUN, "algorithm.loss=paec", f"algorithm.loss_params={PAEC}"])
    assert a == b
    steps = [r for r in a if "paec/masked_entropy" in r]
    assert len(steps) == 4
    h0 = (steps[0]["paec/masked_entropy"] + steps[1]["paec/masked_entropy"]) / 2
    assert "paec/h_low" not in steps[0] and "paec/h_low" not in steps[1]
    assert [r["paec/h_low"] for r in steps[2:]] == pytest.approx([2.0 * h0] * 2)
    assert all(r["paec/penalty"] == 0 for r in steps[:2]) and all(r["paec/penalty"] > 0 for r in steps[2:])
    assert all(r["paec/below_floor"] == 1.0 for r in steps[2:])
    # the mask selects about 20% of each response's positions (at least one)
    assert all(0.15 < r["paec/mask_mean"] < 0.6 for r in steps)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_skips_the_step_and_n_in_a_row_stop(tmp_path, bad):
    """A hook puts one bad element into one gradient: the update is skipped (weights, AdamW's
    moments and step, the LR schedule untouched), the norm and the count are logged, a good
    step resets the run of skips, and the Nth skip in a row stops with a named error."""
    import copy
    import math

    from hapo_openrlhf.algos.grad_guard import NonFiniteGradientError
    from hapo_openrlhf.rundir.logger import read_metrics

    t = _trainer(tmp_path, ["optim.max_consecutive_skips=2"])
    t.train_step()  # AdamW has moments to keep

    def snapshot():
        return ({k: v.clone() for k, v in t.model.state_dict().items()}, copy.deepcopy(t.optim.state_dict()),
                t.sched.state_dict()["last_epoch"])

    p = t.model.lm_head.weight
    hook = p.register_hook(lambda g: g.clone().view(-1).index_fill_(0, torch.tensor([3]), bad).view_as(g))
    w0, o0, s0 = snapshot()
    m = t.train_step()
    w1, o1, s1 = snapshot()
    assert m["actor/skipped_steps"] == 1
    assert math.isnan(m["actor/grad_norm"]) if math.isnan(bad) else m["actor/grad_norm"] == math.inf
    assert s1 == s0 and all(torch.equal(v, w1[k]) for k, v in w0.items())
    for pid, st in o0["state"].items():
        assert st["step"] == o1["state"][pid]["step"]
        assert torch.equal(st["exp_avg"], o1["state"][pid]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], o1["state"][pid]["exp_avg_sq"])
    t.logger.log(t.state.step, m)  # the value is logged, not dropped, and read back as a float
    rec = read_metrics(t.out)[-1]
    assert rec["actor/skipped_steps"] == 1 and (math.isnan(rec["actor/grad_norm"]) if math.isnan(bad)
                                                 else rec["actor/grad_norm"] == math.inf)
    hook.remove()
    assert math.isfinite(t.train_step()["actor/grad_norm"])  # a good step resets the run of skips
    hook = p.register_hook(lambda g: g * bad)
    assert t.train_step()["actor/skipped_steps"] == 2
    # the counters are in the checkpointed state
    assert (t.state.skipped_steps, t.state.consecutive_skips) == (2, 1)
    with pytest.raises(NonFiniteGradientError, match=r"2 step\(s\) in a row \(optim.max_consecutive_skips = 2\)"):
        t.train_step()


def test_the_entropy_change_runs_every_n_steps_and_changes_nothing_else(tmp_path):
    """trainer.entropy_change_every=2: steps 1 and 3 re-score after the update (actor/entropy_after,
    quadrant/Q/entropy_delta), step 2 does not, and 0 never does; every other metric and the weights
    are those of the run that re-scores every step (the re-scoring is a no-grad forward: no RNG, no
    state), and the equal steps' values are equal."""
    keys = ["actor/entropy_after", *(f"quadrant/{q}/entropy_delta" for q in ("PHR", "PLR", "NHR", "NLR"))]
    runs = {}
    for every in (1, 2, 0):
        t = _trainer(tmp_path / str(every), [f"trainer.entropy_change_every={every}"])
        runs[every] = ([t.train_step() for _ in range(3)], {k: v.clone() for k, v in t.model.state_dict().items()})
    assert [all(k in m for k in keys) for m in runs[2][0]] == [True, False, True]
    assert not any(k in m for m in runs[0][0] for k in keys)
    (full, w_full) = runs[1]
    for every in (2, 0):
        got, w = runs[every]
        for a, b in zip(full, got, strict=True):
            for k, v in b.items():
                if not k.startswith("time/"):
                    assert v == a[k], (every, k)
            assert set(a) - set(b) <= set(keys)
        assert all(torch.equal(w_full[k], w[k]) for k in w_full)


def test_entropy_change_every_is_refused_where_it_cannot_act():
    with pytest.raises(ValueError, match=r"trainer.entropy_change_every must be >= 0 \(0: never\), got -1"):
        load_config(CONFIG, ["trainer.entropy_change_every=-1"])
    with pytest.raises(ValueError, match=r"trainer.entropy_change_every: 5 .* backend openrlhf does not re-score"):
        load_config(REPO / "configs" / "qwen25_math_7b_hapo.yaml", ["trainer.entropy_change_every=5"])


def test_the_nucleus_metric_runs_every_n_steps(tmp_path):
    """rollout.nucleus_metric_every=2 under top-p < 1: steps 1 and 3 log it, step 2 does not."""
    t = _trainer(tmp_path, ["rollout.top_p=0.9", "rollout.nucleus_metric_every=2"])
    got = [("rollout/nucleus_logmass" in t.train_step()) for _ in range(3)]
    assert got == [True, False, True]
    t = _trainer(tmp_path / "never", ["rollout.top_p=0.9", "rollout.nucleus_metric_every=0"])
    assert "rollout/nucleus_logmass" not in t.train_step()
