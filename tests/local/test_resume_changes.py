"""A resume that changes a stateful method's settings trains what it announces (issue 55,
severity 1), through the real CLI: STARE's W changed at --resume is the W the remaining steps
train with; EAPO-entropic's kappa schedule continues from the optimizer steps actually taken
when --resume changes optim.ppo_epochs; PAEC's anchor_steps changed after the anchor is fixed is
refused by name, with nothing written."""

import json
from pathlib import Path

from ..conftest import REPO, run_cli
from .test_trainer import STOPPED_RUN, records

CONFIG = str(REPO / "configs" / "cpu_tiny.yaml")


def _train(out: Path, *sets_, resume=False):
    args = ["train", "--config", CONFIG, "--output-dir", str(out)]
    for s in [*STOPPED_RUN, "trainer.save_every=2", *sets_]:
        args += ["--set", s]
    return run_cli(args + (["--resume"] if resume else []))


def _steps(out: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(out) if key in r}


def test_stare_w_changed_at_resume_is_the_w_that_trains(tmp_path):
    out = tmp_path / "run"
    stare = ["algorithm.loss=stare", "algorithm.loss_params={reweight_w: 1.1, top_ratio: 0.2}"]
    first = _train(out, "trainer.steps=2", *stare)
    assert first.returncode == 0, first.stderr[-3000:]
    res = _train(out, "trainer.steps=4", *stare, "algorithm.loss_params.reweight_w=1.3", resume=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "stare.reweight_w 1.1 -> 1.3: the controller's W restarts at 1.3" in res.stderr
    assert _steps(out, "stare/reweight_w") == {1: 1.1, 2: 1.1, 3: 1.3, 4: 1.3}
    assert "reweight_w: 1.3" in (out / "config.yaml").read_text()


def test_eapo_kappa_schedule_counts_the_optimizer_steps_taken_across_a_new_ppo_epochs(tmp_path):
    """kappa 1.0, decay over 4 optimizer steps; two RL steps at one PPO epoch, then a resume at
    two: step 3 starts after 2 optimizer steps (kappa 0.5), step 4 after 4 (kappa 0). Before, the
    schedule multiplied the RL steps by the *new* epochs: kappa 0 at step 3."""
    out = tmp_path / "run"
    eapo = ["algorithm.estimator=eapo_entropic", "algorithm.estimator_params={kappa: 1.0, decay_steps: 4}"]
    first = _train(out, "trainer.steps=2", "optim.ppo_epochs=1", *eapo)
    assert first.returncode == 0, first.stderr[-3000:]
    res = _train(out, "trainer.steps=4", "optim.ppo_epochs=2", *eapo, resume=True)
    assert res.returncode == 0, res.stderr[-3000:]
    kappa = _steps(out, "eapo/kappa")
    assert kappa[1] == 1.0 and kappa[2] == 0.75 and kappa[3] == 0.5 and kappa[4] == 0.0, kappa


def test_paec_anchor_steps_changed_after_the_anchor_is_fixed_is_refused(tmp_path):
    out = tmp_path / "run"
    paec = ["algorithm.loss=paec", "algorithm.loss_params={beta: 10.0, rho_min: 2.0, top_p: 0.9, mask: product, "
                                   "softness: 0.0, anchor_steps: 2}"]
    first = _train(out, "trainer.steps=2", *paec)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (out / "metrics.jsonl").read_bytes()
    res = _train(out, "trainer.steps=4", *paec, "algorithm.loss_params.anchor_steps=3", resume=True)
    assert res.returncode == 2, res.stderr[-3000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "paec.anchor_steps changed 2 -> 3 at --resume" in line and "anchor_steps=2" in line
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing lost, nothing written
    assert json.loads((out / "summary.json").read_text())  # the first run's result is intact
