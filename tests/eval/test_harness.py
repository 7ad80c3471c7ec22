import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hapo_openrlhf.data.loader import load_problems
from hapo_openrlhf.eval.benchmarks import BENCHMARKS, parse_benchmarks, resolve_template
from hapo_openrlhf.eval.harness import markdown_table, summarize
from hapo_openrlhf.rewards import MathVerifier
from hapo_openrlhf.rewards.extract import as_number, normalize

from ..conftest import REPO, cli_in_process, run_cli


def reformat(ans: str) -> str:
    """The same answer written differently: 142 -> 142.0, \\frac -> \\dfrac, spaces after commas, $...$."""
    if re.fullmatch(r"-?\d+", ans):
        return ans + ".0"
    s = ans.replace("\\frac", "\\dfrac")
    s = re.sub(r",(?=\S)", ", ", s)
    return f"$ {s} $"


@pytest.mark.parametrize("bench", sorted(BENCHMARKS))
def test_gold_answers_grade_correct_reformatted_and_reject_wrong(bench):
    problems, _ = load_problems(bench)
    v = MathVerifier(timeout_s=20)
    not_ok = [p.answer[0] for p in problems if v.score(f"\\boxed{{{reformat(p.answer[0])}}}", p.answer) != 1.0]
    numeric = [p for p in problems if as_number(normalize(p.answer[0])) is not None]
    accepted_wrong = [p.answer[0] for p in numeric
                      if v.score(f"\\boxed{{{as_number(normalize(p.answer[0])) + 1}}}", p.answer[:1]) != 0.0]
    others = [p for p in problems if p not in numeric][:60]
    accepted_other = [p.answer[0] for p in others
                      if v.score(f"\\boxed{{{p.answer[0].strip('$ ')}+1}}", p.answer[:1]) != 0.0]
    v.close()
    assert not not_ok, f"{bench}: {len(not_ok)} reformatted gold answers rejected, e.g. {not_ok[:3]}"
    assert not accepted_wrong, f"{bench}: wrong numeric answers accepted: {accepted_wrong[:3]}"
    assert len(accepted_other) <= 0.05 * max(len(others), 1), f"{bench}: {accepted_other[:5]}"


def test_benchmark_defaults_and_errors():
    assert {b.name: b.k for b in parse_benchmarks("all")} == {
        "aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}
    with pytest.raises(ValueError, match="unknown benchmark 'aime23'"):
        parse_benchmarks("aime24,aime23")


def test_template_resolution(tmp_path):
    assert resolve_template("/x/DeepScaleR-1.5B-Preview") == "deepscaler"
    assert resolve_template("/x/Qwen2.5-Math-7B") == "qwen25_math"
    (tmp_path / "hapo.json").write_text('{"template": "tiny"}')
    assert resolve_template(str(tmp_path)) == "tiny"
    assert resolve_template(str(tmp_path), "plain") == "plain"
    with pytest.raises(ValueError, match="cannot infer the prompt template"):
        resolve_template("/x/some-model")


def test_summary_and_table_hand_computed():
    recs = [{"scores": [1.0, 0.0, 0.0, 0.0], "lengths": [10, 20, 30, 40]},
            {"scores": [1.0, 1.0, 0.0, 0.0], "lengths": [5, 5, 5, 5]}]
    s = summarize("x", recs, 4)
    assert s["avg@4"] == pytest.approx(0.375) and s["pass@4"] == 1.0
    assert s["pass@1"] == pytest.approx(0.375) and s["mean_response_tokens"] == pytest.approx(15.0)
    assert "| x | 2 | 4 | 0.3750 | 1.0000 | 15.0 |" in markdown_table("m", [s])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from hapo_openrlhf.config import ModelConfig
    from hapo_openrlhf.local.model import build_model, build_tokenizer, save_hf

    d = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    save_hf(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64), tok, 0), tok, d)
    (d / "hapo.json").write_text('{"template": "tiny"}')
    return d


ARGS = ["--benchmarks", "aime24,math500", "--limit", "6", "--k", "2", "--max-new-tokens", "12",
        "--batch-prompts", "1", "--engine", "hf"]


@pytest.mark.slow
def test_cpu_eval_writes_tables_and_resumes_after_kill(tiny_model, tmp_path):
    full = tmp_path / "full"
    res = run_cli(["eval", "--model", str(tiny_model), "--output-dir", str(full), *ARGS])
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((full / "results.json").read_text())
    assert [r["benchmark"] for r in report["results"]] == ["aime24", "math500"]
    assert all(r["problems"] == 6 and r["k"] == 2 for r in report["results"])
    assert "| aime24 | 6 | 2 |" in (full / "results.md").read_text()

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "hapo_openrlhf", "eval", "--model", str(tiny_model), "--output-dir", str(killed), *ARGS]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        samples = list(killed.glob("aime24-*.samples.jsonl"))
        if samples and len(samples[0].read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "results.json").exists(), "killed too late"
    res = run_cli(["eval", "--model", str(tiny_model), "--output-dir", str(killed), *ARGS])
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("aime24", "math500"):
        (a,), (b,) = killed.glob(f"{name}-*.samples.jsonl"), full.glob(f"{name}-*.samples.jsonl")
        assert a.name == b.name and a.read_text() == b.read_text()
    again = json.loads((killed / "results.json").read_text())
    assert again["results"] == report["results"]
    # other sampling settings in the same directory are refused, nothing overwritten
    res = run_cli(["eval", "--model", str(tiny_model), "--output-dir", str(killed), *ARGS, "--temperature", "1.0"])
    assert res.returncode == 2 and "other settings" in res.stderr


def test_eval_bad_input_is_one_clear_line(tmp_path):
    res = run_cli(["eval", "--model", str(tmp_path / "missing"), "--template", "tiny", "--benchmarks", "aime24"])
    assert res.returncode == 2 and "model directory" in res.stderr and "not found" in res.stderr
    # the parser's answers, in this process (cli.main; issue 57)
    res = cli_in_process(["eval", "--model", str(tmp_path), "--template", "tiny", "--k", "0"])
    assert res.returncode == 2 and "--k and --limit must be >= 1" in res.stderr
    res = cli_in_process(["eval", "--model", str(tmp_path), "--engine", "hf", "--vllm-enforce-eager"])
    assert res.returncode == 2 and "--vllm-enforce-eager is a vLLM setting; --engine hf does not take it" in res.stderr


@pytest.mark.slow
def test_vllm_engine_evaluates_on_vllm_cpu(tmp_path):
    """``--engine vllm`` through real vLLM (vllm-cpu; head_dim 64 for its CPU attention), in
    the Python that has it: results for every benchmark, k samples per problem, token counts
    within --max-new-tokens, the engine recorded (eager: ``--vllm-enforce-eager`` reaches vLLM)."""
    from hapo_openrlhf.config import ModelConfig
    from hapo_openrlhf.local.model import build_model, build_tokenizer, save_hf
    from tests.conftest import VLLM_CPU_ENV, needs_vllm

    python = needs_vllm()
    model = tmp_path / "model"
    tok = build_tokenizer()
    save_hf(build_model(ModelConfig(hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                    max_position_embeddings=2048), tok, 0), tok, model)
    (model / "hapo.json").write_text('{"template": "tiny"}')
    out = tmp_path / "eval"
    cmd = [python, "-m", "hapo_openrlhf", "eval", "--model", str(model), "--output-dir", str(out), "--engine", "vllm",
           "--benchmarks", "aime24,math500", "--limit", "4", "--k", "2", "--max-new-tokens", "12", "--batch-prompts", "2",
           "--vllm-enforce-eager"]  # no torch.compile at start: ~40% of this test's CPU
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **VLLM_CPU_ENV})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert report["engine"] == "vllm"
    assert [(r["benchmark"], r["problems"], r["k"]) for r in report["results"]] == [("aime24", 4, 2), ("math500", 4, 2)]
    for name in ("aime24", "math500"):
        (path,) = out.glob(f"{name}-*.samples.jsonl")
        rows = [json.loads(ln) for ln in path.read_text().splitlines()]
        assert [r["index"] for r in rows] == [0, 1, 2, 3]
        assert all(len(r["responses"]) == len(r["lengths"]) == len(r["scores"]) == 2 for r in rows)
        assert all(1 <= n <= 12 for r in rows for n in r["lengths"])


class _AnswerEngine:
    """A deterministic engine: answers every prompt with a fixed boxed number, so a
    benchmark's score is exactly the share of its rows whose answer is that number."""

    name = "fixed"

    def __init__(self, answer="7"):
        self.answer, self.calls = answer, 0

    def generate(self, prompts, spec):
        self.calls += len(prompts)
        return [[(f"so \\boxed{{{self.answer}}}", 3)] * spec.n for _ in prompts]


def _bench_file(path, answers):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"q{i}", "answer": a}) + "\n"
                            for i, a in enumerate(answers)))
    return path


def test_same_basename_and_edited_benchmarks_each_get_their_own_score(tmp_path):
    from hapo_openrlhf.eval.benchmarks import parse_benchmarks
    from hapo_openrlhf.eval.harness import EvalSettings, run_eval

    a = _bench_file(tmp_path / "a" / "bench.jsonl", ["7", "7", "1", "1"])  # 0.5 for an engine answering 7
    b = _bench_file(tmp_path / "b" / "bench.jsonl", ["7", "1", "1", "1"])  # 0.25
    s = EvalSettings(template="plain", k=2, max_new_tokens=8, batch_prompts=2)
    out = tmp_path / "out"
    rep = run_eval(_AnswerEngine(), "m", parse_benchmarks(f"{a},{b}"), s, out)
    assert [r["avg@2"] for r in rep["results"]] == [0.5, 0.25]
    assert len(list(out.glob("bench-*.samples.jsonl"))) == 2 and len({r["benchmark"] for r in rep["results"]}) == 2
    # the benchmark is edited and re-run into the same directory: its new rows are graded
    _bench_file(a, ["7", "7", "7", "1"])
    eng = _AnswerEngine()
    rep = run_eval(eng, "m", parse_benchmarks(str(a)), s, out)
    assert rep["results"][0]["avg@2"] == 0.75 and eng.calls == 4  # regenerated, not the stale samples
    # unchanged: every problem reused
    eng = _AnswerEngine()
    assert run_eval(eng, "m", parse_benchmarks(str(a)), s, out)["results"][0]["avg@2"] == 0.75 and eng.calls == 0


def test_a_corrupt_sample_line_is_reported_and_regenerated(tmp_path, caplog):
    from hapo_openrlhf.eval.benchmarks import parse_benchmarks
    from hapo_openrlhf.eval.harness import EvalSettings, run_eval

    bench = _bench_file(tmp_path / "bench.jsonl", ["7", "1", "7", "1", "7", "7"])
    s = EvalSettings(template="plain", k=1, max_new_tokens=8, batch_prompts=2)
    out = tmp_path / "out"
    first = run_eval(_AnswerEngine(), "m", parse_benchmarks(str(bench)), s, out)["results"][0]
    (samples,) = out.glob("bench-*.samples.jsonl")
    lines = samples.read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]  # torn in the middle of the file
    samples.write_text("\n".join(lines) + "\n")
    eng = _AnswerEngine()
    again = run_eval(eng, "m", parse_benchmarks(str(bench)), s, out)["results"][0]
    assert eng.calls == 1 and again == first  # only problem 1 regenerated; the records after it kept
    assert f"{samples}:2" in caplog.text


@pytest.mark.parametrize("damage", ["no_scores", "scores_string", "too_few_scores", "too_many_scores", "bool_index",
                                    "list_record", "negative_length"])
def test_a_damaged_sample_record_is_reported_and_regenerated(tmp_path, caplog, damage):
    """Each damaged record is named file:line and its problem generated again; the scores
    come out as an undamaged run's (six scores at k=2 would otherwise change Avg@2)."""
    from hapo_openrlhf.eval.benchmarks import parse_benchmarks
    from hapo_openrlhf.eval.harness import EvalSettings, run_eval

    bench = _bench_file(tmp_path / "bench.jsonl", ["7", "1", "7", "1"])
    s = EvalSettings(template="plain", k=2, max_new_tokens=8, batch_prompts=2)
    out = tmp_path / "out"
    first = run_eval(_AnswerEngine(), "m", parse_benchmarks(str(bench)), s, out)["results"][0]
    (samples,) = out.glob("bench-*.samples.jsonl")
    recs = [json.loads(ln) for ln in samples.read_text().splitlines()]
    r = recs[1]
    {"no_scores": lambda: r.pop("scores"), "scores_string": lambda: r.update(scores="abc"),
     "too_few_scores": lambda: r.update(scores=[1.0]), "too_many_scores": lambda: r.update(scores=[1.0] * 6),
     "bool_index": lambda: r.update(index=True), "negative_length": lambda: r.update(lengths=[-1, 3]),
     "list_record": lambda: recs.__setitem__(1, [r])}[damage]()
    samples.write_text("".join(json.dumps(x) + "\n" for x in recs))
    eng = _AnswerEngine()
    again = run_eval(eng, "m", parse_benchmarks(str(bench)), s, out)["results"][0]
    assert eng.calls == 1 and again == first
    assert f"{samples}:2" in caplog.text


def test_a_corrupt_settings_file_is_named(tmp_path):
    from hapo_openrlhf.eval.benchmarks import parse_benchmarks
    from hapo_openrlhf.eval.harness import EvalSettings, run_eval

    bench = _bench_file(tmp_path / "bench.jsonl", ["7"])
    out = tmp_path / "out"
    out.mkdir()
    for bad in ("{torn", "[]"):
        (out / "settings.json").write_text(bad)
        with pytest.raises(ValueError, match="settings.json is unreadable or not a JSON object"):
            run_eval(_AnswerEngine(), "m", parse_benchmarks(str(bench)), EvalSettings(template="plain", k=1), out)


def test_samples_do_not_depend_on_the_batch_a_problem_lands_in(tiny_model, tmp_path):
    """Per-problem seeds: after a torn write dropped problems out of the middle of a batch,
    the regenerated ones (now in a smaller batch) are byte-identical to an uninterrupted run's."""
    from hapo_openrlhf.eval.benchmarks import parse_benchmarks
    from hapo_openrlhf.eval.engines import HFEngine
    from hapo_openrlhf.eval.harness import EvalSettings, run_eval

    eng = HFEngine(str(tiny_model))
    s = EvalSettings(template="tiny", k=2, max_new_tokens=6, batch_prompts=3, limit=3, temperature=1.0)
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_eval(eng, "m", parse_benchmarks("aime24"), s, full)
    (a,) = full.glob("aime24-*.samples.jsonl")
    cut.mkdir()
    lines = a.read_text().splitlines()
    (cut / a.name).write_text(lines[0] + "\n")  # problems 1 and 2 lost (a full disk mid-append)
    (cut / "settings.json").write_text((full / "settings.json").read_text())
    run_eval(eng, "m", parse_benchmarks("aime24"), s, cut)
    assert (cut / a.name).read_text() == a.read_text()


def _limit_address_space(gib):
    def set_limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))
    return set_limit


def test_a_prompt_longer_than_the_model_is_refused_before_any_allocation(tiny_model, tmp_path):
    """A 1 MB benchmark prompt under an 8 GiB address-space limit: one named error (benchmark,
    problem, token count, the limit and what sets it) before anything is generated -- not a
    multi-GB attention buffer or a MemoryError -- and no samples written. Prompts longer
    than the tiny model's 256 positions but small (real AIME problems) still run."""
    bench = tmp_path / "huge.jsonl"
    bench.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n"
                     + json.dumps({"problem": "1+" * 500_000 + "1", "answer": "500001"}) + "\n")
    cmd = [sys.executable, "-m", "hapo_openrlhf", "eval", "--model", str(tiny_model), "--benchmarks", str(bench),
           "--k", "1", "--engine", "hf", "--output-dir", str(tmp_path / "out")]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         preexec_fn=_limit_address_space(8))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "MemoryError" not in res.stderr
    (err,) = [ln for ln in res.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert re.search(r"huge.jsonl'?: problem 1 .* is a 1000\d\d\d-token prompt, over the 23170 tokens this engine "
                     r"can take \(the address-space limit \(ulimit -v\) of 8.0 GiB", err), err
    assert not list((tmp_path / "out").glob("*.samples.jsonl"))
