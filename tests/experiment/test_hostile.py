"""`hapo experiment` and its manifest under hostile input (issue 42): nothing outside the
output directory is deleted or written, a second runner is refused, a killed worker fails
only its own job, pre-registration is enforced, and every malformed file or value is one
`hapo: error:` line naming the file and the key."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hapo_openrlhf.experiment import load_experiment
from hapo_openrlhf.experiment.registration import register
from hapo_openrlhf.experiment.report import comparison_sets, read_manifest
from hapo_openrlhf.experiment.runner import MARKER, _prepare, run_experiment

from ..conftest import REPO, cli_in_process, run_cli

BASE = str(REPO / "configs" / "cpu_tiny.yaml")
# a warm start and a run of a few seconds each
TINY = ["trainer.steps=2", "trainer.eval_every=0", "warmup.steps=10", "data.synthetic.eval_size=4",
        "data.synthetic.train_size=100", "eval.n_samples=1", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12", "eval.max_new_tokens=12",
        "algorithm.max_gen_rounds=1", "trainer.sample_every=0", "trainer.save_every=0"]


def _exp(tmp_path: Path, body: dict, name: str = "exp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump({"run_config": BASE, **body}))
    return p


def _sets(xs):
    return [a for x in xs for a in ("--set", x)]


def _one_error(res) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout[-1500:], res.stderr[-1500:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert len(errs) == 1, res.stderr[-2000:]
    return errs[0]


def _tree(d: Path) -> dict:
    """Every file under ``d`` with its bytes (what must survive untouched)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ confinement
@pytest.mark.parametrize("variant", ["{victim}", "../../victim"])
def test_a_variant_name_that_is_a_path_is_refused_and_nothing_outside_is_touched(tmp_path, variant):
    victim = tmp_path / "victim"
    (victim / "seed_1").mkdir(parents=True)
    (victim / "seed_1" / "precious.txt").write_text("keep me")
    name = variant.replace("{victim}", str(victim))
    p = _exp(tmp_path, {"variants": {name: {}}, "suites": {"s": [name]}, "seeds": [1]})
    before = _tree(tmp_path)
    res = cli_in_process(["experiment", "s", "--config", str(p), "--output-dir", str(tmp_path / "out")])
    err = _one_error(res)
    assert str(p) in err and "variant" in err and "is not a valid name" in err
    assert _tree(tmp_path) == before  # nothing deleted, nothing written (not even OUT)


@pytest.mark.parametrize("name", ["a/b", ".hidden", "..", "x y", "", "a" * 129, 7])
def test_names_that_are_not_names_are_refused(tmp_path, name):
    for body in ({"variants": {name: {}}, "suites": {"s": [name]}}, {"variants": {"a": {}}, "suites": {name: ["a"]}}):
        with pytest.raises(ValueError, match="is not a valid name"):
            load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_a_symlink_inside_the_output_directory_is_refused_before_anything_runs(tmp_path):
    victim = tmp_path / "victim"
    (victim / "seed_1").mkdir(parents=True)
    (victim / "seed_1" / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "a").symlink_to(victim, target_is_directory=True)
    before = _tree(victim)
    p = _exp(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1]})
    err = _one_error(run_cli(["experiment", "s", "--config", str(p), "--output-dir", str(out), *_sets(TINY)]))
    assert "runs/a is a symbolic link" in err
    assert _tree(victim) == before and not (out / "warm_start").exists()


def test_a_directory_the_runner_did_not_create_is_never_deleted(tmp_path):
    """A warm-start directory with no checkpoint and no marker (not made by the runner) is
    left as it is: its job fails by name, its runs are skipped, the exit status says so."""
    out = tmp_path / "out"
    foreign = out / "warm_start" / "seed_1"
    foreign.mkdir(parents=True)
    (foreign / "precious.txt").write_text("keep me")
    p = _exp(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1]})
    res = run_cli(["experiment", "s", "--config", str(p), "--output-dir", str(out), *_sets(TINY)])
    assert res.returncode == 1, res.stderr[-2000:]
    assert (foreign / "precious.txt").read_text() == "keep me" and sorted(os.listdir(foreign)) == ["precious.txt"]
    job = json.loads((out / "experiment.json").read_text())["jobs"]["warm_start/seed_1"]
    assert job["status"] == "failed" and "was not created by `hapo experiment`" in job["error"]
    assert json.loads(res.stdout.strip().splitlines()[-1])["skipped"] == ["a/seed_1"]


def test_a_run_that_died_before_its_checkpoint_is_cleared_only_inside_its_marked_directory(tmp_path):
    exp = load_experiment(_exp(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1]}),
                          output_dir=str(tmp_path / "out"))
    job = exp.runs[("a", 1)]
    _prepare(exp, job)  # creates it, with the marker
    assert json.loads((job.out / MARKER).read_text()) == {"experiment": str(exp.output_dir), "job": "a/seed_1"}
    (job.out / "metrics.jsonl").write_text('{"step": 1}\n')  # what a run leaves before its first checkpoint
    (job.out / "sub").mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (job.out / "link").symlink_to(outside)
    _prepare(exp, job)
    assert sorted(os.listdir(job.out)) == sorted([MARKER, ".hapo.lock"]) and outside.read_text() == "keep me"


# ------------------------------------------------------------------ one runner, a killed worker
def _recs(d: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (d / "metrics.jsonl").read_text().splitlines()]


def test_a_second_runner_is_refused_and_a_killed_worker_fails_its_job_alone(tmp_path):
    """While a runner works, a second one on the same directory is refused by name. SIGKILL
    to the worker running variant a (as the out-of-memory killer would): a is failed by
    name, b still runs, the manifest is written, the exit status is 1, and b equals the
    same run trained alone (the refused runner touched nothing). A rerun with other settings
    is refused; the same rerun starts a again in its own (marked) directory and finishes it."""
    p = _exp(tmp_path, {"variants": {"a": {"override": {"trainer": {"steps": 12}}}, "b": {}},
                        "suites": {"s": ["a", "b"]}, "seeds": [1], "workers": 1})
    out = tmp_path / "out"
    args = ["experiment", "s", "--config", str(p), "--output-dir", str(out), *_sets(TINY)]
    runner = subprocess.Popen([sys.executable, "-m", "hapo_openrlhf", *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    lock = out / "runs" / "a" / "seed_1" / ".hapo.lock"
    try:
        deadline = time.time() + 300
        while True:  # the worker writes its PID into the run's lock once the run has started
            assert runner.poll() is None and time.time() < deadline, runner.communicate()
            try:
                pid = json.loads(lock.read_text())["pid"]
                break
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        # a second runner while the first is at work (in this process: no start-up race with the
        # job it would have to catch): refused by name before it touches anything
        with pytest.raises(ValueError, match=rf"output directory {re.escape(str(out.resolve()))} is in use by "
                                             rf"PID {runner.pid} "):
            run_experiment(load_experiment(p, output_dir=str(out), overrides=TINY), ["s"])
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = runner.communicate(timeout=600)
    finally:
        runner.kill()
    assert runner.returncode == 1, stderr[-3000:]
    jobs = json.loads((out / "experiment.json").read_text())["jobs"]
    assert jobs["a/seed_1"]["status"] == "failed"
    assert "worker process running it died (killed by signal 9 (SIGKILL" in jobs["a/seed_1"]["error"]
    assert jobs["b/seed_1"]["status"] == "done" and "a/seed_1 FAILED" in " ".join(stderr.split())
    b = out / "runs" / "b" / "seed_1"
    res = run_cli(["train", "--config", str(b / "config.yaml"), "--output-dir", str(tmp_path / "alone")])
    assert res.returncode == 0, res.stderr[-3000:]
    assert _recs(b) == _recs(tmp_path / "alone")
    assert (b / "final_model" / "model.safetensors").read_bytes() == \
        (tmp_path / "alone" / "final_model" / "model.safetensors").read_bytes()
    res = run_cli([*args, "--set", "optim.lr=3e-4"])  # other settings than the registered ones: refused
    assert res.returncode == 2 and "different configuration" in res.stderr
    res = run_cli(args, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "runs" / "a" / "seed_1" / "summary.json").exists()


# ------------------------------------------------------------------ pre-registration
def test_preregistration_is_recorded_enforced_and_late_comparisons_are_reported_apart(tmp_path):
    def exp(comparisons, lr=None, seeds=(1, 2)):
        body = {"variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]}, "comparisons": comparisons,
                "seeds": list(seeds)}
        if lr is not None:
            body["common"] = {"optim": {"lr": lr}}
        return load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"))

    path = tmp_path / "o" / "experiment.json"
    first = register({}, exp([{"a": "a", "b": "b"}]), ["a", "b"], path)
    reg = first["registration"]
    assert reg["comparisons"] == [{"a": "a", "b": "b"}] and reg["seeds"] == [1, 2] and set(reg["settings"]) == {"a", "b"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", reg["at"])
    # a comparison stated later is kept apart with its time; the registered one stays
    later = register(first, exp([{"a": "b", "b": "a"}], seeds=(1, 2, 3)), ["a", "b"], path)
    assert later["registration"]["comparisons"] == [{"a": "a", "b": "b"}]
    assert [(c["a"], c["b"]) for c in later["comparisons_added"]] == [("b", "a")] and later["seeds_added"].keys() == {"3"}
    manifest = {"comparisons": [{"a": "b", "b": "a"}], **later}
    registered, added, at = comparison_sets(manifest)
    assert registered == [{"a": "a", "b": "b"}] and [(c["a"], c["b"]) for c in added] == [("b", "a")] and at == reg["at"]
    # the settings cannot change
    with pytest.raises(ValueError, match=r"a, b now resolve to a different configuration than the one registered"):
        register(first, exp([{"a": "a", "b": "b"}], lr=1e-3), ["a", "b"], path)
    # a manifest from before registration: its comparisons are as stated, without a time, and
    # a registration first recorded on such a manifest claims no time either
    assert comparison_sets({"comparisons": [{"a": "a", "b": "b"}]}) == ([{"a": "a", "b": "b"}], [], None)
    late = register({"jobs": {"a/seed_1": {"status": "done", "wall_s": 1.0}}}, exp([{"a": "a", "b": "b"}]), ["a", "b"],
                    path)
    assert late["registration"]["recorded_after_runs"] is True
    assert comparison_sets({"comparisons": [{"a": "a", "b": "b"}], **late}) == ([{"a": "a", "b": "b"}], [], None)


def test_seeds_the_file_named_at_registration_are_reported_apart_from_added_ones(tmp_path):
    """An invocation with ``--seeds`` (a few of the file's) registers the file's whole seed list as
    planned; a later invocation's seeds from that list are reported as run later, as planned, and
    only a seed the file did not name then as added after the registration."""
    from hapo_openrlhf.experiment.report import _comparison_sections

    def exp(seeds, cli=None):
        body = {"variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]}, "comparisons": [{"a": "a", "b": "b"}],
                "seeds": list(seeds)}
        return load_experiment(_exp(tmp_path, body), seeds=cli, output_dir=str(tmp_path / "o"))

    path = tmp_path / "o" / "experiment.json"
    first = register({}, exp((1, 2, 3, 4), cli=[1, 2]), ["a", "b"], path)
    assert first["registration"]["seeds"] == [1, 2] and first["registration"]["planned_seeds"] == [1, 2, 3, 4]
    later = register(first, exp((1, 2, 3, 4, 9)), ["a", "b"], path)  # 3, 4 as planned; 9 a new one
    assert set(later["seeds_added"]) == {"3", "4", "9"}
    text = "\n".join(_comparison_sections(later, [], [], first["registration"]["at"], [], [], 8))
    assert "as the experiment file named them when it was registered: 2 seed(s) (3, 4;" in text
    assert "Added after the registration: seed 9 (" in text and "seed 3 (" not in text
    # many added seeds: one line that counts and spans them
    many = register(first, exp((1, 2, 3, 4, *range(9, 17))), ["a", "b"], path)
    text = "\n".join(_comparison_sections(many, [], [], first["registration"]["at"], [], [], 8))
    assert "Added after the registration: 8 seeds (9, 10, 11, 12, 13, 14, ... 16; first run from 20" in text
    # a registration from before planned_seeds existed: every later seed is reported as added
    old = {**later, "registration": {k: v for k, v in later["registration"].items() if k != "planned_seeds"}}
    text = "\n".join(_comparison_sections(old, [], [], first["registration"]["at"], [], [], 8))
    assert "seed 3 (" in text and "seed 9 (" in text and "as the experiment file named" not in text


def test_other_code_than_the_registered_is_refused_unless_named_and_the_report_prints_it(tmp_path):
    """Issue 60: the registration records the code (package sources, torch, transformers, the commit);
    a later invocation whose sources or libraries differ is refused by name; ``--code-change REASON``
    goes on and records the reason and the differences, which the report prints. The family-wise
    level is frozen with the registration."""
    from hapo_openrlhf.experiment.registration import run_identity

    def exp(alpha=None):
        body = {"variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]}, "comparisons": [{"a": "a", "b": "b"}],
                "seeds": [1]}
        if alpha is not None:
            body["familywise_alpha"] = alpha
        return load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"))

    path = tmp_path / "o" / "experiment.json"
    first = register({}, exp(), ["a", "b"], path)
    code = first["registration"]["code"]
    assert code == run_identity()
    assert {"sources_sha256", "torch", "transformers", "cpu_capability", "cpu_model"} <= set(code)
    assert first["registration"]["familywise_alpha"] == 0.05
    assert register(first, exp(), ["a", "b"], path)["code_changes"] == []  # the same code: nothing to say
    other = json.loads(json.dumps(first))
    other["registration"]["code"]["sources_sha256"] = "0" * 64
    other["registration"]["code"]["torch"] = "2.0.0"
    with pytest.raises(ValueError, match=r"registered .* with other code than this checkout's \(sources_sha256: 0000"):
        register(other, exp(), ["a", "b"], path)
    went = register(other, exp(), ["a", "b"], path, code_change="a docstring fix, numbers unchanged")
    (c,) = went["code_changes"]
    assert c["reason"] == "a docstring fix, numbers unchanged"
    assert c["differences"] == [f"sources_sha256: {'0' * 64} -> {code['sources_sha256']}",
                                f"torch: 2.0.0 -> {code['torch']}"]
    assert len(register({**other, **went}, exp(), ["a", "b"], path, code_change="again")["code_changes"]) == 2
    with pytest.raises(ValueError, match="familywise_alpha is now 0.01, registered as 0.05"):
        register(first, exp(alpha=0.01), ["a", "b"], path)
    # the report prints the registered code and the named change
    from hapo_openrlhf.experiment.report import _code_lines

    text = "\n".join(_code_lines({**other, **went}))
    assert "package sources sha256 0000000000000000..." in text and "torch 2.0.0" in text
    assert "**Code changed after the registration**" in text and "'a docstring fix, numbers unchanged'" in text
    # each run's recorded code against the registered: the same, other code (named), or not recorded
    from hapo_openrlhf.experiment.registration import run_code
    from hapo_openrlhf.experiment.stats import RunStats

    def run(seed, code):
        return RunStats("a", seed, 4, 2, [0, 2], [0.5, 0.6], [0.7, 0.8], [1, 2], [1.0, 0.9], code=code)

    mine = run_code(code)
    assert set(mine) <= {"sources_sha256", "git_commit", "git_dirty", "torch", "transformers", "cpu_capability",
                         "cpu_model"} and {"cpu_capability", "cpu_model"} <= set(mine)
    text = "\n".join(_code_lines(first, [run(1, mine), run(2, mine)]))
    assert "Each run's code: 2 of 2 finished runs recorded the registered code." in text
    text = "\n".join(_code_lines({**other, **went}, [run(1, {**mine, "sources_sha256": "0" * 64, "torch": "2.0.0"}), run(2, mine),
                                                     run(3, None)]))
    assert ("Each run's code: 1 of 3 finished runs recorded the registered code; **1 ran from other code**: a/seed_2; "
            "1 finished before runs recorded their code (each invocation that ran them was checked against the "
            "registration: 1 code change(s) recorded).") in text


def test_other_cpu_arithmetic_than_the_registered_is_refused_unless_named_and_the_report_names_its_runs(tmp_path):
    """The machine's CPU arithmetic (ATen's CPU capability, the CPU model) is registered with the code:
    the same code and seed compute another run on other vector kernels (League 2's code on an AVX2
    machine, docs/reproduction.md). An invocation on other arithmetic is refused by name -- not as other
    code -- unless ``--code-change`` names why; the report prints the registered arithmetic and names the
    runs made on another. A registration or run from before the record has none to compare: not flagged."""
    from hapo_openrlhf.experiment.registration import arithmetic_identity, run_code
    from hapo_openrlhf.experiment.report import _code_lines
    from hapo_openrlhf.experiment.stats import RunStats

    here = arithmetic_identity()
    assert set(here) == {"cpu_capability", "cpu_model"} and all(isinstance(v, str) and v for v in here.values())
    import torch

    assert here["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    body = {"variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]}, "comparisons": [{"a": "a", "b": "b"}],
            "seeds": [1]}
    exp = load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"))
    path = tmp_path / "o" / "experiment.json"
    first = register({}, exp, ["a", "b"], path)
    assert {k: first["registration"]["code"][k] for k in here} == here
    elsewhere = json.loads(json.dumps(first))
    elsewhere["registration"]["code"].update(cpu_capability="AVX512_TEST", cpu_model="Some Other CPU")
    with pytest.raises(ValueError) as err:
        register(elsewhere, exp, ["a", "b"], path)
    msg = str(err.value)
    assert (f"on other CPU arithmetic than this machine's (cpu_capability: AVX512_TEST -> {here['cpu_capability']}; "
            f"cpu_model: Some Other CPU -> {here['cpu_model']}") in msg
    assert "with other code" not in msg and "on a machine with the registered CPU" in msg and "--code-change" in msg
    went = register(elsewhere, exp, ["a", "b"], path, code_change="resumed on the cluster's AVX2 nodes")
    (c,) = went["code_changes"]
    assert c["differences"] == [f"cpu_capability: AVX512_TEST -> {here['cpu_capability']}",
                                f"cpu_model: Some Other CPU -> {here['cpu_model']}"]
    # a registration from before the record (no arithmetic): nothing to compare, nothing refused
    old = json.loads(json.dumps(first))
    for k in here:
        del old["registration"]["code"][k]
    assert register(old, exp, ["a", "b"], path)["code_changes"] == []

    def run(seed, code):
        return RunStats("a", seed, 4, 2, [0, 2], [0.5, 0.6], [0.7, 0.8], [1, 2], [1.0, 0.9], code=code)

    mine = run_code(first["registration"]["code"])
    other_both = {**mine, "sources_sha256": "0" * 64, "cpu_capability": "AVX512_TEST"}
    text = "\n".join(_code_lines(first, [run(1, mine), run(2, {**mine, "cpu_capability": "AVX512_TEST"}),
                                         run(3, other_both)]))
    assert f"; CPU arithmetic {here['cpu_capability']} ({here['cpu_model']})." in text
    assert ("Each run's code: 1 of 3 finished runs recorded the registered code; **1 ran from other code**: a/seed_3; "
            "**1 ran on other CPU arithmetic** (the same code computes other numbers there): a/seed_2.") in text
    text = "\n".join(_code_lines(old, [run(1, mine)]))
    assert "the CPU arithmetic not recorded (a registration before it was)" in text
    assert "Each run's code: 1 of 1 finished runs recorded the registered code." in text


def test_the_report_shows_late_comparisons_apart(tmp_path):
    from hapo_openrlhf.experiment.report import build_experiment_report

    from .test_stats_findings import _write_run

    runs = {}
    for v, finals in (("a", (0.6, 0.62)), ("b", (0.5, 0.55))):
        for s, f in zip((1, 2), finals):
            d = tmp_path / "runs" / v / f"seed_{s}"
            _write_run(d, [(0, 0.4), (10, f)], [1.0] * 10)
            (d / "summary.json").write_text(json.dumps({"before": {"eval/accuracy": 0.4}, "after": {"eval/accuracy": f}}))
            runs[f"{v}/seed_{s}"] = str(d)
    manifest = {"experiment": "e.yaml", "seeds": [1, 2], "suites": {"s": ["a", "b"]}, "suites_run": ["s"], "jobs": {},
                "runs": runs, "workers": 1, "threads_per_worker": 1, "comparisons": [{"a": "a", "b": "b"}],
                "registration": {"at": "2026-12-01T10:00:00Z", "comparisons": [], "seeds": [1, 2], "settings": {}},
                "comparisons_added": [{"a": "a", "b": "b", "at": "2026-12-02T09:00:00Z"}]}
    (tmp_path / "experiment.json").write_text(json.dumps(manifest))
    md = build_experiment_report(tmp_path).read_text()
    assert "## Pre-registered comparisons" not in md
    assert "## Comparisons added after the runs started" in md and "a vs b: 2026-12-02T09:00:00Z" in md
    rows = json.loads((tmp_path / "report" / "comparisons.json").read_text())
    assert rows[0]["added_after_runs"] == "2026-12-02T09:00:00Z"


def test_the_report_of_nested_warm_starts_averages_within_each_and_prints_holm(tmp_path):
    """Seeds 1, 2 from warm start 10 and 3, 4 from 20: the report says so, the registered comparison's
    row is the two-level mean (2 warm starts x 4 seeds) with its p and Holm's verdict at the registered
    family-wise level."""
    from hapo_openrlhf.experiment.report import build_experiment_report

    from .test_stats_findings import _write_run

    runs, finals = {}, {"a": (0.62, 0.64, 0.60, 0.62), "b": (0.50, 0.50, 0.50, 0.50)}
    for v, fs in finals.items():
        for s, f in zip((1, 2, 3, 4), fs):
            d = tmp_path / "runs" / v / f"seed_{s}"
            _write_run(d, [(0, 0.4), (10, f)], [1.0] * 10)
            (d / "summary.json").write_text(json.dumps({"before": {"eval/accuracy": 0.4}, "after": {"eval/accuracy": f}}))
            runs[f"{v}/seed_{s}"] = str(d)
    manifest = {"experiment": "e.yaml", "seeds": [1, 2, 3, 4], "suites": {"s": ["a", "b"]}, "suites_run": ["s"],
                "jobs": {}, "runs": runs, "workers": 1, "threads_per_worker": 1, "comparisons": [{"a": "a", "b": "b"}],
                "warm_start_of_seed": {"1": 10, "2": 10, "3": 20, "4": 20},
                "registration": {"at": "2026-12-01T10:00:00Z", "comparisons": [{"a": "a", "b": "b"}], "seeds": [1, 2, 3, 4],
                                 "settings": {}, "familywise_alpha": 0.1}}
    (tmp_path / "experiment.json").write_text(json.dumps(manifest))
    md = build_experiment_report(tmp_path).read_text()
    assert "nested in 2 warm starts (trained with seeds [10, 20])" in md
    assert "| a | b | 2 warm starts x 4 seeds |" in md and "Holm (family-wise 0.1)" in md
    (row,) = json.loads((tmp_path / "report" / "comparisons.json").read_text())
    assert row["diff"] == pytest.approx(0.12) and row["per_warm_start"] == pytest.approx({"10": 0.13, "20": 0.11})
    assert row["holm"] == row["verdict"] == "a > b" and row["holm_threshold"] == 0.1


def test_a_damaged_results_file_is_named(tmp_path):
    from hapo_openrlhf.experiment.results import FORMAT, load

    f = tmp_path / "r.json"
    run = {"variant": "a", "seed": 1, "k": 4, "steps": 2, "eval_steps": [0, 2], "avg": [0.5, 0.6], "pass": [0.7, 0.8],
           "train_steps": [1, 2], "entropy": [1.0, 0.9],
           "quadrant": {q: {s: [0.1, None] for s in ("token_frac", "entropy_mean", "adv_abs_mean", "entropy_delta")}
                        for q in ("PHR", "PLR", "NHR", "NLR")}}
    good = {"format": FORMAT, "manifest": {"seeds": [1], "suites": {"s": ["a"]}}, "runs": [run]}
    f.write_text(json.dumps(good))
    m, runs = load(f)
    assert runs[0].final == 0.6 and runs[0].quadrant["PHR"]["entropy_mean"] == [0.1, None] and m["suites_run"] == ["s"]
    assert runs[0].credit is None  # a file from before the credit counts were kept loads without them
    credit = {c: {"tokens": 4, "shift": 0.5, "scale_sum": 4.5, "scale_n": 4} for c in ("fork", "result", "routine")}
    f.write_text(json.dumps({**good, "runs": [{**run, "credit": credit}]}))
    assert load(f)[1][0].credit == credit
    for bad, named in (({**good, "format": "x"}, "not a results file of this format"),
                       ({**good, "runs": [{**run, "avg": [0.5]}]}, "avg and eval_steps differ"),
                       ({**good, "runs": [{**run, "avg": [0.5, "x"]}]}, r"runs\[0\] is damaged"),
                       ({**good, "runs": [{k: v for k, v in run.items() if k != "entropy"}]}, r"runs\[0\] is damaged"),
                       ({k: v for k, v in good.items() if k != "manifest"}, "'manifest' must be an object"),
                       # the token-credit counts (issue 60): each class, each field, counts and finite sums
                       ({**good, "runs": [{**run, "credit": {"fork": credit["fork"]}}]},
                        r"runs\[0\]: credit must map each of fork, result, routine"),
                       ({**good, "runs": [{**run, "credit": {**credit, "result": {"tokens": 3}}}]},
                        r"credit\['result'\] must hold tokens, shift, scale_sum and scale_n"),
                       ({**good, "runs": [{**run, "credit": {**credit, "fork": {**credit["fork"], "tokens": 1.5}}}]},
                        r"credit\['fork'\]\['tokens'\] must be a count"),
                       ({**good, "runs": [{**run, "credit": {**credit, "fork": {**credit["fork"], "shift": -1.0}}}]},
                        r"credit\['fork'\]\['shift'\] must be a finite number >= 0"),
                       ({**good, "runs": [{**run, "code": {"torch": 2.13}}]}, r"runs\[0\]: code must map names to")):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=named):
            load(f)
    from hapo_openrlhf.experiment.results import write

    with pytest.raises(ValueError, match="is a directory: name the results file"):  # --results DIR: named, no traceback
        write(tmp_path, good)
    assert write(tmp_path / "new" / "r.json", good).exists()  # its parent made


# ------------------------------------------------------------------ named errors
def _manifest(tmp_path):
    return {"seeds": [1], "suites": {"s": ["a"]}, "suites_run": ["s"], "runs": {"a/seed_1": str(tmp_path / "r")},
            "jobs": {"a/seed_1": 3}}


def test_a_jobs_entry_that_is_not_an_object_is_named_by_rerun_and_report(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "experiment.json").write_text(json.dumps(_manifest(tmp_path)))
    with pytest.raises(ValueError, match=r"experiment.json: jobs\['a/seed_1'\] must be an object"):
        read_manifest(out / "experiment.json")
    p = _exp(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1]})
    err = _one_error(run_cli(["experiment", "s", "--config", str(p), "--output-dir", str(out)]))
    assert "experiment.json: jobs['a/seed_1'] must be an object" in err
    err = _one_error(run_cli(["report", str(out)]))
    assert "experiment.json: jobs['a/seed_1'] must be an object" in err


BAD_FILES = [
    ({"seeds": 5}, "seeds must be a list of distinct integers, got 5"),
    ({"suites": ["x"]}, "suites must be a non-empty mapping"),
    ({"variants": {"a": {"override": [1, 2]}}}, "variant 'a': override must be a mapping"),
    ({"common": [1, 2]}, "common must be a mapping"),
    ({"workers": [2]}, "workers must be an integer >= 1, got \\[2\\]"),
    ({"workers": "abc"}, "workers must be an integer >= 1, got 'abc'"),
    ({"output_dir": [1]}, "output_dir must be a directory name"),
    ({"comparisons": {"a": "a"}}, "comparisons must be a list"),
    ({"run_config": 3}, "run_config must be a file name"),
    ({"variants": {"a": {"config": [1]}}}, "variant 'a': config must be a file name"),
]


@pytest.mark.parametrize("edit, match", BAD_FILES, ids=[next(iter(e)) for e, _ in BAD_FILES])
def test_a_malformed_experiment_file_is_named_with_its_key(tmp_path, edit, match):
    body = {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1], **edit}
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump({"run_config": BASE, **body}))
    with pytest.raises(ValueError, match=match) as e:
        load_experiment(p, output_dir=str(tmp_path / "o"))
    assert str(p) in str(e.value)


@pytest.mark.parametrize("kind", ["seeds a", "seeds 1,,2", "non-utf8", "base non-utf8", "dev-zero base", "fifo"])
def test_bad_cli_values_and_special_files_are_one_named_line(tmp_path, kind):
    p = _exp(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1]})
    args = ["experiment", "s", "--config", str(p), "--output-dir", str(tmp_path / "o")]
    if kind.startswith("seeds"):
        args += ["--seeds", kind.split()[1]]
        match = rf"--seeds: '{'a' if kind == 'seeds a' else ''}' is not an integer"
    elif kind == "non-utf8":
        p.write_bytes(b"run_config: cpu\xff.yaml\n")
        match = rf"{re.escape(str(p))} \(experiment file\) is not UTF-8 text"
    elif kind in ("base non-utf8", "dev-zero base"):
        base = tmp_path / "run.yaml"
        if kind == "base non-utf8":
            base.write_bytes(b"seed: 1\nrun_name: \xff\n")
            match = "run.yaml.* is not UTF-8 text"
        else:
            base.write_text("base: /dev/zero\n")
            match = "/dev/zero.* is a device, not a regular file"
        p.write_text(yaml.safe_dump({"run_config": str(base), "variants": {"a": {}}, "suites": {"s": ["a"]}}))
    else:
        fifo = tmp_path / "fifo.yaml"
        os.mkfifo(fifo)
        args[3] = str(fifo)
        match = "fifo.yaml.* is a FIFO, not a regular file"
    # refused at load, in this process (cli.main: no torch import per case, issue 57); the FIFO in a
    # subprocess with a time limit, since the failure it guards against is a read that blocks
    res = run_cli(args, timeout=60) if kind == "fifo" else cli_in_process(args)
    err = _one_error(res)
    assert re.search(match, err), err


def test_twenty_thousand_seeds_resolve_into_their_own_jobs(tmp_path):
    """Each variant is validated once and copied per seed (40,000 full validations took over
    five minutes); every copy has its own seed, name, directory and warm start."""
    seeds = list(range(20000))
    p = _exp(tmp_path, {"variants": {"a": {}, "b": {"override": {"optim": {"lr": 1e-3}}}}, "suites": {"s": ["a", "b"]},
                        "seeds": seeds})
    exp = load_experiment(p, output_dir=str(tmp_path / "o"))
    assert len(exp.runs) == 40000 and len(exp.warm_jobs()) == 20000
    for v, s in (("a", 0), ("b", 19999), ("b", 7)):
        c = exp.runs[(v, s)].config
        assert c["seed"] == s and c["run_name"] == f"{v}_seed_{s}" and c["output_dir"] == str(tmp_path / "o" / "runs" / v / f"seed_{s}")
        assert c["model"]["path"] == str((tmp_path / "o" / "warm_start" / f"seed_{s}" / "final_model").resolve())
        assert c["optim"]["lr"] == (1e-3 if v == "b" else exp.runs[("a", 1)].config["optim"]["lr"])
    assert exp.runs[("a", 0)].config["model"] is not exp.runs[("a", 1)].config["model"]


# ------------------------------------------------------------------ issue 55: registration that cannot be laundered
def test_a_registration_after_finished_runs_is_marked_whatever_the_manifests_history(tmp_path):
    """The manifest moved aside (the runner's advice for a damaged one): the finished runs'
    directories predate the new registration, which is marked recorded_after_runs with those runs
    named -- a comparison added after the results cannot pass as pre-registered. A registration
    whose time is later than a finished run (an edited manifest) is marked the same way. Each
    registration records the code that runs it."""
    body = {"variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]}, "comparisons": [{"a": "a", "b": "b"}],
            "seeds": [1]}
    exp = load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"))
    path = tmp_path / "o" / "experiment.json"
    fresh = register({}, exp, ["a", "b"], path, finished={})["registration"]
    assert "recorded_after_runs" not in fresh
    code = fresh["code"]
    assert re.fullmatch(r"[0-9a-f]{64}", code["sources_sha256"]) and code["version"] == "0.1.0"
    assert re.fullmatch(r"[0-9a-f]{40}", code.get("git_commit", "0" * 40))
    moved = register({}, exp, ["a", "b"], path, finished={"a/seed_1": 1.0, "warm_start/seed_1": 0.5})["registration"]
    assert moved["recorded_after_runs"] is True and moved["runs_before_registration"] == ["a/seed_1"]
    assert comparison_sets({"comparisons": [{"a": "a", "b": "b"}], "registration": moved}) == \
        ([{"a": "a", "b": "b"}], [], None)  # no pre-registration time claimed
    edited = {"registration": {**fresh, "at": "2030-01-01T00:00:00Z"}}
    later = register(edited, exp, ["a", "b"], path, finished={"b/seed_1": time.time()})["registration"]
    assert later["recorded_after_runs"] is True and later["runs_before_registration"] == ["b/seed_1"]
    ok = register({"registration": fresh}, exp, ["a", "b"], path, finished={"b/seed_1": time.time() + 60})
    assert "recorded_after_runs" not in ok["registration"]


def test_the_registration_is_written_before_the_first_job_runs(tmp_path, monkeypatch):
    """A runner stopped during the warm start still leaves its registration."""
    from hapo_openrlhf.experiment import runner

    body = {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1], "warm_start_seed": 7}
    exp = load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"), overrides=TINY)
    seen = {}

    def stop(self, job):
        seen["manifest"] = json.loads((tmp_path / "o" / "experiment.json").read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr(runner._Workers, "submit", stop)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(exp, ["s"])
    reg = seen["manifest"]["registration"]
    assert reg["seeds"] == [1] and set(reg["settings"]) == {"a"} and "sources_sha256" in reg["code"]


def test_a_shared_warm_start_seed_that_is_also_an_rl_seed_is_refused(tmp_path):
    body = {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1, 2], "warm_start_seed": 2}
    with pytest.raises(ValueError, match="warm_start_seed 2 is also an RL seed"):
        load_experiment(_exp(tmp_path, body), output_dir=str(tmp_path / "o"))


def test_a_runner_killed_with_sigkill_takes_its_workers_with_it(tmp_path):
    """kill -9 of the runner: its worker (training a run, holding the run's lock) dies with it
    (PR_SET_PDEATHSIG) instead of training on as an orphan; a rerun then finds the run free."""
    p = _exp(tmp_path, {"variants": {"a": {"override": {"trainer": {"steps": 40}}}}, "suites": {"s": ["a"]},
                        "seeds": [1], "workers": 1})
    out = tmp_path / "out"
    args = ["experiment", "s", "--config", str(p), "--output-dir", str(out), *_sets(TINY)]
    runner = subprocess.Popen([sys.executable, "-m", "hapo_openrlhf", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    lock = out / "runs" / "a" / "seed_1" / ".hapo.lock"
    try:
        deadline = time.time() + 300
        while True:
            assert runner.poll() is None and time.time() < deadline
            try:
                pid = json.loads(lock.read_text())["pid"]
                break
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the worker {pid} outlived its runner")
    finally:
        runner.kill()


def test_missing_runs_are_listed_when_few_and_a_partial_experiment_says_so_when_many():
    from hapo_openrlhf.experiment.report import _missing_lines

    assert _missing_lines([], 5) == []
    assert _missing_lines(["a/seed_2", "b/seed_2"], 2) == ["**Missing runs** (not finished): a/seed_2, b/seed_2", ""]
    many = [f"{v}/seed_{s}" for s in range(3, 23) for v in ("a", "b")]  # 40 missing of 44
    (line, _) = _missing_lines(many, 4)
    assert line.startswith("**Partial: 4 of 44 runs finished.** Every table and verdict below is computed on the "
                           "finished runs alone")
    assert "Missing per variant: a 20, b 20 (first: a/seed_3, b/seed_3, a/seed_4, b/seed_4, ...)." in line
