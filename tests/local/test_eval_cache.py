"""final_model/eval.json: a run that starts from a saved model reuses that model's held-out
evaluation only when everything the evaluation depends on is equal, and the reused metrics
equal a fresh evaluation exactly."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hapo_openrlhf.config import load_config
from hapo_openrlhf.local import trainer as trainer_mod
from hapo_openrlhf.local.eval_cache import FILE
from hapo_openrlhf.local.trainer import LocalTrainer

from ..conftest import REPO

CONFIG = REPO / "configs" / "cpu_tiny.yaml"
TINY = ["warmup.steps=20", "data.synthetic.eval_size=8", "data.synthetic.train_size=200", "eval.n_samples=2",
        "trainer.threads=1", "eval.max_new_tokens=16", "rollout.max_new_tokens=16", "trainer.save_every=0",
        "trainer.sample_every=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "data.synthetic.eval_seed=3"]


@pytest.fixture
def counted(monkeypatch):
    """Counts the held-out evaluations the trainer runs."""
    calls = []
    real = trainer_mod.evaluate

    def counting(*a, **k):
        calls.append(k["seed"])
        return real(*a, **k)

    monkeypatch.setattr(trainer_mod, "evaluate", counting)
    return calls


def _fit(out, extra=()):
    return LocalTrainer(load_config(CONFIG, [*TINY, *extra]), out).fit()


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A warm start (SFT only, no RL step) whose final model the tests start from."""
    out = tmp_path_factory.mktemp("warm") / "warm"
    summary = _fit(out, ["trainer.steps=0", "seed=5", "eval.seed=11"])
    return out, summary


def _from(warm_dir, extra=()):
    return ["warmup.steps=0", f"model.path={warm_dir / 'final_model'}", "trainer.steps=1", *extra]


def test_a_warm_start_evaluates_once_and_records_it(tmp_path, counted):
    summary = _fit(tmp_path / "w", ["trainer.steps=0", "eval.seed=11"])
    assert counted == [11]  # before == after: no second evaluation of the same model
    assert summary["after"] == summary["before"]
    saved = json.loads((tmp_path / "w" / "final_model" / FILE).read_text())
    assert saved["metrics"] == summary["after"] and saved["key"]["eval"]["seed"] == 11


def test_a_run_from_the_model_reuses_its_evaluation_and_it_equals_a_fresh_one(warm, tmp_path, counted):
    warm_dir, warm_summary = warm
    reused = _fit(tmp_path / "reused", _from(warm_dir, ["seed=6", "eval.seed=11"]))
    assert counted == [11]  # only the final evaluation ran
    assert reused["before"] == warm_summary["after"]
    # the invariant that makes reuse safe: without the file the run evaluates, and gets the same
    (warm_dir / "final_model" / FILE).rename(tmp_path / "aside.json")
    try:
        fresh = _fit(tmp_path / "fresh", _from(warm_dir, ["seed=6", "eval.seed=11"]))
    finally:
        (tmp_path / "aside.json").rename(warm_dir / "final_model" / FILE)
    assert counted == [11, 11, 11] and fresh["before"] == reused["before"] and fresh["after"] == reused["after"]


@pytest.mark.parametrize("change", [
    "eval.seed=12",                  # another sampling stream
    "eval.seed=null",                # the default: this run's seed + 99, not the warm start's
    "eval.n_samples=3",              # other evaluation settings
    "data.synthetic.eval_size=9",    # other problems
    "data.synthetic.eval_seed=4",    # other problems
    "data.synthetic.eval_seed=null",  # the default: drawn with this run's seed + 1
    "trainer.threads=2",             # other arithmetic
])
def test_anything_the_evaluation_depends_on_differing_means_a_fresh_evaluation(warm, tmp_path, counted, change):
    warm_dir, _ = warm
    _fit(tmp_path / "run", _from(warm_dir, ["seed=6", "eval.seed=11", change]))
    assert len(counted) == 2  # before and after


def test_other_weights_under_the_same_file_are_evaluated_afresh(warm, tmp_path, counted):
    warm_dir, _ = warm
    copy = tmp_path / "model"
    shutil.copytree(warm_dir / "final_model", copy)
    w = load_file(copy / "model.safetensors")
    name = next(iter(w))
    w[name] = w[name] + 1e-3
    save_file(w, copy / "model.safetensors")
    _fit(tmp_path / "run", ["warmup.steps=0", f"model.path={copy}", "trainer.steps=1", "seed=6", "eval.seed=11"])
    assert len(counted) == 2


@pytest.mark.parametrize("text", ["{not json", json.dumps({"key": {}}), json.dumps({"key": {}, "metrics": {"a": "x"}}),
                                  json.dumps([1, 2])])
def test_a_damaged_eval_file_is_ignored_with_a_warning(warm, tmp_path, counted, caplog, text):
    warm_dir, _ = warm
    copy = tmp_path / "model"
    shutil.copytree(warm_dir / "final_model", copy)
    (copy / FILE).write_text(text)
    with caplog.at_level(logging.WARNING):
        _fit(tmp_path / "run", ["warmup.steps=0", f"model.path={copy}", "trainer.steps=1", "seed=6", "eval.seed=11"])
    assert len(counted) == 2 and any(FILE in r.getMessage() and "evaluating afresh" in r.getMessage()
                                     for r in caplog.records)


def test_a_run_with_warmup_does_not_reuse(warm, tmp_path, counted):
    """SFT on top of the loaded model changes it: the recorded evaluation is not of this model."""
    warm_dir, _ = warm
    _fit(tmp_path / "run", ["warmup.steps=2", f"model.path={warm_dir / 'final_model'}", "trainer.steps=1",
                            "seed=6", "eval.seed=11"])
    assert len(counted) == 2


@pytest.mark.parametrize("key", ["eval.seed", "data.synthetic.eval_seed"])
@pytest.mark.parametrize("value", ["-1", "true", "1.5", "x"])
def test_bad_eval_seeds_are_named(key, value):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(CONFIG, [f"{key}={value}"])


def test_weights_digest_sees_one_ulp():
    from hapo_openrlhf.local.eval_cache import weights_digest

    m = torch.nn.Linear(3, 2)
    d = weights_digest(m)
    with torch.no_grad():
        m.weight[0, 0] = torch.nextafter(m.weight[0, 0], torch.tensor(10.0))
    assert weights_digest(m) != d


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


# each edit changes what generation produces, while the weights stay the same (issue 42:
# all four reused the warm start's evaluation before the key covered the model's files)
EDITS = {
    "config.json rms_norm_eps": lambda d: _edit_json(d / "config.json", rms_norm_eps=0.5),
    "generation_config.json repetition_penalty": lambda d: _edit_json(d / "generation_config.json",
                                                                      repetition_penalty=5.0),
    "tokenizer_config.json eos_token": lambda d: _edit_json(d / "tokenizer_config.json", eos_token="."),
    "tokenizer.json": lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text() + "\n"),
}


@pytest.mark.parametrize("edit", [None, *EDITS], ids=["unedited", *EDITS])
def test_an_edit_to_any_model_file_that_changes_generation_misses_the_cache(warm, tmp_path, counted, edit):
    warm_dir, _ = warm
    copy = tmp_path / "model"
    shutil.copytree(warm_dir / "final_model", copy)
    if edit is not None:
        EDITS[edit](copy)
    _fit(tmp_path / "run", ["warmup.steps=0", f"model.path={copy}", "trainer.steps=1", "seed=6", "eval.seed=11"])
    assert len(counted) == (1 if edit is None else 2)  # the copy itself is reused; every edit evaluates afresh


@pytest.mark.parametrize("metrics", [{"eval/response_len": 3.0}, {"eval/accuracy": float("nan"), "eval/response_len": 3.0},
                                     {"eval/accuracy": True, "eval/response_len": 3.0}],
                         ids=["no accuracy", "nan", "bool"])
def test_cached_metrics_that_are_not_an_evaluation_are_ignored(warm, tmp_path, counted, caplog, metrics):
    warm_dir, _ = warm
    copy = tmp_path / "model"
    shutil.copytree(warm_dir / "final_model", copy)
    saved = json.loads((copy / FILE).read_text())
    (copy / FILE).write_text(json.dumps({"key": saved["key"], "metrics": metrics}))  # the key still matches
    with caplog.at_level(logging.WARNING):
        summary = _fit(tmp_path / "run", ["warmup.steps=0", f"model.path={copy}", "trainer.steps=1", "seed=6",
                                          "eval.seed=11"])
    assert len(counted) == 2 and summary["before"] == saved["metrics"]  # evaluated afresh: the true numbers
    assert any("evaluating afresh" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_special_file_as_eval_json_is_refused_without_reading_it(warm, tmp_path, counted, caplog, kind):
    import os

    warm_dir, _ = warm
    copy = tmp_path / "model"
    shutil.copytree(warm_dir / "final_model", copy)
    (copy / FILE).unlink()
    if kind == "dev-zero":
        (copy / FILE).symlink_to("/dev/zero")
    else:
        os.mkfifo(copy / FILE)
    with caplog.at_level(logging.WARNING):
        _fit(tmp_path / "run", ["warmup.steps=0", f"model.path={copy}", "trainer.steps=1", "seed=6", "eval.seed=11"])
    assert len(counted) == 2
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
