"""The e2e launches' Ray worker fork server (``shim/ray_zygote.py``, issue 57): what a worker started
through its launcher sees and how it ends must be what a worker Ray exec'd would see. Tested without
Ray, with a small script in place of ``default_worker.py`` and a server that preloads nothing (the
e2e tests count the Ray workers it forks in every launch)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent / "shim"
ZYGOTE = SHIM / "ray_zygote.py"

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    if sys.argv[1] == "wait":
        signal.signal(signal.SIGTERM, lambda *_: (print("TERM", flush=True), sys.exit(7)))
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                      "foo": os.environ.get("FOO"), "path": sys.path, "name": __name__}), flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "stdin":
        print("read " + sys.stdin.read().strip(), flush=True)
    if mode == "wait":
        time.sleep(60)
    if mode == "atexit":
        import atexit
        atexit.register(lambda: print("atexit ran", flush=True))
""")


@pytest.fixture
def server(tmp_path):
    """A server that preloads nothing; yields (its process, the launchers' environment)."""
    sock = tmp_path / "s"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), str(tmp_path / "extra")])}
    env.pop("COVERAGE_PROCESS_START", None)
    proc = subprocess.Popen([sys.executable, str(ZYGOTE), "serve", str(sock), str(os.getpid()), ""], env=env,
                            stderr=subprocess.PIPE, text=True)
    (tmp_path / "worker.py").write_text(WORKER)
    launch_env = {**env, "HAPO_RAY_ZYGOTE": str(sock), "HAPO_RAY_ZYGOTE_PID": str(proc.pid), "FOO": "bar"}
    yield proc, launch_env
    proc.kill()
    proc.wait()


def _launcher(tmp_path, *args):
    return [sys.executable, "-S", str(ZYGOTE), str(tmp_path / "worker.py"), *args]


def _first_line(stdout: str) -> dict:
    import json

    return json.loads(stdout.splitlines()[0])


def test_the_worker_is_a_child_of_the_server_with_the_launchers_argv_env_cwd_and_stdio(server, tmp_path):
    proc, env = server
    r = subprocess.run(_launcher(tmp_path, "exit", "3"), env=env, cwd="/", capture_output=True, text=True,
                       timeout=120)
    seen = _first_line(r.stdout)
    assert r.returncode == 3 and r.stderr == "on stderr\n"
    assert seen["ppid"] == proc.pid and seen["name"] == "__main__"
    assert seen["argv"] == [str(tmp_path / "worker.py"), "exit", "3"]
    assert seen["cwd"] == "/" and seen["foo"] == "bar"
    # the path a fresh interpreter would build (the script's directory, then PYTHONPATH), after the
    # stubs of the packages this environment lacks, as importing the CPU shim puts them in a worker
    stubs = [p for p in seen["path"] if p.startswith(str(SHIM / "stubs"))]
    assert seen["path"][:len(stubs)] == stubs
    assert seen["path"][len(stubs):len(stubs) + 3] == [str(tmp_path), str(SHIM), str(tmp_path / "extra")]
    r = subprocess.run(_launcher(tmp_path, "stdin"), env=env, input="hello\n", capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "read hello"
    r = subprocess.run(_launcher(tmp_path, "atexit"), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "atexit ran"
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert "ray_zygote: 3 Ray workers forked" in proc.stderr.read()


def _started(tmp_path, env, *args):
    p = subprocess.Popen(_launcher(tmp_path, *args), env=env, stdout=subprocess.PIPE, text=True)
    return p, _first_line(p.stdout.readline())["pid"]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """``pid`` has exited (reaped by the server, or a zombie awaiting it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_signals_reach_the_worker_and_its_end_is_the_launchers(server, tmp_path):
    _, env = server
    p, _ = _started(tmp_path, env, "wait")
    p.terminate()  # the raylet's SIGTERM: forwarded; the worker's own exit code comes back
    assert p.wait(timeout=30) == 7 and p.stdout.read() == "TERM\n"
    p, pid = _started(tmp_path, env, "wait")
    os.kill(pid, signal.SIGKILL)  # the raylet kills a registered worker by its own pid
    assert p.wait(timeout=30) == -signal.SIGKILL


def test_a_killed_launcher_takes_its_worker_with_it(server, tmp_path):
    _, env = server
    p, pid = _started(tmp_path, env, "wait")
    p.kill()
    p.wait()
    assert _gone(pid)


def test_without_a_server_the_launcher_execs_the_worker_itself(server, tmp_path):
    proc, env = server
    proc.kill()
    proc.wait()
    r = subprocess.run(_launcher(tmp_path, "exit", "0"), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and _first_line(r.stdout)["ppid"] != proc.pid
    assert "ray_zygote: no server at" in r.stderr and "starts as a fresh interpreter" in r.stderr


def test_the_server_leaves_with_the_process_that_started_it(tmp_path):
    sock = tmp_path / "s"
    code = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, {str(ZYGOTE)!r}, 'serve', "
            f"{str(sock)!r}, str(os.getpid()), ''], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            f"print(p.pid, flush=True); time.sleep(0.5)")
    env = {**os.environ, "PYTHONPATH": str(SHIM)}
    env.pop("COVERAGE_PROCESS_START", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert _gone(int(r.stdout.split()[0]), timeout=30)


def test_switched_off_by_name_and_under_coverage():
    import ray_zygote  # the shim directory is on the path (this directory's conftest.py)

    assert ray_zygote.enabled({})
    assert not ray_zygote.enabled({"HAPO_SHIM_ZYGOTE": "0"})
    assert not ray_zygote.enabled({"COVERAGE_PROCESS_START": "/x/.coveragerc"})
