"""`hapo experiment`: the experiment file, and a reduced run of the shipped toy
reproduction through the real CLI (the CI smoke test of the full experiment)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from hapo_openrlhf.experiment import load_experiment
from hapo_openrlhf.experiment.runner import _run_job

from ..conftest import REPO, cli_in_process, run_cli

TOY = REPO / "configs" / "experiments" / "toy_repro.yaml"
BASE = str(REPO / "configs" / "cpu_tiny.yaml")
# the smoke version: every variant, two seeds, a few steps, tiny evaluation
SMOKE = ["trainer.steps=2", "trainer.eval_every=1", "warmup.steps=20", "data.synthetic.eval_size=8",
         "data.synthetic.train_size=200", "eval.n_samples=2", "rollout.prompts_per_step=4",
         "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16", "eval.max_new_tokens=16",
         "algorithm.max_gen_rounds=1", "trainer.sample_every=0"]


def _sets(xs):
    return [a for x in xs for a in ("--set", x)]


def _write(tmp_path, body: dict) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump({"run_config": BASE, **body}))
    return p


def test_shipped_experiment_resolves_every_variant():
    exp = load_experiment(TOY)
    assert exp.seeds == (1, 2, 3) and exp.workers == 2 and exp.threads_per_worker == 1
    assert exp.suites["quadrants"] == ("quadrant_phr", "quadrant_plr", "quadrant_nhr", "quadrant_nlr")
    assert len(exp.variants_of(list(exp.suites))) == 17 and len(exp.runs) == 51
    algo = {v: exp.runs[(v, 1)].config["algorithm"] for v in exp.variants_of(list(exp.suites))}
    assert algo["hapo"]["estimator_params"] == {"alpha": 0.2, "phi": 2.0}  # the published rule's defaults
    assert algo["hapo_multiplicative"]["estimator_params"]["form"] == "multiplicative"
    assert [algo[f"hapo_alpha{a}"]["estimator_params"]["alpha"] for a in ("0.1", "0.4", "1.0")] == [0.1, 0.4, 1.0]
    assert algo["hapo_ablate_nhr"]["estimator_params"]["ablate"] == ["NHR"]
    assert algo["quadrant_plr"]["estimator_params"]["quadrants"] == ["PLR"]
    assert not algo["grpo"]["dynamic_sampling"] and algo["dapo"]["dynamic_sampling"]
    for (v, s), job in exp.runs.items():
        c = job.config
        assert c["seed"] == s and c["warmup"]["steps"] == 0 and c["trainer"]["threads"] == 1
        assert c["model"]["path"] == str((exp.warm[s].out / "final_model").resolve())
        assert c["trainer"]["steps"] == 100  # `common` reached every variant
    assert all(j.config["trainer"]["steps"] == 0 for j in exp.warm.values())


@pytest.mark.parametrize("body, match", [
    ({"variants": {"a": {}}, "suites": {"s": ["b"]}}, "suite 's' names unknown variant"),
    ({"variants": {"a": {}}, "suites": {"all": ["a"]}}, "'all' is reserved"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1, 1]}, "seeds must be distinct"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "bogus": 1}, "unknown key"),
    ({"variants": {"a": {"cfg": "x"}}, "suites": {"s": ["a"]}}, "variant 'a' must be a mapping"),
    ({"variants": {"a": {"override": {"data": {"synthetic": {"digits": 2}}}}}, "suites": {"s": ["a"]}},
     "changes \\['data'\\], which the shared warm start"),
    ({"variants": {"a": {"override": {"model": {"hidden_size": 64}}}}, "suites": {"s": ["a"]}}, "model.hidden_size"),
    ({"variants": {"a": {"override": {"algorithm": {"estimator": "nope"}}}}, "suites": {"s": ["a"]}},
     "variant 'a'.*nope"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "common": {"trainer": {"stepz": 1}}}, "trainer.stepz"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "warm_start_seed": "7"}, "warm_start_seed must be an integer"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "warm_start_seed": True}, "warm_start_seed must be an integer"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "warm_start_seed": -1}, "the warm start: invalid config: seed must be an integer in"),
    ({"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [2**32]}, "seed must be an integer in"),
])
def test_bad_experiment_files_fail_before_training(tmp_path, body, match):
    with pytest.raises(ValueError, match=match):
        load_experiment(_write(tmp_path, body))


def test_one_warm_start_shared_by_every_seed(tmp_path):
    """``warm_start_seed``: one warm start, trained with that seed, that every seed's runs start
    from (the paper's design: one base model, RL seeds); each run keeps its own seed."""
    exp = load_experiment(_write(tmp_path, {"variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]},
                                            "warm_start_seed": 7, "seeds": [1, 2, 3]}), output_dir=str(tmp_path / "o"))
    (job,) = exp.warm_jobs()
    assert job.seed == 7 and job.config["seed"] == 7 and job.out == tmp_path / "o" / "warm_start" / "seed_7"
    assert {exp.warm[s].name for s in (1, 2, 3)} == {job.name}
    for (v, s), run in exp.runs.items():
        assert run.config["seed"] == s and run.config["model"]["path"] == str((job.out / "final_model").resolve())
    assert exp.manifest()["warm_start_seed"] == 7
    per_seed = load_experiment(_write(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}, "seeds": [1, 2]}))
    assert [j.seed for j in per_seed.warm_jobs()] == [1, 2] and per_seed.manifest()["warm_start_seed"] is None


def test_a_failing_run_is_reported_not_raised(tmp_path):
    exp = load_experiment(_write(tmp_path, {"variants": {"a": {}}, "suites": {"s": ["a"]}}),
                          output_dir=str(tmp_path / "out"), seeds=[1])
    r = _run_job(exp.runs[("a", 1)])  # its warm start was never trained: model.path is missing
    assert r["status"] == "failed" and "model.path" in r["error"] and "does not exist" in r["error"]
    assert "Traceback" in r["traceback"]


def test_experiment_cli_smoke(tmp_path):
    """Every variant of the shipped experiment for two seeds, a few steps each: the report,
    the shared warm start, reuse on rerun, a run reproducible alone, conflicts refused."""
    out = tmp_path / "exp"
    cmd = ["experiment", "all", "--config", str(TOY), "--seeds", "1,2", "--output-dir", str(out), *_sets(SMOKE)]
    res = run_cli(cmd, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["failed"] == [] and last["skipped"] == []
    manifest = json.loads((out / "experiment.json").read_text())
    assert manifest["suites_run"] == ["alpha", "compare", "quadrants"]
    assert len(manifest["jobs"]) == 2 + 17 * 2 and all(j["status"] == "done" for j in manifest["jobs"].values())

    # report: Markdown, PNGs, every finding evaluated with two seeds
    report = Path(last["report"])
    md = report.read_text()
    for v in ("quadrant_plr", "grpo", "dapo", "hapo_ablate_nlr", "entro_adv", "forking", "hapo_alpha0.4"):
        assert f"| {v} |" in md
    for png in ("avg_at_k", "pass_at_k", "entropy", "quadrant_entropy", "quadrant_share"):
        assert (report.parent / f"{png}.png").stat().st_size > 1000
    findings = json.loads((report.parent / "findings.json").read_text())
    assert [f["id"] for f in findings] == ["plr_entropy_collapse", "plr_early_saturation", "nhr_faster_than_nlr",
                                           "phr_nhr_sustained", "hapo_entropy_stable", "alpha_robust",
                                           "hapo_ablation_hurts", "phr_beats_plr", "published_vs_multiplicative",
                                           "hapo_beats_baselines"]
    assert all(t["n"] == 2 for f in findings for t in f["tests"])

    # one warm start per seed, shared: every run of a seed starts from the same model, so its
    # step-0 evaluation equals the warm start's final evaluation exactly
    for s in (1, 2):
        warm = json.loads((out / "warm_start" / f"seed_{s}" / "summary.json").read_text())["after"]
        for v in manifest["suites"]["compare"] + manifest["suites"]["quadrants"]:
            run = out / "runs" / v / f"seed_{s}"
            assert json.loads((run / "summary.json").read_text())["before"] == warm, (v, s)
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            assert cfg["model"]["path"] == str((out / "warm_start" / f"seed_{s}" / "final_model").resolve())
    assert (out / "runs" / "hapo" / "seed_1" / "run.log").exists()

    # a run is an ordinary run: `hapo train` on its saved config reproduces it exactly
    alone = tmp_path / "alone"
    res = cli_in_process(["train", "--config", str(out / "runs" / "hapo" / "seed_2" / "config.yaml"),
                          "--output-dir", str(alone)])  # the CLI's main in this process (issue 57)
    assert res.returncode == 0, res.stderr[-2000:]

    def recs(d):
        return [{k: v for k, v in json.loads(l).items() if not k.startswith("time/")}
                for l in (d / "metrics.jsonl").read_text().splitlines()]

    assert recs(alone) == recs(out / "runs" / "hapo" / "seed_2")

    # rerun: everything is reused; a run deleted by hand is redone; the report is rebuilt
    shutil.rmtree(out / "runs" / "forking" / "seed_1")
    res = run_cli(["experiment", "compare", "--config", str(TOY), "--seeds", "1,2", "--output-dir", str(out),
                   *_sets(SMOKE)], timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "22 jobs (21 already finished)" in " ".join(res.stderr.split())
    assert (out / "runs" / "forking" / "seed_1" / "summary.json").exists()
    rerun = json.loads((out / "experiment.json").read_text())["jobs"]
    assert rerun["hapo/seed_1"]["reused"] and rerun["hapo/seed_1"]["wall_s"] == manifest["jobs"]["hapo/seed_1"]["wall_s"]
    # every run records the code it ran with (issue 60), the registered code here; a reused run keeps its record
    registered = manifest["registration"]["code"]
    for name, job in manifest["jobs"].items():
        keys = ("sources_sha256", "torch", "transformers", "cpu_capability", "cpu_model")  # the code and CPU arithmetic
        assert {k: job["code"][k] for k in keys} == {k: registered[k] for k in keys}, name
    assert rerun["hapo/seed_1"]["code"] == manifest["jobs"]["hapo/seed_1"]["code"]
    assert rerun["forking/seed_1"]["code"] == manifest["jobs"]["forking/seed_1"]["code"]  # run again, same code

    # a finished run made with another configuration is never overwritten
    res = cli_in_process(["experiment", "compare", "--config", str(TOY), "--seeds", "1,2", "--output-dir", str(out),
                          *_sets([*SMOKE, "optim.lr=3e-4"])])  # refused before any job runs
    assert res.returncode == 2 and "different configuration" in res.stderr

    # `hapo report EXPERIMENT_DIR` rebuilds the same report
    (report.parent / "experiment.md").unlink()
    res = cli_in_process(["report", str(out)])
    assert res.returncode == 0 and Path(res.stdout.strip()).read_text().startswith("# Experiment report")
    full = Path(res.stdout.strip()).read_text()

    # the results file (issue 60): written by the runner, and every table of the report rebuilt from it
    # alone, moved away from the run directories (which a fresh clone does not have)
    kept = tmp_path / "kept" / "toy.json"
    res = cli_in_process(["report", str(out), "--results", str(kept)])
    assert res.returncode == 0 and kept.exists() and (out / "results.json").exists()
    assert kept.stat().st_size < 200_000  # compact: 36 runs of a few steps
    shutil.rmtree(out / "runs")
    res = cli_in_process(["report", str(kept), "--output-dir", str(tmp_path / "from_file")])
    assert res.returncode == 0, res.stderr[-2000:]
    alone_md = (tmp_path / "from_file" / "experiment.md").read_text()

    def tables(text):  # every table row, the token-credit table's included (the file keeps each run's counts)
        return [ln for ln in text.splitlines() if ln.startswith("|")]

    assert tables(alone_md) == tables(full) and len(tables(full)) > 40
    assert "Each run's code: 34 of 34 finished runs recorded the registered code." in alone_md
    assert all(r["code"] == rerun[f"{r['variant']}/seed_{r['seed']}"]["code"]
               for r in json.loads(kept.read_text())["runs"])  # the results file keeps each run's code
    # these runs dump no token samples (trainer.sample_every=0): no credit table either way, and the file's
    # report says why (test_decisive_experiment_smoke rebuilds a credit table from its results file)
    assert "## Token credit" not in full and "keeps no run's token-credit counts" in alone_md
    rebuilt = json.loads((tmp_path / "from_file" / "findings.json").read_text())
    assert [(f["id"], f["verdict"]) for f in rebuilt] == [(f["id"], f["verdict"]) for f in findings]
    assert json.dumps(rebuilt) == json.dumps(findings) or all(  # the entropy curves are kept to 6 digits
        t1["diff"] == pytest.approx(t2["diff"], rel=1e-4, abs=1e-6)
        for f1, f2 in zip(rebuilt, findings) for t1, t2 in zip(f1["tests"], f2["tests"]))


def test_decisive_experiment_is_the_chain_task_with_its_preregistered_comparisons():
    """configs/experiments/decisive.yaml: the chain task exactly as configs/cpu_tiny_chain.yaml
    states it (one set of numbers), >= 8 held-out seeds disjoint from the development seeds
    101-103, the six methods, and the comparisons stated before the run."""
    from hapo_openrlhf.config import load_config

    exp = load_experiment(REPO / "configs/experiments/decisive.yaml")
    assert len(exp.seeds) >= 8 and not set(exp.seeds) & {101, 102, 103}
    chain = load_config(REPO / "configs/cpu_tiny_chain.yaml").to_dict()
    warm = exp.warm[exp.seeds[0]].config
    for section in ("data", "warmup"):
        assert warm[section] == chain[section], section
    for k in ("max_new_tokens",):
        assert warm["rollout"][k] == chain["rollout"][k] and warm["eval"][k] == chain["eval"][k]
    assert warm["eval"]["n_samples"] == chain["eval"]["n_samples"] == 8 and warm["data"]["synthetic"]["eval_size"] >= 512
    assert warm["model"] == {**chain["model"], "path": warm["model"]["path"]}
    assert exp.suites["decisive"] == ("grpo", "dapo", "hapo", "hapo_multiplicative", "entro_adv", "forking")
    algo = {v: exp.runs[(v, exp.seeds[0])].config["algorithm"] for v in exp.suites["decisive"]}
    assert algo["hapo"]["estimator"] == "hapo" and algo["hapo"]["estimator_params"] == {"alpha": 0.2, "phi": 2.0}
    assert algo["hapo_multiplicative"]["estimator_params"]["form"] == "multiplicative"
    assert [algo[v]["estimator"] for v in ("grpo", "dapo", "entro_adv", "forking")] == \
        ["grpo", "grpo", "entro_adv", "forking"]
    assert {"a": "hapo", "b": "grpo"} in exp.manifest()["comparisons"]
    # the RL runs share every setting but the algorithm (steps, lr, evaluation) with each other
    others = [{k: v for k, v in exp.runs[(v, exp.seeds[0])].config.items() if k not in ("algorithm", "run_name",
                                                                                          "output_dir")}
              for v in exp.suites["decisive"]]
    assert all(o == others[0] for o in others)


def test_decisive_followup_is_the_frozen_experiment_on_fresh_seeds():
    """configs/experiments/decisive_followup.yaml replicates HAPO vs GRPO with the frozen
    settings: the same warm start and run configs as decisive.yaml but the seed, on 28 seeds
    no earlier run used."""
    dec = load_experiment(REPO / "configs/experiments/decisive.yaml")
    fol = load_experiment(REPO / "configs/experiments/decisive_followup.yaml")
    assert len(fol.seeds) >= 28 and not set(fol.seeds) & (set(dec.seeds) | {101, 102, 103, 200})
    strip = ("output_dir", "run_name", "model")
    assert {k: v for k, v in fol.warm_jobs()[0].config.items() if k not in ("output_dir",)} == \
        {k: v for k, v in dec.warm_jobs()[0].config.items() if k not in ("output_dir",)}
    for v in ("grpo", "hapo"):
        a, b = fol.runs[(v, fol.seeds[0])].config, dec.runs[(v, dec.seeds[0])].config
        assert {k: x for k, x in a.items() if k not in (*strip, "seed")} == \
            {k: x for k, x in b.items() if k not in (*strip, "seed")}
        assert {**a["model"], "path": None} == {**b["model"], "path": None}
    assert fol.manifest()["comparisons"] == [{"a": "hapo", "b": "grpo"}]


def test_league_is_the_chain_task_with_its_named_comparisons_and_fresh_seeds():
    """configs/experiments/league.yaml (issue 40): the decisive experiment's warm start and RL
    settings (one set of numbers), the nine methods each with its own config's algorithm and
    sampling, the five comparisons named in the issue, and >= 24 held-out seeds (35: the
    decisive run's largest paired sd, 0.059, resolving 0.02 at 2 s.e.) that no earlier
    experiment used."""
    import math

    dec = load_experiment(REPO / "configs/experiments/decisive.yaml")
    fol = load_experiment(REPO / "configs/experiments/decisive_followup.yaml")
    lg = load_experiment(REPO / "configs/experiments/league.yaml")
    used = set(dec.seeds) | set(fol.seeds) | {101, 102, 103, 150, 151, 200, 300, 301}
    assert len(lg.seeds) == math.ceil((2 * 0.059 / 0.02) ** 2) == 35 and not set(lg.seeds) & used
    assert lg.warm_jobs()[0].config["seed"] not in used | set(lg.seeds)
    strip = ("output_dir", "seed", "run_name")
    assert {k: v for k, v in lg.warm_jobs()[0].config.items() if k not in strip} == \
        {k: v for k, v in dec.warm_jobs()[0].config.items() if k not in strip}
    methods = ("grpo", "dapo", "hapo", "entro_adv", "forking", "eapo_entropic", "stare", "pepo", "less")
    assert lg.suites["league"] == methods
    s0 = lg.seeds[0]
    for v in ("grpo", "dapo", "hapo", "entro_adv", "forking"):  # the decisive file's runs, seed aside
        a, b = lg.runs[(v, s0)].config, dec.runs[(v, dec.seeds[0])].config
        assert {k: x for k, x in a.items() if k not in (*strip, "model")} == \
            {k: x for k, x in b.items() if k not in (*strip, "model")}
    from hapo_openrlhf.config import load_config

    for v in ("eapo_entropic", "stare", "pepo", "less"):  # each competitor's own config, on the chain task
        own = load_config(REPO / f"configs/cpu_tiny_{v}.yaml").to_dict()
        run = lg.runs[(v, s0)].config
        assert run["algorithm"] == own["algorithm"], v
        for k in ("temperature", "top_p", "samples_per_prompt", "prompts_per_step"):
            assert run["rollout"][k] == own["rollout"][k], (v, k)
        assert run["rollout"]["max_new_tokens"] == 80 and run["trainer"]["steps"] == 30
    assert lg.manifest()["comparisons"] == [{"a": "hapo", "b": "grpo"}, {"a": "eapo_entropic", "b": "hapo"},
                                           {"a": "eapo_entropic", "b": "grpo"}, {"a": "stare", "b": "dapo"},
                                           {"a": "pepo", "b": "grpo"}]


def test_the_committed_results_files_load_and_hold_the_figures_the_docs_quote():
    """results/*.json (issue 60: kept under version control; `hapo report FILE` rebuilds from them):
    each loads under today's reader, and the figures docs/reproduction.md quotes from them recompute:
    League 2's HAPO - GRPO (the two-level mean over its 20 warm starts, p), and the rerun of its warm
    start 700 on another machine (the runs that differ from League 2's, GRPO seed 701's value, the
    token-credit means that League 2's own file cannot give)."""
    from hapo_openrlhf.experiment import results
    from hapo_openrlhf.experiment.credit import credit_from_counts
    from hapo_openrlhf.experiment.report import warm_start_of_seed
    from hapo_openrlhf.experiment.verdicts import compare

    files = sorted((REPO / "results").glob("*.json"))
    assert {f.name for f in files} >= {"league2.json", "league2_pilot.json", "league2_rerun_w700.json"}
    loaded = {f.name: results.load(f) for f in files}
    m, runs = loaded["league2.json"]
    assert len(runs) == 520 and all(r.credit is None for r in runs)
    (row,) = compare(runs, [{"a": "hapo", "b": "grpo"}], clusters=warm_start_of_seed(m))
    assert row["n"] == 20
    assert (round(row["diff"], 4), round(row["se"], 4), round(row["p"], 2)) == (-0.0078, 0.0075, 0.31)
    m2, rerun = loaded["league2_rerun_w700.json"]
    assert len(rerun) == 26 and all(r.credit is not None for r in rerun)
    old = {(r.variant, r.seed): r for r in runs}
    assert all(r.avg != old[(r.variant, r.seed)].avg for r in rerun)  # none reproduced on the other machine
    assert {r.avg[0] for r in rerun} == {0.568603515625} and {old[k].avg[0] for k in old if k[1] in (701, 702)} == \
        {0.569091796875}  # the warm start already differs
    grpo = next(r for r in rerun if (r.variant, r.seed) == ("grpo", 701))
    assert grpo.final == 0.78662109375 and old[("grpo", 701)].final == 0.758056640625
    scale = {v: credit_from_counts([r.credit for r in rerun if r.variant == v]) for v in ("hapo", "less", "prime")}
    rounded = {v: tuple(round(t[c]["mean_scale"], 3) for c in ("fork", "result", "routine")) for v, t in scale.items()}
    assert rounded == {"hapo": (1.007, 1.004, 0.914), "less": (0.656, 0.745, 0.414), "prime": (1.289, 1.277, 1.208)}


def test_league2_arms_differ_only_as_its_file_declares():
    """configs/experiments/league2.yaml (issue 60), frozen: the credit-only arms share one rollout setting
    (T 1.0 / top-p 0.95, G 8, 16 prompts, no dynamic sampling, no overlong penalty, no accuracy filter) and
    differ from each other only in the algorithm's estimator and loss, each the method's own config's;
    each paper-setting pair (the method, GRPO) differs only in estimator and loss, at that paper's
    sampling; 20 warm starts of two RL seeds each, none used by the pilot, the league or the decisive
    experiments; the ten comparisons; 60 steps."""
    from hapo_openrlhf.config import load_config

    l2 = load_experiment(REPO / "configs/experiments/league2.yaml")
    pilot = load_experiment(REPO / "configs/experiments/league2_pilot.yaml")
    earlier = set()
    for name in ("decisive", "decisive_followup", "league"):
        e = load_experiment(REPO / f"configs/experiments/{name}.yaml")
        earlier |= set(e.seeds) | {j.config["seed"] for j in e.warm_jobs()}
    earlier |= set(pilot.seeds) | set(pilot.nested.values()) | {101, 102, 103, 150, 151, 200, 300, 301}
    warm = set(l2.nested.values())
    assert len(warm) == 20 and len(l2.seeds) == 40 and not (set(l2.seeds) | warm) & earlier
    assert all(sum(1 for w in l2.nested.values() if w == x) == 2 for x in warm)
    cfg = {v: l2.runs[(v, l2.seeds[0])].config for v in (*l2.suites["credit"], *l2.suites["paper_settings"])}
    algo_only = {"estimator", "estimator_params", "loss", "loss_params", "aggregation", "kl_coef"}

    def same_but_algorithm(a, b):
        strip = ("output_dir", "run_name", "prm")  # the PRM's settings are read by PRIME alone
        return ({k: x for k, x in a.items() if k not in (*strip, "algorithm")}
                == {k: x for k, x in b.items() if k not in (*strip, "algorithm")}
                and {k: x for k, x in a["algorithm"].items() if k not in algo_only}
                == {k: x for k, x in b["algorithm"].items() if k not in algo_only})

    credit = l2.suites["credit"]
    assert credit == ("grpo", "hapo", "eapo_entropic", "stare", "pepo", "less", "prime")
    base = cfg["grpo"]
    assert (base["rollout"]["temperature"], base["rollout"]["top_p"], base["rollout"]["samples_per_prompt"],
            base["rollout"]["prompts_per_step"]) == (1.0, 0.95, 8, 16)
    assert not base["algorithm"]["dynamic_sampling"] and not base["algorithm"]["overlong"]["enable"]
    assert not base["algorithm"]["accuracy_filter"]["enable"] and base["trainer"]["steps"] == 60
    for v in credit:
        assert same_but_algorithm(cfg[v], base), v
        own = load_config(REPO / f"configs/cpu_tiny{'' if v == 'hapo' else '_' + v}.yaml").to_dict()["algorithm"]
        got = {k: cfg[v]["algorithm"][k] for k in algo_only}
        want = {k: own[k] for k in algo_only}
        if v == "prime":  # beta x length: the recipe's 0.05 x 3,072 tokens / 80 (the file's comment)
            assert got["estimator_params"].pop("beta") == 2.0 and want["estimator_params"].pop("beta") == 4.0
        assert got == want, v
    pairs = {"eapo_entropic_paper": ("grpo_eapo_setting", {"top_p": 1.0}, {"overlong": True, "dynamic": False}),
             "pepo_paper": ("grpo_pepo_setting", {"temperature": 0.6, "top_p": 0.6},
                            {"overlong": False, "dynamic": False}),
             "stare_paper": ("grpo_stare_setting", {"top_p": 1.0}, {"overlong": False, "dynamic": True})}
    for method, (grpo, sampling, algo) in pairs.items():
        assert same_but_algorithm(cfg[method], cfg[grpo]), method
        ours, theirs = ((cfg[x]["algorithm"]["estimator"], cfg[x]["algorithm"]["loss"]) for x in (method, grpo))
        assert theirs == ("grpo", "ppo") and ours != theirs, method
        assert all(cfg[method]["rollout"][k] == x for k, x in sampling.items()), method
        assert cfg[method]["algorithm"]["overlong"]["enable"] == algo["overlong"], method
        assert cfg[method]["algorithm"]["dynamic_sampling"] == algo["dynamic"], method
    assert l2.familywise_alpha == 0.05 and len(l2.comparisons) == 10
    assert [(c["a"], c["b"]) for c in l2.comparisons] == [
        ("hapo", "grpo"), ("eapo_entropic", "hapo"), ("eapo_entropic", "grpo"), ("stare", "grpo"), ("pepo", "grpo"),
        ("less", "grpo"), ("prime", "grpo"), ("eapo_entropic_paper", "grpo_eapo_setting"),
        ("pepo_paper", "grpo_pepo_setting"), ("stare_paper", "grpo_stare_setting")]


def test_decisive_experiment_smoke(tmp_path):
    """The decisive experiment reduced (two seeds, two RL steps, a tiny evaluation): every
    method of every seed runs from the one shared warm start, whose evaluation is each run's
    step 0 without evaluating again, and the report reads the runs into the pre-registered
    verdict table and the token-credit table."""
    out = tmp_path / "decisive"
    cmd = ["experiment", "decisive", "--config", str(REPO / "configs/experiments/decisive.yaml"), "--seeds", "1,2",
           "--output-dir", str(out), *_sets([s for s in SMOKE if not s.startswith("trainer.sample_every")]),
           *_sets(["trainer.sample_every=1", "trainer.sample_count=4"])]
    res = run_cli(cmd, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["failed"] == [] and last["skipped"] == []
    manifest = json.loads((out / "experiment.json").read_text())
    assert sorted(manifest["jobs"]) == sorted(["warm_start/seed_200"] + [f"{v}/seed_{s}" for v in manifest["suites"]["decisive"]
                                                                        for s in (1, 2)])
    warm = out / "warm_start" / "seed_200"
    after = json.loads((warm / "summary.json").read_text())["after"]
    for v in manifest["suites"]["decisive"]:
        for s in (1, 2):
            run = out / "runs" / v / f"seed_{s}"
            assert json.loads((run / "summary.json").read_text())["before"] == after
            assert "reused from" in (run / "run.log").read_text()
            assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == s
    report = Path(last["report"])
    md = report.read_text()
    assert "every run starts from one warm start (trained with seed 200)" in md
    assert "## Pre-registered comparisons" in md and "## Token credit" in md
    rows = json.loads((report.parent / "comparisons.json").read_text())
    assert [(r["a"], r["b"]) for r in rows] == [("hapo", "grpo"), ("hapo", "dapo"), ("hapo", "entro_adv"),
                                                ("hapo", "forking"), ("hapo_multiplicative", "grpo"),
                                                ("hapo_multiplicative", "hapo")]
    for r in rows:
        assert r["n"] == 2 and r["verdict"] in ("a > b", "a < b", "unresolved") and len(r["per_seed"]) == 2
        assert f"| {r['a']} | {r['b']} | 2 |" in md
    credit = json.loads((report.parent / "credit.json").read_text())
    assert set(credit) == {"grpo", "dapo", "hapo", "hapo_multiplicative", "entro_adv", "forking"}

    # the results file keeps each run's token-credit counts (issue 60): with the run directories gone, the
    # report rebuilt from the file alone has the same token-credit table, and every other table
    kept = tmp_path / "kept" / "decisive.json"
    res = cli_in_process(["report", str(out), "--results", str(kept)])
    assert res.returncode == 0, res.stderr[-2000:]
    full = Path(res.stdout.strip().splitlines()[-1]).read_text()  # it prints the results file, then the report
    shutil.rmtree(out / "runs")
    res = cli_in_process(["report", str(kept), "--output-dir", str(tmp_path / "from_file")])
    assert res.returncode == 0, res.stderr[-2000:]
    alone = (tmp_path / "from_file" / "experiment.md").read_text()
    assert [ln for ln in alone.splitlines() if ln.startswith("|")] == [ln for ln in full.splitlines() if ln.startswith("|")]
    assert "## Token credit" in alone and json.loads((tmp_path / "from_file" / "credit.json").read_text()) == credit
    assert credit["hapo"]["fork"]["tokens"] > 0
    assert credit["grpo"]["fork"]["shift_share"] != credit["grpo"]["fork"]["shift_share"]  # NaN: GRPO moves nothing
