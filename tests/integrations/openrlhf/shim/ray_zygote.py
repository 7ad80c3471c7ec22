"""TEST-ONLY: the Ray workers of one e2e launch forked from a process that has imported torch,
transformers, DeepSpeed and datasets once (issue 57), instead of each importing them again.

An OpenRLHF launch starts three to nine Ray workers (the controller, the policy actor, the rollout
engine, the PRM, the async trainer's two actors, its queues, lock and state), most of which import
the same ~8 CPU-s of upstream modules, on the suite's two cores. The e2e driver (``run_e2e.py``)
starts this file as a server (``serve``) with the Ray workers' own environment and path; it installs
the CPU shim the way a worker does (``hapo_cpu_shim.install_worker``: each patch right after its
module's own code) and imports :data:`PRELOAD`. The driver then names this file, run by the same
Python without ``site`` (``-S``: nothing but the standard library), as the job's
``runtime_env["py_executable"]``: Ray's ``setup_worker.py`` ends in ``exec PY_EXECUTABLE
default_worker.py ARGS``, which lands in :func:`launch`. The launcher hands the server its argv,
environment, working directory and stdin / stdout / stderr (``SCM_RIGHTS``); the server forks; the
child takes them over, rebuilds ``sys.path`` as that interpreter would have (its script's directory,
its ``PYTHONPATH``, the rest) and runs ``default_worker.py`` as ``__main__``. The worker registers
with the raylet under its own pid and the startup token in its argv (the raylet matches a worker to
the process it started by that token, and kills it by its own pid).

The launcher stays the process the raylet started, for the child's whole life: it forwards
SIGTERM / SIGINT / SIGHUP / SIGUSR1 / SIGUSR2 to the child and exits as the child did (the same
code, or the same signal). If the launcher dies (SIGKILL), the server kills its child; if the
server's parent (the driver) goes, the server exits. Nothing in ``hapo_openrlhf`` knows of it.

``HAPO_SHIM_ZYGOTE=0`` (or coverage's ``COVERAGE_PROCESS_START``, whose per-process data a forked
worker would not write) turns it off: every worker a fresh interpreter, as Ray starts them.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys

_STARTUP_PATH = list(sys.path)  # this interpreter's own, before any import adds to it

# what every heavy actor of a launch imports (the controller, both trainers' actors, the DeepSpeed
# policy and reference actors, the CPU rollout engine, the PRM): ~90% of their ~9 CPU-s of imports
# (OpenRLHF, hapo's modules and Ray itself are the other ~1 s). Not Ray: its core library reads its
# configuration from the environment once per process (``RayConfig``, the worker's job id among it),
# which a forked worker would inherit from the server, unset. Not megatron-core: only the Megatron
# policy imports it, and its CPU shim would then be in every actor (HAPO_SHIM_MEGATRON); not vLLM:
# only the vLLM engine imports it (and OpenRLHF's rollout module imports it, which is why OpenRLHF is
# not here either).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "deepspeed", "datasets")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def enabled(environ=os.environ) -> bool:
    return environ.get("HAPO_SHIM_ZYGOTE", "1") != "0" and not environ.get("COVERAGE_PROCESS_START")


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
    """The server's socket once it listens (it imports while Ray starts); None if the server is
    gone or never listens."""
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


def launch(sock_path: str, server_pid: int, argv: list[str]) -> None:
    """``py_executable``: run ``argv`` (``default_worker.py ...``) in a child of the server at
    ``sock_path``; forward signals to it; exit as it does. Without a server, become the worker
    the plain way (exec the interpreter), saying so on stderr."""
    conn = _connect(sock_path, server_pid)
    if conn is None:
        print(f"ray_zygote: no server at {sock_path}: {argv[:1]} starts as a fresh interpreter",
              file=sys.stderr, flush=True)
        os.execv(sys.executable, [sys.executable, *argv])
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
    _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, fds=(0, 1, 2))
    reply, _ = _recv(conn)
    if reply is None:
        sys.exit(f"ray_zygote: the server at {sock_path} closed before forking {argv[:1]}")
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
class _Server:
    def __init__(self, sock_path: str):
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        # the path a fresh interpreter builds after its script's directory and PYTHONPATH
        self.base_path = [p for p in _STARTUP_PATH[1:] if p not in pythonpath]
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
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
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
        try:  # the raylet killed the process it started: what it started goes with it
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
        """Become the worker the launcher would have exec'd: its stdio, directory, environment,
        argv and path; run its script as ``__main__``; leave as an interpreter does (``atexit``)."""
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
            script, *args = msg["argv"]
            pythonpath = [p for p in msg["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:] = [os.path.dirname(os.path.abspath(script)), *pythonpath, *self.base_path]
            sys.path_importer_cache.clear()
            hapo_cpu_shim = sys.modules.get("hapo_cpu_shim")
            if hapo_cpu_shim is not None:  # what importing it did to the path, which Ray's hook will not redo
                hapo_cpu_shim.stubs_first()
            sys.argv = [script, *args]
            import runpy

            try:
                runpy.run_path(script, run_name="__main__")
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


def serve(sock_path: str, parent: int, preload=PRELOAD) -> None:
    """The server: the CPU shim as a worker installs it, :data:`PRELOAD` imported, then fork on
    request until SIGTERM or until ``parent`` (the driver that started it) is gone."""
    import importlib

    import hapo_cpu_shim

    hapo_cpu_shim.install_worker()
    for name in preload:
        importlib.import_module(name)
    if "ray._raylet" in sys.modules:  # a forked worker would keep this process's RayConfig
        raise RuntimeError(f"ray_zygote: preloading {list(preload)} imported Ray's core library")
    server = _Server(sock_path)
    try:
        server.serve(parent)
    finally:
        server.listener.close()
        print(f"ray_zygote: {server.forked} Ray workers forked", file=sys.stderr, flush=True)


class Zygote:
    """A running server: what the driver puts in the job's ``runtime_env``."""

    def __init__(self, sock_path: str, pid: int):
        self.py_executable = f"{sys.executable} -S {os.path.abspath(__file__)}"
        self.env = {"HAPO_RAY_ZYGOTE": sock_path, "HAPO_RAY_ZYGOTE_PID": str(pid)}


@contextlib.contextmanager
def started(worker_env: dict):
    """The server, started with the driver's environment plus ``worker_env`` (the job's
    ``env_vars``: what every Ray worker's environment holds) and stopped after the block; None
    when :func:`enabled` says no. It imports while the driver starts Ray; a launcher waits for it."""
    if not enabled():
        yield None
        return
    import shutil
    import subprocess
    import tempfile

    home = tempfile.mkdtemp(prefix="hapo-zygote-", dir="/tmp")  # a short path: AF_UNIX's 108 bytes
    sock_path = os.path.join(home, "sock")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", sock_path, str(os.getpid())],
                            env={**os.environ, **worker_env})
    try:
        yield Zygote(sock_path, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:  # serve SOCKET PARENT_PID [MODULE,MODULE...]
        modules = [m for m in sys.argv[4].split(",") if m] if len(sys.argv) > 4 else PRELOAD
        serve(sys.argv[2], int(sys.argv[3]), modules)
    else:
        launch(os.environ["HAPO_RAY_ZYGOTE"], int(os.environ["HAPO_RAY_ZYGOTE_PID"]), sys.argv[1:])
