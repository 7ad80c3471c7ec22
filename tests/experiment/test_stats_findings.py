"""Experiment statistics and finding verdicts on hand-built runs (no training)."""

import json
import math

import pytest

from hapo_openrlhf.experiment.findings import AGREE, DISAGREE, INCONCLUSIVE, evaluate_findings, verdict
from hapo_openrlhf.experiment.stats import RunStats, load_run, paired, spread


def _write_run(d, evals, entropies, k=4, steps=None):
    """metrics.jsonl as the embedded trainer writes it: step-0 eval, train steps, evals."""
    d.mkdir(parents=True)
    recs = []
    steps = steps or len(entropies)
    ev = dict(evals)
    recs.append({"step": 0, f"eval/avg@{k}": ev.pop(0), f"eval/pass@{k}": 0.9})
    for s, h in enumerate(entropies, start=1):
        r = {"step": s, "reward/mean": 0.5, "actor/entropy": h, "quadrant/PLR/token_frac": 0.4,
             "quadrant/PLR/entropy_mean": h / 2}
        if s in ev and s != steps:
            r.update({f"eval/avg@{k}": ev[s], f"eval/pass@{k}": 0.8})
        recs.append(r)
    recs.append({"step": steps, f"eval/avg@{k}": ev[steps], f"eval/pass@{k}": 0.7, "final": 1})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_run_stats_hand_computed(tmp_path):
    # 20 steps, evals at 0, 5, 10, 15, 20: first half = steps 5, 10; second half = 15, 20
    ent = [1.0] * 10 + [0.5] * 10
    _write_run(tmp_path / "r", {0: 0.4, 5: 0.5, 10: 0.6, 15: 0.65, 20: 0.75}, ent)
    r = load_run(tmp_path / "r", "hapo", 1)
    assert (r.k, r.steps, r.eval_steps) == (4, 20, [0, 5, 10, 15, 20])
    assert r.before == 0.4 and r.final == 0.75 and r.final_pass == 0.7
    assert r.gain == pytest.approx(0.35)
    assert r.early_gain == pytest.approx((0.5 + 0.6) / 2 - 0.4)
    assert r.late_gain == pytest.approx((0.65 + 0.75) / 2 - (0.5 + 0.6) / 2)
    assert (r.entropy_start, r.entropy_end, r.entropy_ratio) == (1.0, 0.5, 0.5)
    assert r.quadrant_mean("PLR", "entropy_mean", last=10) == pytest.approx(0.25)
    assert r.quadrant_mean("PLR", "token_frac") == pytest.approx(0.4)
    assert math.isnan(r.quadrant_mean("PHR", "token_frac"))  # never logged


def test_load_run_without_evaluation_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n")
    with pytest.raises(ValueError, match="no held-out evaluation"):
        load_run(tmp_path, "x", 1)


def test_spread_and_paired():
    s = spread([1.0, 2.0, 3.0, math.nan])
    assert (s["mean"], s["std"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 1.0, 3.0, 3)
    t = paired({1: 0.5, 2: 0.6, 3: 0.7, 4: 0.9}, {1: 0.4, 2: 0.4, 3: 0.5})  # seed 4 unpaired: ignored
    assert t["per_seed"] == pytest.approx([0.1, 0.2, 0.2])
    assert t["diff"] == pytest.approx(0.5 / 3)
    assert t["se"] == pytest.approx(math.sqrt(1 / 300) / math.sqrt(3))
    assert verdict(t) == AGREE and verdict(t, -1) == DISAGREE
    assert verdict({"diff": 0.05, "se": 0.04, "n": 3}) == INCONCLUSIVE  # within 2 s.e.
    assert verdict(paired({1: 1.0}, {1: 0.0})) == INCONCLUSIVE  # one seed: no spread


def _run(variant, seed, *, before=0.4, evals=(0.5, 0.5, 0.5, 0.5), ent=(1.0, 1.0)):
    steps = 20 * len(evals)
    es = list(range(0, steps + 1, 20))
    h0, h1 = ent
    return RunStats(variant, seed, 4, steps, es, [before, *evals], [0.9] * len(es), list(range(1, steps + 1)),
                    [h0] * 10 + [h1] * (steps - 10))


def test_findings_verdicts_follow_the_rule():
    seeds = (1, 2, 3)
    runs = []
    for s in seeds:
        j = 0.002 * s  # small seed-to-seed jitter so standard errors are not zero
        runs += [
            # PLR: entropy collapses, early gain then nothing
            _run("quadrant_plr", s, evals=(0.6 + j, 0.6, 0.6, 0.6 - j), ent=(1.0, 0.4 + j)),
            # PHR / NHR keep improving; NHR learns faster than NLR
            _run("quadrant_phr", s, evals=(0.45, 0.5 + j, 0.6, 0.7), ent=(1.0, 1.0 + j)),
            _run("quadrant_nhr", s, evals=(0.55 + j, 0.6, 0.65, 0.7), ent=(1.0, 1.1)),
            _run("quadrant_nlr", s, evals=(0.41 + j, 0.42, 0.42, 0.42), ent=(1.0, 1.0 - j)),
            # GRPO's entropy *rises* here: the HAPO-vs-GRPO finding must come out "disagree"
            _run("grpo", s, evals=(0.5, 0.5, 0.5, 0.5 + j), ent=(1.0, 1.5 + j)),
            _run("hapo", s, evals=(0.5, 0.5, 0.5, 0.6 + j), ent=(1.0, 1.0)),
            _run("hapo_alpha0.1", s, evals=(0.5, 0.5, 0.5, 0.61 + j), ent=(1.0, 1.0)),
            _run("hapo_alpha0.4", s, evals=(0.5, 0.5, 0.5, 0.45 - j), ent=(1.0, 1.0)),  # much worse
        ]
    f = {x["id"]: x for x in evaluate_findings(runs)}
    assert f["plr_entropy_collapse"]["verdict"] == AGREE
    assert f["plr_early_saturation"]["verdict"] == AGREE
    assert f["nhr_faster_than_nlr"]["verdict"] == AGREE
    assert f["phr_nhr_sustained"]["verdict"] == AGREE
    assert f["hapo_entropy_stable"]["verdict"] == DISAGREE  # GRPO's ratio is 1.5, not < 1
    alpha = {t["label"]: t["verdict"] for t in f["alpha_robust"]["tests"]}
    assert alpha == {"Avg@k(alpha 0.1) - Avg@k(alpha 0.2)": AGREE, "Avg@k(alpha 0.4) - Avg@k(alpha 0.2)": DISAGREE}
    assert f["alpha_robust"]["verdict"] == DISAGREE
    assert "hapo_beats_baselines" not in f  # needs DAPO, which is absent
    # ratio(HAPO) = 1.0, ratio(GRPO) = 1.5 + 0.002 * seed
    assert f["hapo_entropy_stable"]["tests"][0]["diff"] == pytest.approx(-0.504)
    assert "-0.504" in f["hapo_entropy_stable"]["evidence"]
    # every test carries its numbers
    for x in f.values():
        for t in x["tests"]:
            assert t["n"] == 3 and len(t["per_seed"]) == 3


def test_findings_need_their_variants():
    assert evaluate_findings([_run("hapo", 1)]) == []


@pytest.mark.parametrize("edit, why", [
    (lambda m: [], "holds a JSON list, not an object"),
    (lambda m: {**m, "suites": ["a"]}, "'suites' must map"),
    (lambda m: {**m, "seeds": ["1"]}, "'seeds' must be a list of integers"),
    (lambda m: {**m, "runs": {}}, "'runs' lacks"),
    (lambda m: {**m, "jobs": []}, "'jobs' an object"),
    (lambda m: {**m, "comparisons": [{"a": "hapo"}]}, "'comparisons' must be a list of"),
])
def test_a_damaged_experiment_manifest_is_named(tmp_path, edit, why):
    import json

    from hapo_openrlhf.experiment.report import read_manifest

    good = {"seeds": [1, 2], "suites": {"main": ["hapo", "grpo"]}, "suites_run": ["main"], "jobs": {},
            "runs": {f"{v}/seed_{s}": str(tmp_path / v / str(s)) for v in ("hapo", "grpo") for s in (1, 2)}}
    p = tmp_path / "experiment.json"
    p.write_text(json.dumps(good))
    assert read_manifest(p)["seeds"] == [1, 2]
    p.write_text(json.dumps(edit(good)))
    with pytest.raises(ValueError, match=why):
        read_manifest(p)


def test_scale_throughput_names_a_corrupt_metrics_line(tmp_path):
    from hapo_openrlhf.cluster.scale import _throughput

    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1, "time/step_s": 2.0, "response/tokens": 100}\n[1]\n'
                 '{"step": 2, "time/step_s": 3.0, "response/tokens": 300}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: corrupt line"):
        _throughput(m)


def test_preregistered_comparison_hand_computed():
    """verdicts.compare on hand-built finals: paired diff, s.e., the t interval, the 2 s.e.
    rule in both directions, unresolved, and the seeds a measured spread would need."""
    from hapo_openrlhf.experiment.verdicts import A_WINS, B_WINS, UNRESOLVED, compare, markdown, t975

    # a - b per seed: 0.02, 0.04, 0.03, 0.05 -> mean 0.035, sd 0.012910, se 0.006455
    finals = {"hapo": [0.52, 0.54, 0.53, 0.55], "grpo": [0.50, 0.50, 0.50, 0.50],
              "dapo": [0.51, 0.57, 0.49, 0.58]}  # hapo - dapo: 0.01, -0.03, 0.04, -0.03
    runs = [_run(v, s, evals=(0.45, f)) for v, fs in finals.items() for s, f in enumerate(fs, start=1)]
    rows = {(r["a"], r["b"]): r for r in compare(runs, [{"a": "hapo", "b": "grpo"}, {"a": "grpo", "b": "hapo"},
                                                         {"a": "hapo", "b": "dapo"}, {"a": "hapo", "b": "entro_adv"}])}
    assert set(rows) == {("hapo", "grpo"), ("grpo", "hapo"), ("hapo", "dapo")}  # no entro_adv runs: no row
    r = rows[("hapo", "grpo")]
    sd = math.sqrt(sum((x - 0.035) ** 2 for x in (0.02, 0.04, 0.03, 0.05)) / 3)
    assert r["n"] == 4 and r["diff"] == pytest.approx(0.035) and r["se"] == pytest.approx(sd / 2)
    assert r["ci95"] == pytest.approx([0.035 - 3.182 * sd / 2, 0.035 + 3.182 * sd / 2])
    assert r["verdict"] == A_WINS and rows[("grpo", "hapo")]["verdict"] == B_WINS
    assert r["seeds_needed"] == math.ceil((2 * sd / 0.035) ** 2) == 1
    d = rows[("hapo", "dapo")]  # mean -0.0025, sd 0.0377: unresolved; (2 sd / 0.0025)^2 seeds
    assert d["verdict"] == UNRESOLVED and d["seeds_needed"] == math.ceil((2 * d["sd"] / 0.0025) ** 2) > 100
    md = "\n".join(markdown(list(rows.values()), 4))
    assert "| hapo | grpo | 4 | 0.5350 | 0.5000 | +0.0350 |" in md and "unresolved" in md
    assert (t975(1), t975(7), t975(35), t975(500)) == (12.706, 2.365, 2.042, 1.96)
    one = compare([_run("hapo", 1, evals=(0.5,)), _run("grpo", 1, evals=(0.4,))], [{"a": "hapo", "b": "grpo"}])
    assert one[0]["verdict"] == UNRESOLVED and one[0]["seeds_needed"] is None  # one seed: no spread


def test_p_values_of_the_paired_t_statistic_against_tabled_quantiles():
    """Two-sided p of Student's t: at each tabled 0.975 quantile p is 0.05; t = 2 at 34 df (the first
    league's five primaries) is p 0.0535, the figure issue 60 quotes; t = 0 is p 1."""
    from hapo_openrlhf.experiment.verdicts import t975, t_two_sided_p

    for df in (1, 2, 5, 8, 17, 30, 120):
        assert t_two_sided_p(t975(df), df) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(2.0, 34) == pytest.approx(0.05354, abs=1e-4)
    assert t_two_sided_p(-2.0, 34) == t_two_sided_p(2.0, 34)
    assert t_two_sided_p(0.0, 5) == 1.0 and t_two_sided_p(float("inf"), 5) == 0.0
    # df 1 is Cauchy: P(|T| >= 1) = 1/2
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-9)


def test_holm_step_down_hand_computed():
    """p = 0.01, 0.04, 0.03, 0.005 at family-wise 0.05 (m = 4): sorted 0.005 <= 0.05/4 resolved,
    0.01 <= 0.05/3 resolved, 0.03 > 0.05/2 stops; 0.03 and 0.04 unresolved, whatever their own
    2-s.e. verdicts; directions from the signs. A row without p counts in m and is unresolved."""
    from hapo_openrlhf.experiment.verdicts import A_WINS, B_WINS, UNRESOLVED, holm, markdown

    def row(a, p, diff):
        return {"a": a, "b": "grpo", "n": 10, "p": p, "diff": diff, "se": 0.01, "ci95": [0, 0], "verdict": A_WINS,
                "seeds_needed": 1, "mean_a": 0.5, "mean_b": 0.5}

    rows = holm([row("x", 0.01, 0.03), row("y", 0.04, 0.02), row("z", 0.03, -0.02), row("w", 0.005, -0.05)], 0.05)
    assert [r["holm"] for r in rows] == [A_WINS, UNRESOLVED, UNRESOLVED, B_WINS]
    assert [r["holm_threshold"] for r in rows] == pytest.approx([0.05 / 3, 0.05 / 1, 0.05 / 2, 0.05 / 4])
    # the first league's two 2-s.e. "wins" (p 0.034, 0.039) among five primaries do not survive
    league = holm([row("hapo", 0.034, 0.02), row("eapo", 0.039, -0.02), row("stare", 0.30, 0.01),
                   row("pepo", 0.50, 0.0), row("less", 0.20, 0.01)], 0.05)
    assert all(r["holm"] == UNRESOLVED for r in league)
    nan = holm([row("x", float("nan"), 0.1), row("y", 0.01, 0.1)], 0.05)
    assert [r["holm"] for r in nan] == [UNRESOLVED, A_WINS] and nan[1]["holm_threshold"] == 0.025
    md = "\n".join(markdown(rows, 4, 0.05))
    assert "Holm (family-wise 0.05)" in md and "| x | grpo | 10 |" in md and "a > b (p <= 0.0167) |" in md
    # each unresolved row says why: its own p over its threshold, or the step-down stopped before it
    assert [r["holm_why"] for r in rows] == ["p <= 0.0167", "stopped at a smaller p", "p > 0.0250", "p <= 0.0125"]
    assert "unresolved (p > 0.0250) |" in md and "unresolved (stopped at a smaller p) |" in md
    assert nan[0]["holm_why"] == "no p-value"


def test_several_warm_starts_make_a_two_level_mean_hand_computed():
    """Seeds nested in two warm starts (10: seeds 1, 2; 20: seeds 3, 4): per-seed a - b 0.02, 0.04 |
    0.00, 0.02 -> warm-start means 0.03, 0.01 -> diff 0.02, se = sd(0.03, 0.01) / sqrt(2) = 0.01 on
    1 df (p 0.295, t interval +-12.706 se); seeds_needed counts warm starts. With one shared warm start
    the same finals give the per-seed paired rule (4 seeds), conditional on that model."""
    from hapo_openrlhf.experiment.verdicts import UNRESOLVED, compare, markdown, t_two_sided_p

    finals = {"a": [0.52, 0.54, 0.50, 0.52], "b": [0.50, 0.50, 0.50, 0.50]}
    runs = [_run(v, s, evals=(0.45, f)) for v, fs in finals.items() for s, f in enumerate(fs, start=1)]
    (r,) = compare(runs, [{"a": "a", "b": "b"}], clusters={1: 10, 2: 10, 3: 20, 4: 20})
    assert r["unit"] == "warm start" and r["n"] == 2 and r["seeds"] == 4
    assert r["diff"] == pytest.approx(0.02) and r["se"] == pytest.approx(0.01)
    assert r["per_warm_start"] == pytest.approx({"10": 0.03, "20": 0.01})
    assert r["p"] == pytest.approx(t_two_sided_p(2.0, 1)) and r["ci95"] == pytest.approx([0.02 - 0.12706, 0.02 + 0.12706])
    assert r["verdict"] == UNRESOLVED and r["seeds_needed"] == math.ceil((2 * 0.01 * math.sqrt(2) / 0.02) ** 2)
    assert "| a | b | 2 warm starts x 4 seeds |" in "\n".join(markdown([r], 4)) and " warm starts |" in markdown([r], 4)[-1]
    assert markdown([{**r, "seeds_needed": 1}], 4)[-1].endswith("| 1 warm start |")
    (one,) = compare(runs, [{"a": "a", "b": "b"}], clusters={s: 99 for s in (1, 2, 3, 4)})
    assert one["unit"] == "seed" and one["n"] == 4 and one["diff"] == pytest.approx(0.02)
    (own,) = compare(runs, [{"a": "a", "b": "b"}], clusters={s: s for s in (1, 2, 3, 4)})  # a warm start per seed
    assert own["unit"] == "seed" and own["se"] == pytest.approx(one["se"])


def test_warm_starts_nest_the_seeds_and_are_checked(tmp_path):
    import yaml

    from hapo_openrlhf.experiment import load_experiment

    base = str((__import__("pathlib").Path(__file__).parents[2] / "configs" / "cpu_tiny.yaml").resolve())

    def exp(**extra):
        p = tmp_path / "e.yaml"
        p.write_text(yaml.safe_dump({"run_config": base, "variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]},
                                     **extra}))
        return load_experiment(p, output_dir=str(tmp_path / "o"))

    e = exp(warm_starts={100: [1, 2], 200: [3]})
    assert e.seeds == (1, 2, 3) and e.clusters() == {1: 100, 2: 100, 3: 200}
    assert [j.seed for j in e.warm_jobs()] == [100, 200]
    assert e.runs[("a", 3)].config["model"]["path"].endswith("warm_start/seed_200/final_model")
    assert e.manifest()["warm_start_of_seed"] == {"1": 100, "2": 100, "3": 200}
    assert exp(warm_starts={100: [1, 2], 200: [3]}, seeds=[3, 1, 2]).seeds == (3, 1, 2)
    for bad, named in (({"warm_starts": {100: [1, 2]}}, "two or more warm-start seeds"),
                       ({"warm_starts": {100: [1], 200: [1]}}, "nested in two warm starts"),
                       ({"warm_starts": {100: [1], 200: [100]}}, "both a warm start's and an RL seed"),
                       ({"warm_starts": {100: [1], 200: [2]}, "warm_start_seed": 7}, "exclude each other"),
                       ({"warm_starts": {100: [1], 200: [2]}, "seeds": [1, 2, 3]}, "not the experiment's seeds"),
                       ({"warm_starts": {100: [], 200: [2]}}, "non-empty list")):
        with pytest.raises(ValueError, match=named):
            exp(**bad)


def test_comparisons_in_the_experiment_file_are_checked(tmp_path):
    import yaml

    from hapo_openrlhf.experiment import load_experiment

    base = str((__import__("pathlib").Path(__file__).parents[2] / "configs" / "cpu_tiny.yaml").resolve())

    def exp(comparisons):
        p = tmp_path / "e.yaml"
        p.write_text(yaml.safe_dump({"run_config": base, "variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]},
                                     "comparisons": comparisons}))
        return load_experiment(p, output_dir=str(tmp_path / "o"))

    assert exp([{"a": "a", "b": "b"}]).manifest()["comparisons"] == [{"a": "a", "b": "b"}]
    with pytest.raises(ValueError, match="unknown or identical variant"):
        exp([{"a": "a", "b": "c"}])
    with pytest.raises(ValueError, match="must be a mapping"):
        exp([{"a": "a", "b": "b", "metric": "x"}])
    assert exp([{"a": "a", "b": "b"}]).familywise_alpha == 0.05  # the default
    for bad in (0, 1, 1.5, "0.05", True, -0.1):
        p = tmp_path / "e.yaml"
        p.write_text(yaml.safe_dump({"run_config": base, "variants": {"a": {}, "b": {}}, "suites": {"s": ["a", "b"]},
                                     "comparisons": [{"a": "a", "b": "b"}], "familywise_alpha": bad}))
        with pytest.raises(ValueError, match="familywise_alpha must be a number in \\(0, 1\\)"):
            load_experiment(p, output_dir=str(tmp_path / "o"))


def test_token_classes_and_credit_shares_hand_computed(tmp_path):
    """credit.token_classes on a chain response (a written step, a skipped intermediate, the
    boxed answer) and credit_by_class on hand-made advantages; a damaged sample line is named."""
    from hapo_openrlhf.experiment.credit import credit_by_class, run_samples, token_classes

    text = "6-8=-2. -2+9-2=7. \\boxed{7}"
    got = "".join({"fork": "F", "result": "R", "routine": "."}[c] for c in token_classes(list(text)))
    assert got == "F..FRR......F.FR.........R."
    # one row of 4 tokens: fork, routine, routine, fork; A = 1 everywhere, A^h doubles the forks
    row = {"tokens": ["1", "+", "2", "="], "advantage": [2.0, 1.0, 1.0, 3.0], "base_advantage": [1.0] * 4}
    t = credit_by_class([row])
    assert t["fork"]["token_share"] == 0.5 and t["fork"]["shift_share"] == 1.0 and t["routine"]["shift_share"] == 0.0
    assert t["fork"]["mean_scale"] == 2.5 and t["routine"]["mean_scale"] == 1.0
    assert math.isnan(credit_by_class([{**row, "advantage": [1.0] * 4}])["fork"]["shift_share"])  # GRPO: no shift
    # a run's counts are additive (issue 60: the results file keeps them per run): two runs' counts pooled
    # equal the table of their rows pooled; the report's section from counts, or the line saying there are none
    from hapo_openrlhf.experiment.credit import credit_counts, credit_from_counts
    from hapo_openrlhf.experiment.report import _credit_section
    from hapo_openrlhf.experiment.stats import RunStats

    other = {"tokens": list("12=3"), "advantage": [-0.5, -1.0, -3.0, -1.0], "base_advantage": [-1.0] * 4}
    assert credit_counts([row])["fork"] == {"tokens": 2, "shift": 3.0, "scale_sum": 5.0, "scale_n": 2}
    assert credit_from_counts([credit_counts([row]), credit_counts([other])]) == credit_by_class([row, other])
    pooled = credit_by_class([row, other])
    assert pooled["fork"]["shift_share"] == pytest.approx((1 + 2 + 0.5) / (1 + 2 + 0.5 + 2))
    runs = [RunStats("h", s, 4, 2, [0, 2], [0.5, 0.6], [0.7, 0.8], [1, 2], [1.0, 0.9], credit=credit_counts([r]))
            for s, r in ((1, row), (2, other))]
    section = _credit_section(runs, ["h"], tmp_path, "r.json")
    assert section[0] == "## Token credit: where the advantage moved" and "| h | 8 | " in "\n".join(section)
    assert json.loads((tmp_path / "credit.json").read_text())["h"]["fork"]["mean_scale"] == pytest.approx(5.5 / 3)
    none = [RunStats("h", 1, 4, 2, [0, 2], [0.5, 0.6], [0.7, 0.8], [1, 2], [1.0, 0.9])]
    assert "keeps no run's token-credit counts" in _credit_section(none, ["h"], tmp_path, "r.json")[0]
    assert _credit_section(none, ["h"], tmp_path, None) == []  # run directories without samples: no section
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step_00000001.jsonl").write_text(json.dumps(row) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"step_00000001.jsonl:2: not a JSON token sample"):
        run_samples(tmp_path)
