"""The suite's own xdist layout (tests/conftest.py): the OpenRLHF e2e tests are dealt over
two workers, in series on each, the other long tests open the other workers' first chunks, and a worker recognises ``--dist load`` from the controller's
command line (its own config says ``dist == "no"``: the check that silently never fired
before, leaving every long test on one worker)."""

import os
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import LONGEST_FIRST, _spread_for_xdist, _xdist_load_workers


def _config(argv, count=4):
    return SimpleNamespace(workerinput={"mainargv": argv, "workercount": count})


def test_a_worker_sees_the_load_mode_from_the_controllers_argv():
    assert _xdist_load_workers(_config(["pytest", "-q", "-n", "4", "--dist", "load"])) == 4
    assert _xdist_load_workers(_config(["pytest", "-n", "3"], 3)) == 3  # -n alone is load
    assert _xdist_load_workers(_config(["pytest", "-n", "4", "--dist=worksteal"])) == 0
    assert _xdist_load_workers(SimpleNamespace()) == 0  # not a worker


def test_e2e_tests_on_two_workers_and_other_long_tests_open_the_other_chunks():
    long = [SimpleNamespace(nodeid=f"tests/x/{k}slow[{i}]") for i, k in enumerate(LONGEST_FIRST[:9])]
    short = [SimpleNamespace(nodeid=f"tests/y.py::test_{i}") for i in range(200)]
    out = _spread_for_xdist(long + short, 4)
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in long + short)  # nothing lost or doubled
    chunk = 209 // 4 // 4  # xdist/scheduler/load.py: len // workers // 4, over all 209 items
    firsts = [out[k * chunk:(k + 1) * chunk] for k in range(4)]
    # test_e2e then test_e2e_megatron on the first worker, test_e2e_async on the second
    assert [i.nodeid for i in firsts[0][:2]] == [long[0].nodeid, long[2].nodeid]
    assert firsts[1][0].nodeid == long[1].nodeid and firsts[1][1] in short
    for k in (2, 3):  # the other six long tests, three per other worker, longest first
        assert [i.nodeid for i in firsts[k][:3]] == [long[3 + k - 2 + j].nodeid for j in (0, 2, 4)]
    n_long = {0: 2, 1: 1, 2: 3, 3: 3}
    assert all(i in short for k, c in enumerate(firsts) for i in c[n_long[k]:])
    # two workers: the e2e tests all on the first, the other long tests on the second
    two = _spread_for_xdist(long + short, 2)
    c2 = 209 // 2 // 4
    assert [i.nodeid for i in two[:3]] == [i.nodeid for i in long[:3]]
    assert [i.nodeid for i in two[c2:c2 + 6]] == [i.nodeid for i in long[3:]]


def test_every_megatron_test_file_is_in_the_py312_leg_or_named_out_of_it():
    """scripts/test.sh runs tests/megatron/py312_leg.py's LEG under megatron-core 0.19.2; every other
    Megatron test file is named with the reason it is not run there (issue 57): a new file must say."""
    from pathlib import Path

    from tests.megatron.py312_leg import LEG, NOT_IN_LEG

    files = {p.name for p in Path(__file__).parent.joinpath("megatron").glob("test_*.py")}
    assert not set(LEG) & set(NOT_IN_LEG)
    assert set(LEG) | set(NOT_IN_LEG) == files, sorted(files ^ (set(LEG) | set(NOT_IN_LEG)))
    assert all(len(why) > 30 for why in NOT_IN_LEG.values()), NOT_IN_LEG


def test_every_case_the_py312_leg_deselects_exists_and_says_what_carries_it():
    """A --deselect that names no collected case deselects nothing and says nothing: each of the leg's
    deselected cases must be a case pytest collects (its parametrisation id included), with a reason."""
    from tests.conftest import run_python
    from tests.megatron.py312_leg import DESELECTED, LEG

    files = sorted({f"tests/megatron/{n.split('::')[0]}" for n in DESELECTED})
    assert all(f.split("/")[-1] in LEG for f in files)
    p = run_python(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                   cwd=Path(__file__).resolve().parents[1], env={**os.environ, "HAPO_REQUIRE_MEGATRON": "0"})
    collected = {ln.strip() for ln in p.stdout.splitlines() if "::" in ln}
    missing = [n for n in DESELECTED if f"tests/megatron/{n}" not in collected]
    assert missing == [], (missing, p.stdout[-2000:], p.stderr[-2000:])
    assert all(len(why) > 30 for why in DESELECTED.values())
