"""Multi-node Ray bring-up inside a Slurm allocation, without fixed sleeps.

The batch step runs on the first node of the allocation. It starts the Ray head
there (``ray start --head --block``), starts one Ray worker per other node with a
single ``srun`` (one task per node), then polls Ray until every node has registered
-- or fails after ``timeout`` seconds naming the nodes that did not. The Ray version
is whatever is installed in the job's environment (the same on every node).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .netif import check_not_loopback, interface_ip, socket_env

# worker nodes take free ports, so several Ray nodes can share a host (the tests' two
# slurmd "nodes" on localhost; also harmless on real clusters)
_WORKER_PORTS = ["--node-manager-port", "0", "--object-manager-port", "0", "--dashboard-agent-listen-port", "0",
                 "--metrics-export-port", "0", "--runtime-env-agent-port", "0"]


def allocation_hosts() -> list[str]:
    """Node names of this job (``SLURM_JOB_NODELIST`` expanded), or this host outside Slurm."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return [socket.gethostname()]
    p = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return [h for h in p.stdout.split() if h]


def head_ip(interface: str | None = None) -> str:
    """The address the head binds to: ``interface``'s IPv4 address when given (e.g. ``ib0``,
    so Ray traffic uses InfiniBand rather than the default route's management Ethernet),
    else Ray's own choice (the default-route interface)."""
    if interface:
        return interface_ip(interface)
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


def gpus_per_node_from_slurm(value: str | None) -> int | None:
    """``SLURM_GPUS_PER_NODE`` ("8", "a100:8", "gpu:a100:4") -> 8 / 4; None when unset."""
    if not value:
        return None
    try:
        return int(value.split(",")[0].rsplit(":", 1)[-1])
    except ValueError:
        return None


def check_gpus(nodes: list[dict], gpus_per_node: int | None) -> None:
    """Every node must have registered ``gpus_per_node`` GPUs with Ray; OpenRLHF's placement
    groups would otherwise wait forever for the missing ones."""
    if not gpus_per_node:
        return
    short = [f"{n['host']} ({n.get('gpus', 0):g} of {gpus_per_node})" for n in nodes
             if n.get("gpus", 0) < gpus_per_node]
    if short:
        total = sum(n.get("gpus", 0) for n in nodes)
        raise RuntimeError(f"Ray registered {total:g} GPUs, the allocation has {len(nodes)} x {gpus_per_node}; "
                           f"nodes missing GPUs: {', '.join(short)} (CUDA_VISIBLE_DEVICES, driver, or Ray's "
                           f"--num-gpus on those nodes)")


def _ray_exe() -> str:
    return str(Path(sys.executable).with_name("ray"))


# what `ray start` raises when its raylet has not registered with the GCS within Ray's fixed
# 30 s (ray/_private/node.py): a loaded node, not a broken one -- the bring-up retries it
RAY_STARTUP_TIMEOUT = "The current node timed out during startup"


class RayCluster:
    def __init__(self, hosts: list[str], port: int = 6379, timeout_s: float = 300.0, num_gpus: int | None = None,
                 log_dir: Path | None = None, start_workers: bool = True, num_cpus: int | None = None,
                 interface: str | None = None, worker_launcher: list[str] | None = None):
        self.start_workers = start_workers
        self.hosts = hosts
        self.port = port
        self.timeout_s = timeout_s
        self.num_gpus = num_gpus  # per node; also what every node must register
        self.num_cpus = num_cpus  # per node (the task's --cpus-per-task)
        self.interface = interface  # every node's Ray, gloo and NCCL traffic goes through it (netif.py)
        # what starts the Ray worker on the other nodes: one srun task per node; the two-host
        # test passes `ip netns exec NS`
        self.worker_launcher = worker_launcher
        self.log_dir = log_dir
        self.start_attempts = 3  # a node start that hits Ray's own startup timeout is retried
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.nodes: list[dict] = []  # alive nodes once start() returned

    def _popen(self, cmd: list[str], name: str) -> subprocess.Popen:
        out = open(self.log_dir / f"ray_{name}.log", "ab") if self.log_dir else subprocess.DEVNULL
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def _node(self, ray_args: list[str]) -> list[str]:
        """``ray start ray_args`` through ``cluster/ray_node.py``, which on the node itself
        resolves the interface, checks the route to the head and sets the socket variables."""
        iface = ["--interface", self.interface] if self.interface else []
        return [sys.executable, "-m", "hapo_openrlhf.cluster.ray_node", *iface, "--", _ray_exe(), "start", *ray_args]

    def driver_env(self) -> dict[str, str]:
        """What the training driver on the head node adds to its environment."""
        return {"RAY_ADDRESS": self.address, **(socket_env(self.interface, self.address.rpartition(":")[0])
                                               if self.interface else {})}

    def start(self) -> "RayCluster":
        """Bring the cluster up. A node start that fails with Ray's own 30-second startup
        timeout (``RAY_STARTUP_TIMEOUT``: its raylet registered late, as on a loaded node)
        is retried from scratch, up to ``start_attempts`` times; any other failure is raised
        at once."""
        for attempt in range(1, self.start_attempts + 1):
            marks = {n: self._log_size(n) for n in ("head", "workers")}
            try:
                return self._start_once()
            except RuntimeError as e:
                late = any(RAY_STARTUP_TIMEOUT in self._log_since(n, k) for n, k in marks.items())
                if not late or attempt == self.start_attempts:
                    raise
                print(f"hapo ray: {e}; Ray's node startup timed out (a loaded node): attempt {attempt + 1} of "
                      f"{self.start_attempts}", file=sys.stderr, flush=True)
        raise AssertionError("unreachable")

    def _log_size(self, name: str) -> int:
        f = self.log_dir / f"ray_{name}.log" if self.log_dir else None
        return f.stat().st_size if f is not None and f.exists() else 0

    def _log_since(self, name: str, offset: int) -> str:
        f = self.log_dir / f"ray_{name}.log" if self.log_dir else None
        if f is None or not f.exists():
            return ""
        with open(f, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")

    def _start_once(self) -> "RayCluster":
        ip = head_ip(self.interface)
        if self.interface and len(self.hosts) > 1:
            check_not_loopback(self.interface, ip)
        self.address = f"{ip}:{self.port}"
        # explicit resources: since Slurm 22.05 srun no longer inherits --cpus-per-task from
        # sbatch, and Ray would otherwise advertise every core of the node while the task's
        # processes share the CPUs Slurm bound them to
        res = [] if self.num_gpus is None else ["--num-gpus", str(self.num_gpus)]
        res += [] if self.num_cpus is None else ["--num-cpus", str(self.num_cpus)]
        self._popen(self._node(["--head", "--port", str(self.port), "--block", "--include-dashboard=false",
                                "--disable-usage-stats", *res]), "head")
        if len(self.hosts) > 1 and self.start_workers:
            n = len(self.hosts) - 1
            cpus = [] if self.num_cpus is None else [f"--cpus-per-task={self.num_cpus}"]
            launcher = self.worker_launcher if self.worker_launcher is not None else [
                "srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--exclude={self.hosts[0]}",
                *cpus, "--kill-on-bad-exit=1"]
            self._popen([*launcher, *self._node(["--address", self.address, "--block", "--disable-usage-stats",
                                                 *_WORKER_PORTS, *res])], "workers")
        self.nodes = self.wait_for_nodes()
        try:
            check_gpus(self.nodes, self.num_gpus)
        except RuntimeError:
            self.stop()
            raise
        return self

    def _error_in_log(self, name: str) -> str:
        """The last ``hapo ray_node: error:`` line of a node log (why a node did not start)."""
        if self.log_dir is None or not (self.log_dir / f"ray_{name}.log").exists():
            return ""
        lines = [ln for ln in (self.log_dir / f"ray_{name}.log").read_text(errors="replace").splitlines()
                 if "hapo ray_node: error:" in ln]
        return lines[-1].split("error:", 1)[1].strip() if lines else ""

    def alive_nodes(self) -> list[dict]:
        """Alive Ray nodes, asked from a short-lived driver (this process stays Ray-free); none
        while the head's GCS port does not accept connections (a driver would wait for it)."""
        host, _, port = self.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except OSError:
            return []
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                "print(json.dumps([{'host': n['NodeManagerHostname'], 'ip': n['NodeManagerAddress'], "
                "'gpus': n['Resources'].get('GPU', 0), 'cpus': n['Resources'].get('CPU', 0)} "
                "for n in ray.nodes() if n['Alive']])); ray.shutdown()") % self.address
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:  # no GCS answering yet (or a head that died): none alive so far
            return []
        if p.returncode:
            return []
        import json

        return json.loads(p.stdout.strip().splitlines()[-1])

    def wait_for_nodes(self) -> list[dict]:
        want = len(self.hosts)
        t0 = time.monotonic()
        nodes: list[dict] = []
        delay = 0.5
        while time.monotonic() - t0 < self.timeout_s:
            for name, p in zip(("head", "workers"), self.procs):
                if p.poll() is not None:
                    why = self._error_in_log(name)
                    self.stop()
                    raise RuntimeError(f"Ray bring-up failed: the {name} start exited with {p.returncode}"
                                       + (f": {why}" if why else f" (see {self.log_dir or 'the Ray logs'})"))
            nodes = self.alive_nodes()
            if len(nodes) >= want:
                return nodes
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        seen = {n["host"] for n in nodes} | {n["ip"] for n in nodes}
        missing = [h for h in self.hosts if h not in seen]  # empty when nodes share a hostname (one host)
        self.stop()
        raise TimeoutError(
            f"Ray: {len(nodes)}/{want} nodes registered with the head {self.address} after {self.timeout_s:.0f}s; "
            f"missing: {', '.join(missing) if missing else f'{want - len(nodes)} of {self.hosts}'}")

    def stop(self) -> None:
        """Stop this job's Ray processes only (each was started in its own process group,
        which Ray's daemons inherit); never ``ray stop``, which would hit other clusters."""
        import signal

        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.procs.clear()
