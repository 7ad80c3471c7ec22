"""Two "hosts" on this machine: network namespaces joined by a veth pair (root only).

Host A holds ``hnet0`` = 10.213.S.1/24, host B ``hnet0`` = 10.213.S.2/24 (the same interface
name on both, as on a cluster), and each a decoy ``hdecoy0`` on a network of its own
(10.214.S.1 on A, 10.215.S.2 on B) that the other host cannot reach: the interface a
wrongly named ``--network-interface`` picks. Besides ``lo``, nothing else: the machine's
own ``eth0`` and the address its host name resolves to are not in either namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_unavailable() -> str | None:
    """None when this process can create network namespaces, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"hapoprobe{os.getpid()}"
    p = _ip("netns", "add", name, check=False)
    if p.returncode:
        return f"`ip netns add` failed: {p.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    ns: str
    ip: str
    decoy_ip: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def kill_all(self) -> None:
        p = _ip("netns", "pids", self.ns, check=False)
        for pid in p.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def two_hosts():
    s = os.getpid() % 250 + 1
    a, b = Host(f"hapoA{os.getpid()}", f"10.213.{s}.1", f"10.214.{s}.1"), Host(
        f"hapoB{os.getpid()}", f"10.213.{s}.2", f"10.215.{s}.2")
    va, vb = f"hva{os.getpid()}"[-15:], f"hvb{os.getpid()}"[-15:]
    try:
        for h in (a, b):
            _ip("netns", "add", h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for h, v in ((a, va), (b, vb)):
            _ip("link", "set", v, "netns", h.ns)
            _ip("-n", h.ns, "link", "set", v, "name", "hnet0")
            _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "hnet0")
            _ip("-n", h.ns, "link", "set", "hnet0", "up")
            # a veth pair inside the namespace (this kernel has no dummy module): a link with
            # carrier, an address, and nothing beyond it
            _ip("-n", h.ns, "link", "add", "hdecoy0", "type", "veth", "peer", "name", "hdecoy1")
            _ip("-n", h.ns, "addr", "add", f"{h.decoy_ip}/24", "dev", "hdecoy0")
            for v in ("hdecoy0", "hdecoy1"):
                _ip("-n", h.ns, "link", "set", v, "up")
        yield a, b
    finally:
        for h in (a, b):
            h.kill_all()
            _ip("netns", "del", h.ns, check=False)  # removes the veth pairs with it
