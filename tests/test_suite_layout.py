"""The suite's own xdist layout (tests/conftest.py): the OpenRLHF e2e tests run in series
on one worker, the other long tests open the other workers' first chunks, and a worker recognises ``--dist load`` from the controller's
command line (its own config says ``dist == "no"``: the check that silently never fired
before, leaving every long test on one worker)."""

from types import SimpleNamespace

from tests.conftest import LONGEST_FIRST, _spread_for_xdist, _xdist_load_workers


def _config(argv, count=4):
    return SimpleNamespace(workerinput={"mainargv": argv, "workercount": count})


def test_a_worker_sees_the_load_mode_from_the_controllers_argv():
    assert _xdist_load_workers(_config(["pytest", "-q", "-n", "4", "--dist", "load"])) == 4
    assert _xdist_load_workers(_config(["pytest", "-n", "3"], 3)) == 3  # -n alone is load
    assert _xdist_load_workers(_config(["pytest", "-n", "4", "--dist=worksteal"])) == 0
    assert _xdist_load_workers(SimpleNamespace()) == 0  # not a worker


def test_e2e_tests_run_in_series_and_other_long_tests_open_the_other_chunks():
    long = [SimpleNamespace(nodeid=f"tests/x/{k}slow[{i}]") for i, k in enumerate(LONGEST_FIRST[:9])]
    short = [SimpleNamespace(nodeid=f"tests/y.py::test_{i}") for i in range(200)]
    out = _spread_for_xdist(long + short, 4)
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in long + short)  # nothing lost or doubled
    chunk = 209 // 4 // 4  # xdist/scheduler/load.py: len // workers // 4, over all 209 items
    firsts = [out[k * chunk:(k + 1) * chunk] for k in range(4)]
    assert [i.nodeid for i in firsts[0][:3]] == [i.nodeid for i in long[:3]]  # the three e2e files, in series
    for k in (1, 2, 3):  # the other six long tests, two per other worker, longest first
        assert [i.nodeid for i in firsts[k][:2]] == [long[3 + k - 1].nodeid, long[3 + k + 2].nodeid]
    assert all(i in short for c in firsts for i in c[3 if c is firsts[0] else 2:])
