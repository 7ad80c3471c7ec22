import pytest

from hapo_openrlhf.data.loader import load_problems
from hapo_openrlhf.rewards import MathVerifier, extract_answer, last_boxed, normalize, score


@pytest.mark.parametrize(
    "text,expected",
    [
        ("the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("nested \\boxed{a^{b^{c}}} ok", "a^{b^{c}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("truncated \\boxed{12", None),
        ("no answer here", None),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_think_block_is_skipped():
    assert extract_answer("<think>maybe \\boxed{3}</think> so \\boxed{4}") == "4"
    assert extract_answer("<think>only \\boxed{3}</think> no final box") is None


@pytest.mark.parametrize(
    "a,b",
    [("\\dfrac{1}{2}", "\\frac{1}{2}"), ("1,000", "1000"), ("x = 5", "5"), ("3.50", "3.5"), ("\\text{(A)}", "(A)"),
     ("90^\\circ", "90"), ("+7", "7"), ("\\$10", "10")],
)
def test_normalize(a, b):
    assert normalize(a) == normalize(b)


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("\\boxed{142}", 142.0, 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{7}", 142.0, 0.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{3}", ["2", "3"], 1.0),
        ("no box", "1", 0.0),
        ("", "1", 0.0),
        ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ],
)
def test_score(response, answer, expected):
    assert score(response, answer) == expected


def test_wrong_value_and_counts():
    v = MathVerifier(wrong_value=-1.0)
    assert v.score("\\boxed{2}", "3") == -1.0
    assert v.score("nothing", "3") == -1.0
    assert v.score("\\boxed{3}", "3") == 1.0
    assert (v.stats.total, v.stats.correct, v.stats.no_answer, v.stats.string_match) == (3, 1, 1, 1)
    assert v.stats.metrics()["reward/no_answer_frac"] == pytest.approx(1 / 3)
    v.close()


def test_timeout_is_counted_scored_zero_and_recovers():
    v = MathVerifier(timeout_s=0.001)
    assert v.score("\\boxed{x^2+2x+1}", "(x+1)^2") == 0.0
    assert v.stats.timeouts == 1
    v.timeout_s = 30.0  # the killed worker is replaced on the next call
    assert v.score("\\boxed{x^2+2x+1}", "(x+1)^2") == 1.0
    v.close()


def test_warm_starts_the_worker_without_counting_an_outcome():
    """``warm`` (vs_trl.py calls it before its timed steps): the worker is up after it, nothing is
    counted, and the next symbolic sample is graded by that same worker, quickly."""
    import time

    v = MathVerifier()
    try:
        v.warm()
        proc = v._proc
        assert proc is not None and proc.poll() is None
        assert (v.stats.total, v.stats.correct, v.stats.symbolic_match, v.stats.errors) == (0, 0, 0, 0)
        t0 = time.perf_counter()
        assert v.score("\\boxed{x^2+2x+1}", "(x+1)^2") == 1.0
        first = time.perf_counter() - t0
        assert v._proc is proc and v.stats.symbolic_match == 1
        print(f"first symbolic sample after warm: {first * 1e3:.0f} ms")
    finally:
        v.close()
    off = MathVerifier(symbolic=False)
    off.warm()  # symbolic matching off: nothing to start
    assert off._proc is None
    slow = MathVerifier(timeout_s=0.0)  # its first answer times out: logged, not counted
    try:
        slow.warm()
        assert (slow.stats.total, slow.stats.timeouts, slow.stats.errors) == (0, 0, 0)
    finally:
        slow.close()


def test_symbolic_works_from_a_thread():
    """math-verify's own signal-based timeout fails off the main thread; ours does not."""
    import threading

    out = []
    v = MathVerifier()
    t = threading.Thread(target=lambda: out.append(v.score("\\boxed{\\frac{2}{4}x}", "x/2")))
    t.start()
    t.join(60)
    v.close()
    assert out == [1.0]


def test_concurrent_threads_grade_like_one_thread():
    """OpenRLHF's rollout engine grades samples from several threads at once: one shared
    verifier (one math-verify worker) must give each caller its own answer."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [("\\boxed{\\frac{2}{4}x}", "x/2", 1.0), ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
             ("\\boxed{\\sqrt{2}/2}", "1/\\sqrt{2}", 1.0), ("\\boxed{x+2}", "x+1", 0.0)] * 4
    v = MathVerifier()
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda c: v.score(c[0], c[1]), cases))
    finally:
        v.close()
    assert got == [c[2] for c in cases]
    assert v.stats.total == len(cases) and v.stats.errors == 0


def test_empty_reference_is_an_error():
    with pytest.raises(ValueError, match="reference answer is empty"):
        MathVerifier().score("\\boxed{1}", "")


@pytest.mark.parametrize("bench", ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"])
def test_gold_answers_grade_correct_against_themselves(bench):
    problems, _ = load_problems(bench)
    v = MathVerifier(timeout_s=10)
    wrong = [p.answer[0] for p in problems if v.score(f"so \\boxed{{{p.answer[0]}}}", p.answer) != 1.0]
    v.close()
    assert not wrong, f"{bench}: {len(wrong)} gold answers not graded correct, e.g. {wrong[:3]}"


def test_worker_that_cannot_start_degrades_to_string_matching(monkeypatch):
    v = MathVerifier()

    def broken():
        raise RuntimeError("no interpreter")

    monkeypatch.setattr(v, "_start", broken)
    assert v.score("\\boxed{x^2+2x+1}", "(x+1)^2") == 0.0  # needs symbolic: counted, not raised
    assert v.stats.errors == 1 and v.symbolic is False
    assert v.score("\\boxed{3}", "3") == 1.0
