"""A resume that changes a stateful method's settings trains what it announces (issue 55,
severity 1), through the real CLI: STARE's W changed at --resume is the W the remaining steps
train with; EAPO-entropic's kappa schedule continues from the optimizer steps actually taken
when --resume changes optim.ppo_epochs; PAEC's anchor_steps changed after the anchor is fixed is
refused by name, with nothing written. The runs call the CLI's ``main`` in this process (issue 57:
no interpreter start per run); the entry point's own resumes, in subprocesses, are test_trainer.py's."""

import json
from pathlib import Path

from ..conftest import REPO, cli_in_process
from .test_trainer import STOPPED_RUN, records

CONFIG = str(REPO / "configs" / "cpu_tiny.yaml")


def _train(out: Path, *sets_, resume=False):
    args = ["train", "--config", CONFIG, "--output-dir", str(out)]
    for s in [*STOPPED_RUN, "trainer.save_every=2", *sets_]:
        args += ["--set", s]
    return cli_in_process(args + (["--resume"] if resume else []))


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


def _tamper(ckpt: Path, edit) -> None:
    """Rewrite a checkpoint's shard with ``edit(shard)`` applied and its manifest's size and CRC-32
    updated: a checkpoint that verifies, holding a damaged state."""
    import torch

    from hapo_openrlhf.rundir.checkpoint import file_crc32, safe_torch_load

    shard_path = ckpt / "rank_00000.pt" if (ckpt / "rank_00000.pt").exists() else next(ckpt.glob("*.pt"))
    shard = safe_torch_load(shard_path)
    edit(shard)
    torch.save(shard, shard_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][shard_path.name] = {"size": shard_path.stat().st_size, "crc32": file_crc32(shard_path)}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_a_damaged_trainer_or_method_state_falls_back_to_the_newest_good_checkpoint(tmp_path):
    """A checkpoint whose files verify but whose STARE controller holds W "abc" (then NaN, 1e308,
    then a trainer step of -5) is skipped with the key named, and the resume takes the older
    checkpoint; metrics.jsonl is cut back only to that checkpoint's step, and no checkpoint is
    deleted. With no good checkpoint left the resume stops, naming each."""
    out = tmp_path / "run"
    stare = ["algorithm.loss=stare", "algorithm.loss_params={reweight_w: 1.1, top_ratio: 0.2}"]
    first = _train(out, "trainer.steps=2", "trainer.save_every=1", "trainer.keep_last=3", *stare)
    assert first.returncode == 0, first.stderr[-3000:]
    root = out / "checkpoints"
    newest, older = root / "step_00000002", root / "step_00000001"
    assert newest.is_dir() and older.is_dir()
    cases = [(lambda s: s["trainer"]["loss_state"].__setitem__("reweight_w", "abc"), "stare state reweight_w"),
             (lambda s: s["trainer"]["loss_state"].__setitem__("reweight_w", float("nan")), "stare state reweight_w"),
             (lambda s: s["trainer"]["loss_state"].__setitem__("reweight_w", 1e308), "stare state reweight_w"),
             (lambda s: s["trainer"].__setitem__("step", -5), "trainer.step must be an integer >= 0")]
    for edit, named in cases:
        import shutil

        work = tmp_path / "case"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(out, work)
        _tamper(work / "checkpoints" / "step_00000002", edit)
        res = _train(work, "trainer.steps=2", "trainer.save_every=1", "trainer.keep_last=3", *stare, resume=True)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "skipping checkpoint" in res.stderr and named in res.stderr, res.stderr[-2000:]
        assert "resumed from" in res.stderr and "step_00000001" in res.stderr
        assert [r["step"] for r in records(work) if "reward/mean" in r] == [1, 2]  # step 2 trained again
        assert (work / "checkpoints" / "step_00000001").is_dir()
    # every checkpoint damaged (the warm start's step 0 too): the resume stops and names each; nothing is
    # deleted or truncated
    everyone = sorted(root.glob("step_*"))
    assert [d.name for d in everyone] == ["step_00000000", "step_00000001", "step_00000002"]
    _tamper(newest, cases[0][0])
    for d in everyone[:-1]:
        _tamper(d, lambda s: s["trainer"].__setitem__("consumed_prompts", "x"))
    before = (out / "metrics.jsonl").read_bytes()
    res = _train(out, "trainer.steps=3", "trainer.save_every=1", "trainer.keep_last=3", *stare, resume=True)
    assert res.returncode == 2 and "no checkpoint under" in res.stderr
    assert "stare state reweight_w" in res.stderr and "trainer.consumed_prompts" in res.stderr
    assert (out / "metrics.jsonl").read_bytes() == before and all(d.is_dir() for d in everyone)
