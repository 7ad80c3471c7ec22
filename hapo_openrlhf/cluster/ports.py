"""The rendezvous port rank 0 of an actor group announces: one outside the kernel's ephemeral range.

OpenRLHF 0.11.2's ``BaseDistributedActor._get_free_port`` binds port 0 and closes the socket:
the kernel hands out a port from its *ephemeral* range (``net.ipv4.ip_local_port_range``,
32768-60999 on Linux by default), and rank 0 binds it again only when ``init_process_group``
starts its TCPStore -- after the other actors are placed and have imported torch, seconds to
minutes later. In that window every outgoing connection on the node (Ray's gRPC clients,
vLLM's ZMQ sockets) and every other ``bind(port 0)`` (each gloo pair listens on one) draws from
the same range, and one of them can take the port: rank 0 then fails with ``EADDRINUSE`` and
the job dies before its first step. The test suite hit exactly this on a busy node (a Megatron
actor, port 38983).

:func:`rendezvous_port` picks a port that binds now and lies outside the ephemeral range (and
above Ray's default worker ports, 10002-19999), so nothing the kernel assigns on its own can
take it; only a process that names that very port can. Where nothing outside the range binds, it
falls back to upstream's choice. :class:`OutsideEphemeralPort` puts it under the policy,
reference and PRM actors' ``_get_free_port``.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL = (49152, 65535)  # where the kernel has no such file (macOS, BSD)
LOWEST = 20000  # Ray's worker ports are 10002-19999 by default (ray start --min/max-worker-port)


def ephemeral_range(path: Path = RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), IANA's where the file is absent or unreadable."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return IANA_EPHEMERAL
    return (lo, hi) if 0 < lo <= hi <= 65535 else IANA_EPHEMERAL


def candidate_ports(ephemeral: tuple[int, int]) -> list[int]:
    """Every port from :data:`LOWEST` to 65535 outside ``ephemeral`` (inclusive bounds)."""
    lo, hi = ephemeral
    return [p for p in range(LOWEST, 65536) if not lo <= p <= hi]


def _binds(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def rendezvous_port(host: str = "", tries: int = 64, rng: random.Random | None = None,
                    range_file: Path = RANGE_FILE) -> int:
    """A port that binds on ``host`` now, drawn at random from outside the ephemeral range
    (``tries`` draws); where none of them binds, an ephemeral one as upstream picks it."""
    rng = rng or random.SystemRandom()
    ports = candidate_ports(ephemeral_range(range_file))
    for port in rng.sample(ports, min(tries, len(ports))):
        if _binds(port, host):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OutsideEphemeralPort:
    """Mixin before OpenRLHF's ``BaseDistributedActor`` in an actor's bases: rank 0's
    ``MASTER_PORT`` comes from :func:`rendezvous_port`."""

    @staticmethod
    def _get_free_port() -> int:
        return rendezvous_port()
