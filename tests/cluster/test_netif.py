"""cluster/netif.py and cluster/ray_node.py on this host (the two-host behaviour is
tests/cluster/test_two_hosts.py)."""

import socket

import pytest

from hapo_openrlhf.cluster.netif import (
    NetworkInterfaceError,
    check_process_env,
    check_reaches,
    interface_ip,
    interfaces,
    socket_env,
)
from hapo_openrlhf.cluster.ray_node import prepare


def test_interface_ip_resolves_or_names_the_interfaces():
    assert interface_ip("lo") == "127.0.0.1"
    assert interfaces()["lo"] == "127.0.0.1"
    with pytest.raises(NetworkInterfaceError, match=r"nosuch0: the interface does not exist on node .*lo \(127"):
        interface_ip("nosuch0")
    for hostile in ("eth0; rm -rf /", "..", ".", "../ib0", "ib 0", "ib0\n", "x" * 16, "x" * 100_000, ""):
        with pytest.raises(NetworkInterfaceError, match="not a network interface name"):
            interface_ip(hostile)


@pytest.mark.parametrize("env, message", [
    ({"GLOO_SOCKET_IFNAME": "nosuch0"}, r"GLOO_SOCKET_IFNAME nosuch0: the interface does not exist"),
    ({"GLOO_SOCKET_IFNAME": "lo,nosuch1"}, r"GLOO_SOCKET_IFNAME nosuch1"),
    ({"NCCL_SOCKET_IFNAME": "=nosuch0"}, r"NCCL_SOCKET_IFNAME nosuch0"),
    ({"NCCL_SOCKET_IFNAME": "zz"}, r"NCCL_SOCKET_IFNAME=zz: no interface of node .* starts with 'zz'"),
])
def test_a_process_refuses_socket_variables_naming_missing_interfaces(env, message):
    with pytest.raises(NetworkInterfaceError, match=message):
        check_process_env(env)


@pytest.mark.parametrize("env", [{}, {"GLOO_SOCKET_IFNAME": "lo"}, {"NCCL_SOCKET_IFNAME": "^docker,lo"},
                                 {"NCCL_SOCKET_IFNAME": "l"}, {"NCCL_SOCKET_IFNAME": "=lo", "GLOO_SOCKET_IFNAME": "lo"}])
def test_a_process_accepts_socket_variables_of_its_interfaces(env):
    check_process_env(env)


def test_the_megatron_actor_checks_its_interface_before_its_process_group(monkeypatch):
    """A misnamed interface fails in ``_build_model`` before ``init_process_group`` (which
    would leave the other ranks waiting out the group timeout)."""
    pytest.importorskip("megatron.core")
    import tests.integrations.openrlhf.conftest  # noqa: F401  (import stubs)

    pytest.importorskip("openrlhf")
    import torch.distributed as dist

    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    actor = MegatronPolicyActorImpl(2, 0, "127.0.0.1", 1)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    args = type("A", (), {"hapo": {"megatron": {"tensor_parallel": 1, "pipeline_parallel": 1}},
                          "ds": type("D", (), {"ring_attn_size": 1, "tensor_parallel_size": 1})})
    with pytest.raises(NetworkInterfaceError, match="GLOO_SOCKET_IFNAME nosuch0"):
        actor._build_model(type("S", (), {"args": args}), "/unused")
    assert not dist.is_initialized()


def test_reachability_probe_passes_on_refusal_and_fails_unreachable():
    with socket.socket() as s:  # a port nobody listens on: refused, so the route works
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_reaches("127.0.0.1", port, "127.0.0.1", "lo", timeout_s=2)
    with pytest.raises(NetworkInterfaceError, match=r"--network-interface lo: node .* cannot reach 192\.0\.2\.77"):
        check_reaches("192.0.2.77", 9, "127.0.0.1", "lo", timeout_s=2)  # from loopback nothing leaves


def test_ray_node_adds_the_address_and_the_socket_variables():
    cmd, env = prepare("lo", ["ray", "start", "--head", "--port", "6379"], {"PATH": "/bin"})
    assert cmd == ["ray", "start", "--head", "--port", "6379", "--node-ip-address", "127.0.0.1"]
    assert env == {"PATH": "/bin", **socket_env("lo", "127.0.0.1")}
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo" and env["VLLM_HOST_IP"] == "127.0.0.1"
    with pytest.raises(NetworkInterfaceError, match="a loopback interface"):  # a worker: peers must reach it
        prepare("lo", ["ray", "start", "--address=10.0.0.1:6379"], {})
    assert prepare(None, ["ray", "start", "--head"], {"X": "1"}) == (["ray", "start", "--head"], {"X": "1"})


def test_ray_node_cli_exits_with_the_named_error(capsys):
    from hapo_openrlhf.cluster.ray_node import main

    assert main(["--interface", "nosuch0", "--", "ray", "start", "--head"]) == 2
    assert "hapo ray_node: error: NetworkInterfaceError: --network-interface nosuch0" in capsys.readouterr().err
