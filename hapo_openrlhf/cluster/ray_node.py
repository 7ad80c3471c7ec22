"""One Ray node's start, on the node itself: ``python -m hapo_openrlhf.cluster.ray_node
[--interface NAME] -- ray start ...``.

The job runs it for the head (on the batch node) and, through ``srun``, for the worker on
every other node, because only the node itself knows its address on the named interface.
With ``--interface`` it

1. resolves the interface's IPv4 address here, or exits naming the interface and the ones
   this node has;
2. for a worker, opens a connection from that address to the head's port: a node that
   cannot reach the head through the interface exits with that reason instead of
   registering an address its peers cannot reach (the first collective would hang);
3. adds ``--node-ip-address`` and the socket variables of ``netif.socket_env`` to the
   environment of ``ray start``, which every Ray worker process on the node inherits.

Without ``--interface`` it warns when the node has several candidate interfaces, then
starts Ray unchanged.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .netif import NetworkInterfaceError, candidates, check_not_loopback, check_reaches, interface_ip, socket_env


def _head_address(ray_args: list[str]) -> tuple[str, int] | None:
    for i, a in enumerate(ray_args):
        value = ray_args[i + 1] if a == "--address" and i + 1 < len(ray_args) else (
            a.split("=", 1)[1] if a.startswith("--address=") else None)
        if value:
            host, _, port = value.rpartition(":")
            return host, int(port)
    return None


def prepare(interface: str | None, ray_cmd: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment to exec (raises :class:`NetworkInterfaceError`)."""
    env = dict(environ)
    if not interface:
        found = candidates()
        if len(found) > 1:
            print(f"hapo ray_node: warning: node {socket.gethostname()} has several interfaces "
                  f"({', '.join(f'{n} {a}' for n, a in found.items())}) and none is named; Ray, gloo and NCCL "
                  f"may each pick another one. Pass --network-interface to hapo submit.", file=sys.stderr, flush=True)
        return ray_cmd, env
    ip = interface_ip(interface)
    head = _head_address(ray_cmd)
    if head is not None:  # a worker: its peers must reach it, and it the head
        check_not_loopback(interface, ip)
        check_reaches(head[0], head[1], ip, interface)
    env.update(socket_env(interface, ip))
    return [*ray_cmd, "--node-ip-address", ip], env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hapo_openrlhf.cluster.ray_node")
    ap.add_argument("--interface", default=None)
    ap.add_argument("ray_cmd", nargs=argparse.REMAINDER, help="-- ray start ...")
    a = ap.parse_args(argv)
    cmd = a.ray_cmd[1:] if a.ray_cmd[:1] == ["--"] else a.ray_cmd
    if not cmd:
        ap.error("no ray command after --")
    try:
        cmd, env = prepare(a.interface, cmd, dict(os.environ))
    except NetworkInterfaceError as e:
        print(f"hapo ray_node: error: NetworkInterfaceError: {e}", file=sys.stderr, flush=True)
        return 2
    os.execvpe(cmd[0], cmd, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
