"""TEST-ONLY: what ``cluster/job.py`` does on a multi-node allocation, run inside host A of
``tests/cluster/netns.py``: ``RayCluster`` starts the Ray head here and the Ray worker on
host B (through ``ip netns exec B`` where Slurm would use ``srun``), both through
``cluster/ray_node.py`` with ``--network-interface``. Then, with ``--train``, a driver
process with the job's ``driver_env`` runs one DP=2 step of the Megatron policy actor:
OpenRLHF's ``RayActorGroup`` places rank 0 on A and rank 1 on B (one logical GPU per host).

Prints one JSON line: {"nodes": [...], "ranks": [...]} or {"error": "..."}.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "tests" / "integrations" / "openrlhf" / "shim"


def bring_up(out: Path, host_b_ns: str, interface: str, port: int, timeout_s: float):
    from hapo_openrlhf.cluster.ray_cluster import RayCluster

    return RayCluster(["hostA", "hostB"], port=port, timeout_s=timeout_s, num_gpus=1, num_cpus=1, log_dir=out,
                      interface=interface, worker_launcher=["ip", "netns", "exec", host_b_ns]).start()


def train(payload: Path) -> list[dict]:
    """In the driver process: one DP=2 step across the two hosts."""
    import hashlib

    sys.path[:0] = [str(SHIM), str(REPO)]
    import hapo_cpu_shim

    sys.path[:0] = hapo_cpu_shim.stub_path()
    import ray
    import torch
    from openrlhf.trainer.ray.launcher import RayActorGroup

    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    data = pickle.loads(payload.read_bytes())

    class Strategy:
        def __init__(self, args):
            self.args = args

        def is_rank_0(self):
            import torch.distributed as dist

            return dist.get_rank() == 0

    class Probe(MegatronPolicyActorImpl):
        def network(self) -> dict:
            """Where this rank runs and what its gloo groups went through."""
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t, group=ps.get_data_parallel_group_gloo())  # megatron-core's own gloo DP group
            weights = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes()
                                              for p in self.model.parameters())).hexdigest()
            return {"rank": dist.get_rank(), "node_ip": ray.util.get_node_ip_address(),
                    "master_addr": os.environ["MASTER_ADDR"], "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                    "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"), "gloo_dp_sum": float(t),
                    "backend": dist.get_backend(), "weights": weights}

    pythonpath = os.pathsep.join([str(SHIM), str(REPO), *hapo_cpu_shim.stub_path()])
    env = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "DS_BUILD_OPS": "0", "TOKENIZERS_PARALLELISM": "false",
           "HAPO_SHIM_MEGATRON": "1"}
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR",
             runtime_env={"env_vars": env, "worker_process_setup_hook": "hapo_cpu_shim.install"})
    try:
        group = RayActorGroup(2, 1, ray.remote(num_gpus=1)(Probe), num_gpus_per_actor=1)
        ray.get(group.async_init_model_from_pretrained(Strategy(data["args"]), data["model_dir"], 4, None))
        actors = group._actor_handlers
        before = ray.get([a.network.remote() for a in actors])
        for a, mine in zip(actors, data["per_rank"]):
            for e in mine:
                lp = ray.get(a.forward.remote(e.sequences, e.action_mask, e.attention_mask))
                e.action_log_probs = lp - 0.1 * e.advantages
                ray.get(a.append.remote(e))
        status = ray.get([a.fit.remote(0.0) for a in actors])
        after = ray.get([a.network.remote() for a in actors])
        return [{**n, "status": s, "weights_before": b["weights"]} for n, s, b in zip(after, status, before)]
    finally:
        ray.shutdown()


def main() -> int:
    out, host_b_ns, interface, port = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    timeout_s = float(sys.argv[5])
    if sys.argv[6:7] == ["--driver"]:
        print(json.dumps({"ranks": train(Path(sys.argv[7]))}), flush=True)
        return 0
    try:
        cluster = bring_up(out, host_b_ns, interface, port, timeout_s)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    result: dict = {"nodes": cluster.nodes, "driver_env": cluster.driver_env()}
    try:
        if sys.argv[6:7] == ["--train"]:
            env = {**os.environ, **cluster.driver_env()}
            p = subprocess.run([sys.executable, __file__, *sys.argv[1:6], "--driver", sys.argv[7]], env=env,
                               capture_output=True, text=True, timeout=600)
            if p.returncode:
                result["error"] = f"driver exited {p.returncode}: {p.stderr[-4000:]}"
            else:
                result.update(json.loads(p.stdout.strip().splitlines()[-1]))
    finally:
        cluster.stop()
    print(json.dumps(result, default=str), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
