"""scripts/coverage_diff.py's comparison (issue 57: a faster suite covers no less): lines are matched
across the two commits by content, so a commit that inserts lines does not read as a loss below them,
and a covered line the second commit edited or removed is listed apart, hand-checked."""

import importlib.util

from tests.conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location("coverage_diff", REPO / "scripts" / "coverage_diff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lines_map_by_content_across_an_insertion_and_an_edit():
    cd = _script()
    old = "a\nb\nc\nd\ne\n"
    new = "a\nNEW1\nNEW2\nb\nc\nD-edited\ne\n"
    # a stays 1; b, c move down two; d was edited (no counterpart); e moves down two
    assert cd.map_lines(old, new) == {1: 1, 2: 4, 3: 5, 5: 7}
    assert cd.map_lines(old, "") == {} and cd.map_lines("", new) == {}
    assert cd.map_lines(old, old) == {i: i for i in range(1, 6)}


def test_compare_reports_a_real_loss_not_a_shift_and_an_edited_line_apart():
    cd = _script()
    maps = {"p/x.py": cd.map_lines("a\nb\nc\nd\ne\n", "a\nNEW1\nNEW2\nb\nc\nD-edited\ne\n"),
            "p/y.py": cd.map_lines("u\nv\n", "u\nv\n")}
    before = {"p/x.py": {2, 3, 4, 5}, "p/y.py": {1, 2}}
    # after: b (now 4) and e (now 7) still covered, c (now 5) not; NEW1 covered; y's line 2 not
    after = {"p/x.py": {2, 4, 7}, "p/y.py": {1}}
    lost, gained, changed = cd.compare(before, after, maps)
    assert lost == ["p/x.py:3", "p/y.py:2"]  # c, and y's second line: lines the change left alone
    assert changed == ["p/x.py:4"]  # d, edited by the second commit: not compared
    assert gained == ["p/x.py:2"]  # NEW1
    # by line number alone, e (line 5 before, 7 after: still covered) would read as lost
    naive = sorted(f"{f}:{ln}" for f, ls in before.items() for ln in ls - after.get(f, set()))
    assert naive == ["p/x.py:3", "p/x.py:5", "p/y.py:2"] and naive != lost
    # a file only one commit has: every covered line of the other is changed / gained
    lost, gained, changed = cd.compare({"p/gone.py": {1}}, {"p/new.py": {3}}, {"p/gone.py": {}, "p/new.py": {}})
    assert (lost, gained, changed) == ([], ["p/new.py:3"], ["p/gone.py:1"])
