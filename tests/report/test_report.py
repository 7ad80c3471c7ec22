import json
import re

import pytest

from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import LocalTrainer
from hapo_openrlhf.report.html import build_report
from hapo_openrlhf.report.token_credit import render_token_credit

from ..conftest import REPO, cli_in_process, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    runs = []
    for est in ("hapo", "grpo"):
        cfg = load_config(REPO / "configs/cpu_tiny.yaml", [
            "warmup.steps=20", "trainer.steps=3", "trainer.save_every=0", "trainer.sample_every=2",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "data.synthetic.eval_size=4",
            "eval.n_samples=2", "rollout.max_new_tokens=16", "eval.max_new_tokens=16", f"algorithm.estimator={est}",
            "algorithm.estimator_params={}", "algorithm.dynamic_sampling=false", "trainer.sample_count=4",
        ])
        d = tmp_path_factory.mktemp(est)
        LocalTrainer(cfg, d).fit()
        runs.append(d)
    return runs


def test_report_overlays_runs_into_pngs_and_html(two_runs, tmp_path):
    index = build_report(two_runs, tmp_path / "rep")
    pngs = sorted((tmp_path / "rep").glob("*.png"))
    assert {p.stem for p in pngs} >= {"reward", "entropy", "clip_frac", "quadrant_share", "quadrant_entropy",
                                      "quadrant_adv", "accuracy_vs_tokens"}
    assert all(p.read_bytes()[:8] == PNG and p.stat().st_size > 5000 for p in pngs)
    page = index.read_text()
    assert all(f'src="{p.name}"' in page for p in pngs)
    assert page.count("<tr>") == 3  # header + one row per run
    assert len(list((tmp_path / "rep" / "token_credit").glob("*.html"))) == 4  # first and last dump per run


def test_token_credit_page_has_every_token(two_runs, tmp_path):
    f = sorted((two_runs[0] / "samples").glob("*.jsonl"))[0]
    recs = [json.loads(l) for l in f.read_text().splitlines()]
    html = render_token_credit(f, tmp_path / "tc.html").read_text()
    # each token appears twice: coloured by entropy and by the HAPO multiplier
    assert html.count('class="t"') == 2 * sum(len(r["tokens"]) for r in recs)
    assert "H=" in html and "mult=" in html
    for r in recs:
        assert len(r["tokens"]) == len(r["entropy"]) == len(r["multiplier"]) == len(r["quadrant"])


def test_report_cli_and_missing_run(two_runs, tmp_path):
    res = run_cli(["report", str(two_runs[0]), "--output-dir", str(tmp_path / "r")])
    assert res.returncode == 0 and (tmp_path / "r" / "index.html").exists()
    res = run_cli(["report", str(tmp_path / "nope")])
    assert res.returncode == 2 and "a run directory?" in res.stderr


_GOOD = {"tokens": ["a", "b"], "entropy": [0.1, 0.2], "multiplier": [1.0, 1.2], "quadrant": ["PHR", ""],
         "advantage": [0.5, 0.6], "base_advantage": [0.5, 0.5], "reward": 1.0, "row": 0}


@pytest.mark.parametrize("damage, why", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"tokens": ["a"]}', "'entropy' must be a list of numbers"),
    (json.dumps({**_GOOD, "entropy": ["x", 0.2]}), "'entropy' must be a list of numbers"),
    (json.dumps({**_GOOD, "entropy": [0.1]}), "different lengths"),
    (json.dumps({**_GOOD, "reward": "high"}), "'reward' must be a number"),
    ("{torn", "Expecting property name"),
])
def test_a_damaged_samples_line_is_named_with_file_and_line(tmp_path, damage, why):
    from hapo_openrlhf.report.token_credit import read_samples, render_token_credit

    f = tmp_path / "step_1.jsonl"
    f.write_text(json.dumps(_GOOD) + "\n" + damage + "\n")
    with pytest.raises(ValueError, match=rf"step_1.jsonl:2: corrupt sample record \(.*{re.escape(why)}"):
        read_samples(f)
    f.write_text(json.dumps(_GOOD) + "\n")
    assert render_token_credit(f, tmp_path / "page.html").read_text().count('class="t"') == 4


@pytest.mark.parametrize("summary", ["[]", '{"before": 1, "after": {}}', "{torn"])
def test_a_damaged_summary_is_named(tmp_path, summary):
    from hapo_openrlhf.report.html import build_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (run / "summary.json").write_text(summary)
    with pytest.raises(ValueError, match="summary.json"):
        build_report([run], tmp_path / "report")


class _Tags:
    """Every element and attribute of an HTML page, as a browser's parser would see them."""

    def __init__(self, text: str):
        from html.parser import HTMLParser

        self.tags, self.attrs = [], []
        outer = self

        class P(HTMLParser):
            def handle_starttag(self, tag, attrs):
                outer.tags.append(tag)
                outer.attrs += attrs

        P().feed(text)


def test_a_hostile_run_name_renders_as_text_and_its_links_still_resolve(two_runs, tmp_path):
    """A run directory named like markup (issue 42): nothing of the name becomes an element or
    an attribute of index.html or of the token-credit pages; the escaped links still point at
    the pages that were written."""
    import shutil
    from urllib.parse import unquote

    evil = 'y"><img src=x onerror=alert(7)>'
    run = tmp_path / evil
    shutil.copytree(two_runs[0], run)
    index = build_report([run], tmp_path / "rep")
    page = index.read_text()
    tags = _Tags(page)
    pngs = sorted((tmp_path / "rep").glob("*.png"))
    assert tags.tags.count("img") == len(pngs) and "script" not in tags.tags
    assert {name for name, _ in tags.attrs} <= {"charset", "src", "href"}
    assert {v for n, v in tags.attrs if n == "src"} == {p.name for p in pngs}
    hrefs = [v for n, v in tags.attrs if n == "href"]
    assert len(hrefs) == 2 and all((tmp_path / "rep" / unquote(h)).is_file() for h in hrefs)
    assert evil not in page and "&lt;img src=x onerror=alert(7)&gt;" in page  # shown, as text
    for h in hrefs:
        credit = _Tags((tmp_path / "rep" / unquote(h)).read_text())
        assert "img" not in credit.tags and {n for n, _ in credit.attrs} <= {"charset", "class", "style", "title"}


def test_an_unknown_quadrant_label_is_named_with_file_and_line(two_runs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_runs[0], run)
    f = sorted((run / "samples").glob("step_*.jsonl"))[0]
    lines = f.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["quadrant"][0] = '"><script>x</script>'
    lines[1] = json.dumps(rec)
    f.write_text("\n".join(lines) + "\n")
    res = cli_in_process(["report", str(run), "--output-dir", str(tmp_path / "r")])
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{f}:2: corrupt sample record (unknown quadrant label(s)" in res.stderr


def test_each_competitors_metrics_get_their_own_figure(tmp_path, monkeypatch):
    """EAPO's weight range and kappa, PEPO's largest c, LESS's clusters, PRIME's PRM and rewards and its
    filter: plotted for the runs
    that log them (hand-written metrics), and no figure for a method no run used. A method's figure is a
    grid of up to three columns, one panel per metric, the grid's spare panels blank (STARE's four
    metrics: two rows of three, two blank)."""
    from hapo_openrlhf.report import plots

    grids = {}
    save_png = plots.save_png

    def recording(fig, out_dir, name, written, **kw):
        grids[name] = [ax.axison for ax in fig.axes]
        return save_png(fig, out_dir, name, written, **kw)

    monkeypatch.setattr(plots, "save_png", recording)
    run = tmp_path / "eapo_run"
    run.mkdir()
    recs = [{"step": s, "reward/mean": 0.5, "actor/entropy": 1.0, "eapo/kappa": 1.386 * (1 - s / 10),
             "eapo/weight_min": 0.5, "eapo/weight_max": 2.0, "less/clusters": float(s), "stare/gate_on": 1.0,
             "stare/reweight_w": 1.1, "stare/positive_reweight_frac": 0.1, "stare/negative_reweight_frac": 0.2,
             "paec/masked_entropy": 0.9,
             "prm/loss": 0.69 - 0.01 * s, "prm/auc_heldout": 0.5 + 0.02 * s, "prime/process_share": 0.4,
             "filter/rejected_frac": 0.7, **({"paec/h_low": 0.7} if s > 4 else {})} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written = {p.name for p in plots.plot_runs([run], tmp_path / "rep")}
    assert {"method_eapo.png", "method_less.png", "method_stare.png", "method_paec.png", "method_prime.png",
            "method_prm.png", "method_filter.png"} <= written
    assert "method_pepo.png" not in written
    assert (tmp_path / "rep" / "method_eapo.png").read_bytes()[:8] == PNG
    assert grids["method_stare"] == [True] * 4 + [False] * 2  # 4 metrics: 2 x 3, the last two blank
    assert grids["method_eapo"] == [True] * 3 and grids["method_paec"] == [True] * 2 and grids["method_less"] == [True]
