"""The suite's ``hapo`` runs forked from a server that imported torch and transformers once
(``tests/fork_server.py``, ``conftest.run_cli``; issue 57): what such a run sees and how it ends must be
what a fresh ``python -m hapo_openrlhf`` would see. The launcher's signal and exit semantics are the
same code the e2e launches' Ray workers go through (``integrations/openrlhf/test_ray_zygote.py``)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import fork_server
from tests.conftest import REPO, run_cli

PROBE = textwrap.dedent("""
    import json, os, sys, time
    preloaded = "torch" in sys.modules
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                      "name": __name__, "path0": sys.path[0], "foo": os.environ.get("FOO"),
                      "server_vars": sorted(k for k in os.environ if k.startswith("HAPO_FORK_SERVER")),
                      "preloaded": preloaded, "buffering": [sys.stdout.line_buffering, sys.stdout.write_through]}), flush=True)
    print("on stderr", file=sys.stderr)
    if sys.argv[1] == "sleep":
        time.sleep(120)
    sys.exit(int(sys.argv[2]))
""")

needs_server = pytest.mark.skipif(not fork_server.cli_enabled(), reason="the fork server is off "
                                  "(HAPO_TEST_FORK_SERVER=0, or coverage)")


def _probe(tmp_path, *args, server=None, timeout=120, **env):
    (tmp_path / "probe.py").write_text(PROBE)
    argv = ["-m", "probe", *args]
    if server is None:
        cmd, full_env = [sys.executable, *argv], {**os.environ, **env}
    else:
        cmd, full_env = server.command(argv), server.launcher_env({**os.environ, **env})
    return subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)


@needs_server
def test_a_module_run_through_the_server_sees_what_python_dash_m_would(tmp_path):
    server = fork_server.cli_server()
    fresh = _probe(tmp_path, "exit", "3", FOO="bar")
    forked = _probe(tmp_path, "exit", "3", server=server, FOO="bar")
    a, b = json.loads(fresh.stdout), json.loads(forked.stdout)
    assert fresh.returncode == forked.returncode == 3 and fresh.stderr == forked.stderr == "on stderr\n"
    assert b["ppid"] == server.proc.pid and a["ppid"] != server.proc.pid
    assert b["preloaded"] and not a["preloaded"]  # what the server saves: torch already imported
    for k in ("argv", "cwd", "name", "path0", "foo", "server_vars", "buffering"):
        assert a[k] == b[k], k  # the module's file first in argv, __main__, cwd first on the path, ...
    assert b["argv"] == [str(tmp_path / "probe.py"), "exit", "3"] and b["server_vars"] == []
    for value in ("", "1"):  # the interpreter's stdout buffering follows PYTHONUNBUFFERED
        pair = [json.loads(_probe(tmp_path, "exit", "0", server=s, PYTHONUNBUFFERED=value).stdout)["buffering"]
                for s in (None, server)]
        assert pair[0] == pair[1] == [False, value == "1"], pair


@needs_server
def test_a_timed_out_run_takes_its_forked_process_with_it(tmp_path):
    server = fork_server.cli_server()
    (tmp_path / "probe.py").write_text(PROBE)
    p = subprocess.Popen(server.command(["-m", "probe", "sleep", "0"]), cwd=tmp_path, env=server.launcher_env(),
                         stdout=subprocess.PIPE, text=True)
    pid = json.loads(p.stdout.readline())["pid"]
    with pytest.raises(subprocess.TimeoutExpired):  # what subprocess.run does on its timeout: kill, wait
        p.communicate(timeout=0.5)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the forked process outlived its killed launcher"
        time.sleep(0.05)


@needs_server  # (with the server off both runs are fresh: nothing to compare)
def test_hapo_through_run_cli_answers_as_a_fresh_interpreter(tmp_path, monkeypatch):
    """The same refusal and the same doctor report, byte for byte, forked and fresh (the disk's free
    space aside: the other tests write beside these)."""
    import re

    def answer(p):
        return p.returncode, *(re.sub(r"[\d.]+ GiB free", "N GiB free", t) for t in (p.stdout, p.stderr))

    cases = [["train", "--config", str(tmp_path / "missing.yaml")],
             ["doctor", "--config", "configs/cpu_tiny.yaml", "--output-dir", str(tmp_path / "o")]]
    for args in cases:
        forked = run_cli(args)
        monkeypatch.setenv("HAPO_TEST_FORK_SERVER", "0")
        fresh = run_cli(args)
        monkeypatch.delenv("HAPO_TEST_FORK_SERVER")
        assert answer(forked) == answer(fresh)
    # an environment of its own (the Slurm tests' form) goes through the server too
    mine = run_cli(cases[0], env={**os.environ, "HAPO_PROBE": "1"})
    assert (mine.returncode, mine.stderr) == (2, run_cli(cases[0], fresh=True).stderr) and "missing.yaml" in mine.stderr


def test_switched_off_by_name_and_under_coverage():
    assert fork_server.cli_enabled({})
    assert not fork_server.cli_enabled({"HAPO_TEST_FORK_SERVER": "0"})
    assert not fork_server.cli_enabled({"COVERAGE_PROCESS_START": str(REPO / ".coveragerc")})
