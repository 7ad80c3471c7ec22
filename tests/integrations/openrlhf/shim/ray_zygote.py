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
default_worker.py ARGS``, which lands in :func:`launch`. How the launcher, the server and the child
work is ``tests/fork_server.py`` (shared with the suite's ``hapo`` runs): the child runs
``default_worker.py`` as ``__main__`` with the launcher's argv, environment, directory, stdio and the
path that interpreter would have built, the CPU shim's stubs first again. The worker registers
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
import importlib.util
import os
import sys

_STARTUP_PATH = list(sys.path)  # this interpreter's own, before any import adds to it


def _fork_server():
    """``tests/fork_server.py`` (the launcher, the server, the child's set-up), loaded by its path: the
    launcher runs without ``site`` and with only this directory on its path."""
    if "fork_server" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 3, "fork_server.py")
        spec = importlib.util.spec_from_file_location("fork_server", os.path.normpath(path))
        module = importlib.util.module_from_spec(spec)
        sys.modules["fork_server"] = module
        spec.loader.exec_module(module)
    return sys.modules["fork_server"]


# what every heavy actor of a launch imports (the controller, both trainers' actors, the DeepSpeed
# policy and reference actors, the CPU rollout engine, the PRM): ~90% of their ~9 CPU-s of imports
# (OpenRLHF, hapo's modules and Ray itself are the other ~1 s). Not Ray: its core library reads its
# configuration from the environment once per process (``RayConfig``, the worker's job id among it),
# which a forked worker would inherit from the server, unset. Not megatron-core: only the Megatron
# policy imports it, and its CPU shim would then be in every actor (HAPO_SHIM_MEGATRON); not vLLM:
# only the vLLM engine imports it (and OpenRLHF's rollout module imports it, which is why OpenRLHF is
# not here either).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "deepspeed", "datasets")


def enabled(environ=os.environ) -> bool:
    return environ.get("HAPO_SHIM_ZYGOTE", "1") != "0" and not environ.get("COVERAGE_PROCESS_START")


def launch(sock_path: str, server_pid: int, argv: list[str]) -> None:
    """``py_executable``: run ``argv`` (``default_worker.py ...``) in a child of the server at
    ``sock_path`` (``fork_server.launch``)."""
    _fork_server().launch(sock_path, server_pid, argv, "ray_zygote")


def _stubs_first() -> None:
    hapo_cpu_shim = sys.modules.get("hapo_cpu_shim")
    if hapo_cpu_shim is not None:  # what importing it did to the path, which Ray's hook will not redo
        hapo_cpu_shim.stubs_first()


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
    server = _fork_server().Server(sock_path, _STARTUP_PATH, child_setup=_stubs_first)
    try:
        server.serve(parent)
    finally:
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
    import subprocess
    import tempfile

    home = tempfile.mkdtemp(prefix="hapo-zygote-", dir="/tmp")  # a short path: AF_UNIX's 108 bytes
    sock_path = os.path.join(home, "sock")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", sock_path, str(os.getpid())],
                            env={**os.environ, **worker_env})
    try:
        yield Zygote(sock_path, proc.pid)
    finally:
        _fork_server().stop(proc, home)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:  # serve SOCKET PARENT_PID [MODULE,MODULE...]
        modules = [m for m in sys.argv[4].split(",") if m] if len(sys.argv) > 4 else PRELOAD
        serve(sys.argv[2], int(sys.argv[3]), modules)
    else:
        launch(os.environ["HAPO_RAY_ZYGOTE"], int(os.environ["HAPO_RAY_ZYGOTE_PID"]), sys.argv[1:])
