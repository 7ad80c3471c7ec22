import json

import pytest

from hapo_openrlhf.data.loader import BUNDLED, load_problems
from hapo_openrlhf.data.synthetic import ArithmeticTask
from hapo_openrlhf.data.templates import apply_template
from tests.conftest import REPO


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_bundled_files_load_with_expected_counts():
    expected = {"aime24": 30, "aime25": 30, "amc23": 83, "math500": 500, "minerva": 272, "olympiadbench": 675,
                "aime_1983_2023": 975}
    for name, n in expected.items():
        problems, rep = load_problems(name)
        assert len(problems) == n == rep.kept, name
    assert set(expected) < set(BUNDLED)


def test_field_mapping_and_answer_types(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "Q1", "answer": "70"},
        {"problem": "Q2", "answer": 142.0},
        {"prompt": "Q3", "answer": ["$2$", "2.0"]},
        {"problem": "Q4", "solution": "so \\boxed{\\frac{1}{2}}."},
        {"problem": "Q5", "answer": 3},
    ])
    problems, rep = load_problems(p)
    assert [x.answer for x in problems] == [("70",), ("142",), ("$2$", "2.0"), ("\\frac{1}{2}",), ("3",)]
    assert rep.kept == 5


def test_rows_without_answer_are_dropped_and_counted(tmp_path, caplog):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"problem": "ok", "answer": "1"}, {"problem": "no answer"}, {"problem": "empty", "answer": ""},
        {"problem": "bad solution", "solution": "no box"}, {"answer": "no problem"},
    ])
    problems, rep = load_problems(p)
    assert len(problems) == 1
    assert (rep.dropped_no_answer, rep.dropped_no_problem) == (3, 1)
    assert "1/5 rows kept" in caplog.text


def test_malformed_row_is_an_error_naming_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, "{not json", "[1, 2]"])
    with pytest.raises(ValueError, match="bad.jsonl:2: malformed row"):
        load_problems(p)
    problems, rep = load_problems(p, on_bad_row="skip")
    assert len(problems) == 1 and rep.skipped_malformed == 2


def test_non_utf8_and_binary_lines_are_named_or_skipped(tmp_path):
    p = tmp_path / "bin.jsonl"
    p.write_bytes(b'{"problem": "a", "answer": "1"}\n\xff\xfe\x00garbage\n{"problem": "b\xe9", "answer": "2"}\n'
                  b'{"problem": "c", "answer": "3"}\n')
    with pytest.raises(ValueError, match="bin.jsonl:2: malformed row .*utf-8"):
        load_problems(str(p))
    problems, rep = load_problems(str(p), on_bad_row="skip")
    assert [x.problem for x in problems] == ["a", "c"] and rep.skipped_malformed == 2
    j = tmp_path / "bin.json"
    j.write_bytes(b'[{"problem": "a\xff", "answer": "1"}]')
    with pytest.raises(ValueError, match="bin.json: not a readable JSON file"):
        load_problems(str(j))


def test_problem_and_answer_fields_apply_to_the_eval_set_too(tmp_path):
    from hapo_openrlhf.config import load_config
    from hapo_openrlhf.data.datasets import make_datasets

    rows = [{"q": f"{i}+1", "a": str(i + 1)} for i in range(3)]
    ev = write_jsonl(tmp_path / "ev.jsonl", rows)
    cfg = load_config(REPO / "configs" / "cpu_tiny.yaml", [f"data.eval={ev}", "data.problem_field=q",
                                                            "data.answer_field=a"])
    _, _, evals = make_datasets(cfg)
    assert [(p.problem, p.answer) for p in evals] == [("0+1", ("1",)), ("1+1", ("2",)), ("2+1", ("3",))]


def test_empty_and_missing_datasets(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="yielded no usable problems"):
        load_problems(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="not found"):
        load_problems(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_problems(str(tmp_path / "x.csv"))


def test_json_and_parquet(tmp_path):
    rows = [{"problem": "A", "answer": "1"}, {"problem": "B", "answer": "2"}]
    (tmp_path / "d.json").write_text(json.dumps({"data": rows}))
    assert len(load_problems(str(tmp_path / "d.json"))[0]) == 2
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert [p.answer for p in load_problems(str(tmp_path / "d.parquet"))[0]] == [("1",), ("2",)]


def test_templates():
    assert apply_template("deepscaler", "1+1?").endswith(
        "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.<｜Assistant｜><think>\n")
    assert "\\boxed{}" in apply_template("qwen25_math", "x") and "<|im_start|>user\nx<|im_end|>" in apply_template("qwen25_math", "x")
    with pytest.raises(ValueError, match="unknown prompt template"):
        apply_template("llama", "x")


def test_synthetic_split_is_disjoint_and_solutions_are_correct():
    t = ArithmeticTask(n_terms=3, digits=1)
    train = {p.problem for p in t.problems(500, 0, heldout=False)}
    held = t.problems(50, 1, heldout=True)
    assert not train & {p.problem for p in held}
    from hapo_openrlhf.rewards import score

    for p in held:
        assert score(t.solution(p.problem), p.answer) == 1.0


def test_chain_task_teacher_skips_intermediates_with_near_misses():
    """The chain variant: 4-6 terms; the teacher writes each intermediate result or skips it
    (two operations in one step), exact when it never errs, near misses (+-1, +-2) on merged
    steps at skip_error; held-out problems stay disjoint."""
    import random
    import re

    from hapo_openrlhf.rewards import score

    t = ArithmeticTask(n_terms=6, digits=2, min_terms=4, skip_prob=0.5, skip_error=0.0)
    held = t.problems(200, 1, heldout=True)
    assert {len(re.findall(r"[+\-]", p.problem)) + 1 for p in held} == {4, 5, 6}
    assert not {p.problem for p in t.problems(500, 0, heldout=False)} & {p.problem for p in held}
    rng = random.Random(0)
    sols = [(p, t.solution(p.problem, rng)) for p in held]
    assert all(score(s, p.answer) == 1.0 for p, s in sols)  # skipping alone never errs
    n_ops = lambda step: len(re.findall(r"(?<=\d)[+\-]", step.split("=")[0]))  # noqa: E731 (not a sign)
    steps = [step for _, s in sols for step in s.split(". ") if "=" in step]
    merged, plain = [x for x in steps if n_ops(x) == 2], [x for x in steps if n_ops(x) == 1]
    assert len(merged) + len(plain) == len(steps)
    assert len(merged) > 100 and len(plain) > 100  # both branches of every fork are taught
    lengths = [len(s) for _, s in sols]
    assert 30 <= sum(lengths) / len(lengths) <= 80 and max(lengths) <= 96
    # a merged step errs at skip_error, a written-out one at slip_prob (0 here)
    t2 = ArithmeticTask(n_terms=6, digits=2, min_terms=4, skip_prob=1.0 - 1e-9, skip_error=1.0)
    p = held[0]
    assert score(t2.solution(p.problem, random.Random(1)), p.answer) == 0.0
    assert score(t2.solution(p.problem), p.answer) == 1.0  # without an rng: the exact chain
    with pytest.raises(ValueError, match="min_terms must be in"):
        ArithmeticTask(n_terms=3, min_terms=5)
    with pytest.raises(ValueError, match="skip_prob must be in"):
        ArithmeticTask(skip_prob=1.0)


def test_hugging_face_dataset_dir_and_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    repo = tmp_path / "repo"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", [{"question": "Q", "answer": 5}, {"question": "R"}])
    problems, rep = load_problems(f"hf:{repo}", split="train")
    assert [p.answer for p in problems] == [("5",)] and rep.dropped_no_answer == 1
    datasets.Dataset.from_list([{"problem": "P", "answer": "7"}]).save_to_disk(str(tmp_path / "saved"))
    assert load_problems(f"hf:{tmp_path / 'saved'}")[0][0].answer == ("7",)


def test_tiny_tokenizer_survives_autotokenizer_round_trip(tmp_path):
    """AutoTokenizer rebuilds a Qwen2 tokenizer for a qwen2 model dir; ours must split identically."""
    from transformers import AutoTokenizer

    from hapo_openrlhf.config import ModelConfig
    from hapo_openrlhf.local.model import build_model, build_tokenizer, save_hf

    tok = build_tokenizer()
    save_hf(build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32),
                        tok, 0), tok, tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["Q: 7-2+9\nA: ", "7-2=5. \\boxed{5}", "héllo ∑ x\n\n  y"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert auto(text, add_special_tokens=False).input_ids == ids
        assert auto.decode(ids) == tok.decode(ids) == text
    assert (auto.pad_token_id, auto.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_hapo_evals_bad_row_error_names_no_training_key(tmp_path):
    """A benchmark is scored on every problem: its bad row is named with file and line, and
    the advice is to fix it, not the training key data.on_bad_row that hapo eval cannot take."""
    from hapo_openrlhf.eval.benchmarks import Benchmark, load_benchmark

    bad = tmp_path / "bench.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{torn\n')
    with pytest.raises(ValueError) as e:
        load_benchmark(Benchmark(str(bad), 4))
    assert f"{bad}:2: malformed row" in str(e.value) and "on_bad_row" not in str(e.value)
    assert "hapo eval skips no row" in str(e.value)
    with pytest.raises(ValueError, match="set data.on_bad_row: skip"):  # training still offers its key
        load_problems(str(bad))
