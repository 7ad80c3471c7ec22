"""TEST-ONLY: processes forked from one that has imported the heavy upstream modules once, instead of
each fresh interpreter importing them again (issue 57). Two servers:

* the e2e launches' Ray workers (``integrations/openrlhf/shim/ray_zygote.py``: a server per launch,
  torch, transformers, DeepSpeed and datasets preloaded, the CPU shim installed first);
* the suite's ``hapo`` command-line runs (``tests/conftest.py::run_cli``: one server per test process,
  started at its first run, torch and transformers preloaded; :func:`cli_server`). ~100 such runs,
  each paying ~3-5 CPU-s of imports before its own work, on the suite's two cores. The e2e launches'
  drivers with the shim's CPU engine (``integrations/openrlhf/e2e_util.py::run_e2e``) come from the
  same server.

How a process is started through it: a launcher -- this file run by the same Python without ``site``
(``-S``: the standard library only, ~20 ms) -- is the process its caller starts
(``subprocess.run`` with its pipes, directory, environment and timeout; Ray's ``exec``). It hands the
server its argv, environment, working directory and stdin / stdout / stderr (``SCM_RIGHTS``); the
server forks; the child takes them over, rebuilds ``sys.path`` as that interpreter would have (the
script's directory, or for ``-m`` the working directory; its ``PYTHONPATH``; the rest), takes the
interpreter's stdio buffering for those streams, and runs the script, or the module (``-m``), as
``__main__``. The launcher stays for the child's whole life: it forwards SIGTERM / SIGINT / SIGHUP /
SIGUSR1 / SIGUSR2 to the child and exits as the child did (the same code, or the same signal). If
the launcher dies (a timeout's SIGKILL), the server kills its child; if the server's parent goes,
the server exits. With no server to reach, the launcher execs the interpreter itself and says so.

What a forked child does not repeat: the preloaded modules' own import-time work (their reading of
the environment included: the servers preload no module of this package, and the suite's
environment is the servers'). Under coverage (``COVERAGE_PROCESS_START``) both users switch it off:
a forked child would not write its own coverage data.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

_STARTUP_PATH = list(sys.path)  # this interpreter's own, before any import adds to it
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# what a `hapo` run imports before its own work (~3-5 CPU-s of its ~5-12): not this package, whose
# import is what the tests check, and which reads its environment
CLI_PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.auto_factory")
CLI_SOCKET, CLI_PID = "HAPO_FORK_SERVER", "HAPO_FORK_SERVER_PID"


def _send(conn: socket.socket, obj, fds=()) -> None:
    data = json.dumps(obj).encode()
    head = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(conn, [head], list(fds))
    else:
        conn.sendall(head)
    conn.sendall(data)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _recv(conn: socket.socket, nfds: int = 0):
    """One message (and ``nfds`` descriptors sent with its header); None at end of stream."""
    fds = []
    if nfds:
        head, fds, _, _ = socket.recv_fds(conn, 4, nfds)
        if len(head) < 4:
            head += _recv_exact(conn, 4 - len(head)) or b""
    else:
        head = _recv_exact(conn, 4)
    if not head or len(head) < 4:
        for fd in fds:
            os.close(fd)
        return None, []
    data = _recv_exact(conn, struct.unpack("!I", head)[0])
    return (None if data is None else json.loads(data)), fds


# ------------------------------------------------------------------- the launcher
def _connect(sock_path: str, server_pid: int, timeout: float = 600.0) -> socket.socket | None:
    """The server's socket once it listens (it may still be importing); None if the server is gone
    or never listens."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(sock_path):
            conn = socket.socket(socket.AF_UNIX)
            try:
                conn.connect(sock_path)
                return conn
            except OSError:
                conn.close()
                return None
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return None
        time.sleep(0.05)
    return None


def launch(sock_path: str, server_pid: int, argv: list[str], tag: str, drop_env=()) -> None:
    """Run ``argv`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) in a child of the server at
    ``sock_path`` with this process's environment less ``drop_env``; forward signals to it; exit as
    it does. Without a server, become it the plain way (exec the interpreter), saying so on stderr."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    conn = _connect(sock_path, server_pid)
    if conn is None:
        print(f"{tag}: no server at {sock_path}: {argv[:2]} starts as a fresh interpreter",
              file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, *argv], env)
    child, pending = [], []  # a signal before the fork is answered is passed on once it is

    def forward(sig, _frame):
        if not child:
            pending.append(sig)
            return
        try:
            os.kill(child[0], sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _send(conn, {"argv": argv, "env": env, "cwd": os.getcwd()}, fds=(0, 1, 2))
    reply, _ = _recv(conn)
    if reply is None:
        sys.exit(f"{tag}: the server at {sock_path} closed before forking {argv[:2]}")
    child.append(reply["pid"])
    for sig in pending:
        forward(sig, None)
    done, _ = _recv(conn)  # a forwarded signal does not interrupt it (PEP 475)
    if done is None:  # the server went first
        os._exit(1)
    status = done["status"]
    if status < 0:  # killed by a signal: die of the same one
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


# ------------------------------------------------------------------- the server
class Server:
    """Forks on request; ``child_setup()`` runs in each child once its path is rebuilt (the CPU
    shim's stubs put first again, for the Ray workers)."""

    def __init__(self, sock_path: str, startup_path: list[str] = _STARTUP_PATH, child_setup=None):
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        # the path a fresh interpreter builds after its script's directory and PYTHONPATH
        self.base_path = [p for p in startup_path[1:] if p not in pythonpath]
        self.child_setup = child_setup
        self.listener = socket.socket(socket.AF_UNIX)
        tmp = f"{sock_path}.{os.getpid()}.tmp"
        self.listener.bind(tmp)
        self.listener.listen(64)
        os.rename(tmp, sock_path)  # a launcher never finds a socket that is not listening yet
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children: dict[int, socket.socket | None] = {}  # pid -> its launcher's connection
        self.conns: dict[socket.socket, int] = {}
        self.forked = 0

    def serve(self, parent: int) -> None:
        """Until SIGTERM, or until ``parent`` (the process that started the server) is gone."""
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        try:
            while os.getppid() == parent and not stop:
                ready, _, _ = select.select([self.listener, self.wake_r, *self.conns], [], [], 1.0)
                if self.wake_r in ready:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._reap()
                if self.listener in ready:
                    self._fork()
                for conn in [c for c in ready if c in self.conns]:
                    self._launcher_gone(conn)
        finally:
            self.listener.close()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.conns.pop(conn, None)
                try:
                    _send(conn, {"status": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()

    def _launcher_gone(self, conn: socket.socket) -> None:
        try:
            gone = conn.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        if not gone:
            return
        pid = self.conns.pop(conn)
        self.children[pid] = None  # still reaped, nobody told
        conn.close()
        try:  # the process the caller started was killed: what it started goes with it
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _fork(self) -> None:
        conn, _ = self.listener.accept()
        msg, fds = _recv(conn, nfds=3)
        if msg is None or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self._child(conn, msg, fds)  # never returns
        for fd in fds:
            os.close(fd)
        self.forked += 1
        self.children[pid] = conn
        self.conns[conn] = pid
        try:
            _send(conn, {"pid": pid})
        except OSError:
            self._launcher_gone(conn)

    def _child(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """Become the process the launcher would have exec'd: its stdio, directory, environment,
        argv and path; run its script or module as ``__main__``; leave as an interpreter does."""
        code = 1
        try:
            conn.close()
            self.listener.close()
            for c in self.conns:
                c.close()
            signal.set_wakeup_fd(-1)
            os.close(self.wake_r)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(msg["cwd"])
            os.environ.clear()
            os.environ.update(msg["env"])
            # stdout's buffering as the interpreter would choose it for this descriptor and environment
            if sys.stdout is not None:  # CPython's rule: write-through when unbuffered, else line-buffered on a tty
                unbuffered = bool(msg["env"].get("PYTHONUNBUFFERED"))
                sys.stdout.reconfigure(line_buffering=not unbuffered and os.isatty(1), write_through=unbuffered)
            argv = msg["argv"]
            module = argv[1] if argv[0] == "-m" else None
            first = msg["cwd"] if module else os.path.dirname(os.path.abspath(argv[0]))
            pythonpath = [p for p in msg["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:] = [first, *pythonpath, *self.base_path]
            sys.path_importer_cache.clear()
            if self.child_setup is not None:
                self.child_setup()
            import runpy

            try:
                if module:
                    sys.argv = ["-m", *argv[2:]]  # run_module puts the module's file first, as -m does
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    sys.argv = list(argv)
                    runpy.run_path(argv[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


# ------------------------------------------------------------------- the CLI's server
def cli_enabled(environ=os.environ) -> bool:
    return environ.get("HAPO_TEST_FORK_SERVER", "1") != "0" and not environ.get("COVERAGE_PROCESS_START")


class CliServer:
    """This test process's server for ``hapo`` runs: :meth:`command` is the launcher's argv,
    :meth:`launcher_env` its environment."""

    def __init__(self) -> None:
        import atexit
        import subprocess
        import tempfile

        self.home = tempfile.mkdtemp(prefix="hapo-fork-", dir="/tmp")  # a short path: AF_UNIX's 108 bytes
        self.sock = os.path.join(self.home, "sock")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", self.sock, str(os.getpid()),
                                      ",".join(CLI_PRELOAD)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        atexit.register(self.stop)

    def launcher_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The launcher's environment: ``env`` (default: this process's now) and where the server is;
        the child gets ``env``."""
        return {**(os.environ if env is None else env), CLI_SOCKET: self.sock, CLI_PID: str(self.proc.pid)}

    def command(self, argv: list[str]) -> list[str]:
        return [sys.executable, "-S", os.path.abspath(__file__), *argv]

    def stop(self) -> None:
        stop(self.proc, self.home)


def stop(proc, home: str) -> None:
    """A server's end: SIGTERM (it leaves its loop), SIGKILL after 30 s, its socket's directory removed."""
    import shutil
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(home, ignore_errors=True)


_CLI: dict[int, CliServer] = {}


def cli_server() -> CliServer | None:
    """This process's server, started at its first use (it imports while the first launcher waits);
    None when :func:`cli_enabled` says no. A forked test process starts its own."""
    if not cli_enabled():
        return None
    if os.getpid() not in _CLI:
        _CLI[os.getpid()] = CliServer()
    return _CLI[os.getpid()]


def serve(sock_path: str, parent: int, preload) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    server = Server(sock_path)
    server.serve(parent)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:  # serve SOCKET PARENT_PID MODULE,MODULE...
        serve(sys.argv[2], int(sys.argv[3]), [m for m in sys.argv[4].split(",") if m])
    else:  # the launcher: [-m MODULE | SCRIPT] ARGS...
        launch(os.environ[CLI_SOCKET], int(os.environ[CLI_PID]), sys.argv[1:], "fork_server",
               drop_env=(CLI_SOCKET, CLI_PID))
