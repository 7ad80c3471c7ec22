"""Two hosts with different addresses on this machine (tests/cluster/netns.py): network
namespaces joined by veth, each with a decoy interface the other cannot reach.

* The job's bring-up (``RayCluster`` + ``cluster/ray_node.py``) with ``--network-interface
  hnet0`` registers the Ray head on host A and the worker on host B at their hnet0
  addresses; one DP=2 step of the Megatron policy actor then runs with rank 0 on A and
  rank 1 on B: OpenRLHF's ``MASTER_ADDR`` is A's hnet0 address, both ranks' gloo groups
  (torch's and megatron-core's data-parallel gloo group) go through hnet0, and the two
  replicas hold identical, updated weights afterwards.
* A wrong interface -- one host B lacks, B's decoy (no route to A), loopback -- is a
  ``NetworkInterfaceError`` naming the interface, within the bring-up, never a hang.
* ``hapo doctor`` on a host with several interfaces and none named warns.

Nothing before this test ran two "nodes" at different addresses: every other multi-node
test is 127.0.0.1.
"""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.netns import two_hosts, why_unavailable

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("two_hosts_job.py")

_why = why_unavailable()
if _why:
    if os.environ.get("HAPO_REQUIRE_NETNS") == "1":
        raise RuntimeError(f"HAPO_REQUIRE_NETNS=1 but {_why}")
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as ab:
        yield ab


def _job(a, b, out: Path, interface: str, *extra: str, port: int = 6391) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # the bring-up's own timeout (300 s) is longer than this one: a hang fails as TimeoutExpired
    p = subprocess.run([*a.exec_prefix(), sys.executable, str(JOB), str(out), b.ns, interface, str(port), "300", *extra],
                       capture_output=True, text=True, timeout=240 if not extra else 900, env=env, cwd=REPO)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("interface, message", [
    ("nosuch0", r"NetworkInterfaceError: --network-interface nosuch0: the interface does not exist on node"),
    ("hdecoy0", r"workers start exited with 2: NetworkInterfaceError: --network-interface hdecoy0: node .* cannot "
                r"reach 10\.214\.\d+\.1:\d+ from hdecoy0 \(10\.215\.\d+\.2\): Network is unreachable.*"
                r"hnet0 \(10\.213\.\d+\.2\)"),
    ("lo", r"NetworkInterfaceError: --network-interface lo: a loopback interface \(127\.0\.0\.1\)"),
])
def test_a_wrong_interface_is_a_named_error_not_a_hang(hosts, tmp_path, interface, message):
    import re

    a, b = hosts
    res = _job(a, b, tmp_path, interface)
    assert re.search(message, res.get("error", "")), res
    assert not subprocess.run(["ip", "netns", "pids", b.ns], capture_output=True, text=True).stdout.strip()


def test_doctor_warns_when_several_interfaces_and_none_named(hosts):
    a, _ = hosts
    code = ("import json; from hapo_openrlhf.cluster.doctor import check_network as c; "
            "print(json.dumps([vars(c(None)), vars(c('hnet0')), vars(c('hdecoy1'))]))")
    p = subprocess.run([*a.exec_prefix(), sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    unnamed, named, no_address = json.loads(p.stdout)
    assert unnamed["status"] == "warn" and "several interfaces" in unnamed["message"], unnamed
    assert f"hdecoy0 ({a.decoy_ip})" in unnamed["message"] and f"hnet0 ({a.ip})" in unnamed["message"]
    assert "--network-interface" in unnamed["fix"]
    assert named["status"] == "ok" and f"hnet0 -> {a.ip}" in named["message"], named
    assert no_address["status"] == "fail" and "hdecoy1: the interface has no IPv4 address" in no_address["message"]


def test_one_dp2_megatron_step_across_two_hosts(hosts, tmp_path):
    import tests.integrations.openrlhf.conftest  # noqa: F401  (the vllm / flash_attn import stubs, when absent)

    pytest.importorskip("openrlhf")
    from tests.integrations.openrlhf.test_megatron_actor import _args, _experiences, _tiny_model_dir

    a, b = hosts
    _, args = _args(tmp_path, ["megatron.tensor_parallel=1", "megatron.pipeline_parallel=1",
                               "openrlhf.actor_gpus_per_node=1", "openrlhf.actor_num_nodes=2"])
    exps = _experiences(2, seed=3)
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps({"args": args, "model_dir": str(_tiny_model_dir(tmp_path / "m", tied=False)),
                                      "per_rank": [exps[:1], exps[1:]]}))
    res = _job(a, b, tmp_path / "job", "hnet0", "--train", str(payload), port=6392)
    assert "error" not in res, res["error"]
    assert sorted(n["ip"] for n in res["nodes"]) == [a.ip, b.ip]
    assert res["driver_env"]["GLOO_SOCKET_IFNAME"] == "hnet0" and res["driver_env"]["VLLM_HOST_IP"] == a.ip
    r0, r1 = sorted(res["ranks"], key=lambda r: r["rank"])
    assert (r0["node_ip"], r1["node_ip"]) == (a.ip, b.ip)  # one rank per host
    assert r0["master_addr"] == r1["master_addr"] == a.ip  # OpenRLHF's MASTER_ADDR: rank 0's node address
    for r in (r0, r1):  # inherited from each host's `ray start` (ray_node.py), not from the driver
        assert (r["gloo_ifname"], r["nccl_ifname"], r["backend"]) == ("hnet0", "hnet0", "gloo")
        assert r["gloo_dp_sum"] == 3.0  # megatron-core's gloo DP group spans both hosts: 1 + 2
    assert r0["status"]["policy_loss"] == pytest.approx(r1["status"]["policy_loss"])
    assert r0["weights"] == r1["weights"] != r0["weights_before"]  # both replicas took the same reduced step
