"""Network interfaces: the one a multi-node run names, and the environment that sends every
process's traffic through it.

On nodes with several interfaces (management Ethernet, InfiniBand, a container bridge)
each library picks its own address unless told: Ray the default route's, gloo the
address the host name resolves to, NCCL the first interface that is not ``lo`` or
``docker*``. One of them can be an address the other nodes cannot reach, and the job
hangs in its first collective. ``--network-interface NAME`` (``hapo submit``) names the
interface once; :func:`socket_env` turns it into

* Ray's node address (``ray start --node-ip-address``, set by ``cluster/ray_node.py`` on
  every node, so ``get_node_ip_address()`` -- OpenRLHF's ``MASTER_ADDR`` -- is that
  interface's address),
* ``GLOO_SOCKET_IFNAME`` (torch's gloo groups, megatron-core's gloo data-parallel groups),
* ``NCCL_SOCKET_IFNAME`` (NCCL's bootstrap and socket transport, the vLLM weight sync),
* ``VLLM_HOST_IP`` (vLLM's own address),

in the environment of the ``ray start`` on every node, which every Ray worker -- the
actors, the vLLM engines -- inherits, and of the training driver.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import struct

SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_SIOCGIFADDR = 0x8915


class NetworkInterfaceError(ValueError):
    """A named network interface that this node lacks, has no IPv4 address on, or cannot
    reach the other nodes through."""


def check_name(name: str, option: str = "--network-interface") -> str:
    # Linux's own rule (dev_valid_name): at most 15 bytes, no "/" or whitespace, not "." or ".."
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise NetworkInterfaceError(f"{option} {name!r} is not a network interface name")
    return name


def _ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str | None]:
    """Every interface of this node (in this network namespace) -> its IPv4 address or None."""
    return {name: _ipv4(name) for _, name in socket.if_nameindex()}


def candidates() -> dict[str, str]:
    """Interfaces another node could reach this one through: an IPv4 address, not loopback."""
    return {n: ip for n, ip in interfaces().items() if ip and not ip.startswith("127.")}


def interface_ip(name: str, option: str = "--network-interface") -> str:
    """IPv4 address of interface ``name`` on this node, or a :class:`NetworkInterfaceError`
    naming the node and the interfaces it does have."""
    check_name(name, option)
    ip = _ipv4(name)
    if ip is None:
        have = ", ".join(f"{n} ({a})" if a else n for n, a in interfaces().items())
        what = "has no IPv4 address" if name in interfaces() else "does not exist"
        raise NetworkInterfaceError(f"{option} {name}: the interface {what} on node {socket.gethostname()}; "
                                    f"its interfaces: {have}")
    return ip


def socket_env(name: str, ip: str) -> dict[str, str]:
    """The variables that pin every library's sockets to interface ``name`` (address ``ip``)."""
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name, "VLLM_HOST_IP": ip,
            "HAPO_NETWORK_INTERFACE": name}


def check_not_loopback(name: str, ip: str) -> None:
    """Several nodes cannot meet on a loopback address: each node's 127.0.0.1 is itself."""
    if ip.startswith("127."):
        raise NetworkInterfaceError(f"--network-interface {name}: a loopback interface ({ip}); the other nodes "
                                    f"cannot reach node {socket.gethostname()} through it (candidates here: "
                                    f"{', '.join(f'{n} ({a})' for n, a in candidates().items()) or 'none'})")


def check_reaches(host: str, port: int, source_ip: str, name: str, timeout_s: float = 10.0) -> None:
    """Open a TCP connection to ``host:port`` from ``source_ip`` (interface ``name``).

    A refused connection proves the route both ways (the peer answered), so it passes even
    before the peer listens; a timeout or an unreachable network means the other nodes
    cannot reach this one through ``name`` -- every collective would hang, so this fails
    now, naming the interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.bind((source_ip, 0))
            s.connect((host, port))
        except ConnectionRefusedError:
            return
        except OSError as e:  # a timeout (TimeoutError is an OSError) or an unreachable network
            why = f"no answer within {timeout_s:.0f} s" if e.errno in (None, errno.ETIMEDOUT) else e.strerror
            raise NetworkInterfaceError(
                f"--network-interface {name}: node {socket.gethostname()} cannot reach {host}:{port} from "
                f"{name} ({source_ip}): {why}; name an interface every node shares a network on "
                f"(candidates here: {', '.join(f'{n} ({a})' for n, a in candidates().items()) or 'none'})"
            ) from None


def check_process_env(environ: dict[str, str] | None = None) -> None:
    """In a training process, before its first process group: every interface that
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` names exists here with an address (gloo
    would fail on one rank while its peers wait out the group timeout). NCCL's ``^prefix``
    (exclude) and ``=name`` (exact) forms are understood; prefixes are NCCL's to match."""
    env = os.environ if environ is None else environ
    for var in SOCKET_ENV:
        value = env.get(var, "").strip()
        if not value or value.startswith("^"):
            continue
        for item in value.split(","):
            item = item.strip()
            if var == "NCCL_SOCKET_IFNAME" and not item.startswith("="):
                if not any(n.startswith(item) and a for n, a in interfaces().items()):
                    raise NetworkInterfaceError(f"{var}={value}: no interface of node {socket.gethostname()} "
                                                f"starts with {item!r} (interfaces: {', '.join(interfaces())})")
                continue
            interface_ip(item.lstrip("="), option=var)
