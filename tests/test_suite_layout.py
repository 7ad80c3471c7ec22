"""The suite's own xdist layout (tests/conftest.py): the longest tests are dealt over the
workers' first chunks, and a worker recognises ``--dist load`` from the controller's
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


def test_long_tests_open_every_workers_first_chunk():
    long = [SimpleNamespace(nodeid=f"tests/x/{k}slow[{i}]") for i, k in enumerate(LONGEST_FIRST[:8])]
    short = [SimpleNamespace(nodeid=f"tests/y.py::test_{i}") for i in range(200)]
    out = _spread_for_xdist(long + short, 4)
    assert sorted(id(i) for i in out) == sorted(id(i) for i in long + short)  # nothing lost or doubled
    chunk = 208 // 4 // 4  # xdist/scheduler/load.py: len // workers // 4, over all 208 items
    firsts = [out[k * chunk:(k + 1) * chunk] for k in range(4)]
    for k, c in enumerate(firsts):  # two long tests start each worker's chunk, longest first
        assert [i.nodeid for i in c[:2]] == [long[k].nodeid, long[k + 4].nodeid]
        assert all(i in short for i in c[2:])
