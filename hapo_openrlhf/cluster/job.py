"""The sbatch step: (Ray bring-up,) train, and on a stop signal checkpoint + requeue.

    python -m hapo_openrlhf.cluster.job --config C --output-dir OUT [--set k=v ...]

Run by the script ``hapo submit`` renders (``exec``-ed, so this process is the batch
shell and receives ``--signal=B:USR1@<s>``). On every start it logs
``SLURM_RESTART_COUNT`` and trains with ``--resume`` semantics (the newest complete
checkpoint, or from scratch when there is none). On SIGUSR1/SIGTERM it asks the
trainer to checkpoint at the next step boundary (local: the signal is forwarded;
OpenRLHF: a flag file the controller checks after each global step); when the
trainer exits after a USR1 it runs ``scontrol requeue`` -- at most ``--max-requeues``
times -- and exits 0; after a SIGTERM (plain ``scancel``, hard limit, scheduler
preemption) it only checkpoints and stops. Events go to ``OUT/slurm_events.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..config import load_config
from ..rundir.preemption import EXIT_PREEMPTED, on_stop_signal, request_flag


class Events:
    def __init__(self, path: Path):
        self.path = path

    def log(self, event: str, **kw) -> None:
        row = {"time": time.time(), "event": event, "job_id": _job_id(),
               "restart_count": int(os.environ.get("SLURM_RESTART_COUNT") or 0), **kw}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"hapo job: {json.dumps(row)}", flush=True)


def _job_id() -> str | None:
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    return os.environ.get("SLURM_JOB_ID")


def _train_command(backend: str, config: str, out: Path, sets: list[str]) -> list[str]:
    s = [x for kv in sets for x in ("--set", kv)]
    if backend == "local":
        return [sys.executable, "-m", "hapo_openrlhf", "train", "--config", config, "--output-dir", str(out), "--resume", *s]
    if backend in ("openrlhf", "megatron"):  # resumes on its own (--ckpt.load_enable)
        return [sys.executable, "-m", "hapo_openrlhf.integrations.openrlhf.launch.train", "--config", config,
                "--output-dir", str(out), *s]
    raise ValueError(f"backend {backend!r} cannot run under Slurm yet")


RAY_PROBE = ("import json, ray; ray.init(); "
             "print(json.dumps({'ray_nodes': sum(n['Alive'] for n in ray.nodes()), "
             "'ray_gpus': ray.cluster_resources().get('GPU', 0)}))")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hapo_openrlhf.cluster.job")
    ap.add_argument("--config", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--max-requeues", type=int, default=20)
    ap.add_argument("--array-sets", default=None, help="JSON list of {suffix, sets}, indexed by SLURM_ARRAY_TASK_ID")
    ap.add_argument("--ray-port", type=int, default=6379)
    ap.add_argument("--ray-timeout", type=float, default=300)
    ap.add_argument("--ray-check", action="store_true", help="bring Ray up on every node, report, exit (no training)")
    ap.add_argument("--ray-num-gpus", type=int, default=None,
                    help="GPUs every Ray node advertises and must register (default: SLURM_GPUS_PER_NODE)")
    ap.add_argument("--network-interface", "--ray-interface", dest="network_interface", default=None,
                    help="the interface every node's Ray, gloo and NCCL traffic uses (e.g. ib0; cluster/netif.py)")
    return ap


def _start_ray(a: argparse.Namespace, out: Path, events: Events):
    """Ray on every node of the allocation (``ray_cluster.RayCluster``), logged; None (the error
    logged and printed) when it does not come up."""
    from .ray_cluster import RayCluster, allocation_hosts, gpus_per_node_from_slurm

    hosts = allocation_hosts()
    gpus = a.ray_num_gpus if a.ray_num_gpus is not None else gpus_per_node_from_slurm(
        os.environ.get("SLURM_GPUS_PER_NODE"))
    cpus = int(os.environ["SLURM_CPUS_PER_TASK"]) if os.environ.get("SLURM_CPUS_PER_TASK") else None
    ray = RayCluster(hosts, a.ray_port, a.ray_timeout, log_dir=out, num_gpus=gpus, num_cpus=cpus,
                     interface=a.network_interface)
    try:
        nodes = ray.start().nodes
    except (RuntimeError, TimeoutError, ValueError) as e:
        events.log("ray_failed", error=str(e))
        print(f"hapo job: error: {e}", file=sys.stderr)
        return None
    events.log("ray_up", address=ray.address, nodes=len(nodes), gpus=sum(n.get("gpus", 0) for n in nodes),
               cpus=sum(n.get("cpus", 0) for n in nodes))
    return ray


def _after_training(stop_signal: int | None, rc: int, max_requeues: int, events: Events) -> int:
    """The job's exit status after the trainer's ``rc``, requeueing the job where the stop asks for it."""
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    # Only USR1 (the --signal=B:USR1@<s> warning, or `scancel --batch --signal=USR1`) requeues.
    # SIGTERM (a plain scancel, the hard time limit, a scheduler preemption) checkpoints and
    # stops; requeueing then is Slurm's decision (PreemptMode=REQUEUE), not the job's.
    requeue = stop_signal == signal.SIGUSR1 and rc != 0  # rc 0: training finished first
    if not requeue:
        if stop_signal is None or rc == 0:
            events.log("end", returncode=rc)
            return rc
        events.log("stopped", returncode=rc, signal=signal.Signals(stop_signal).name)
        return 0 if rc == EXIT_PREEMPTED else rc
    if restart >= max_requeues:
        events.log("requeue_limit", returncode=rc, max_requeues=max_requeues)
        print(f"hapo job: error: stopped after {restart} requeues (--max-requeues {max_requeues})", file=sys.stderr)
        return 1
    p = subprocess.run(["scontrol", "requeue", _job_id() or ""], capture_output=True, text=True)
    events.log("requeue", returncode=rc, scontrol=p.returncode, message=(p.stderr or p.stdout).strip())
    return 0 if p.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)

    out, sets = Path(a.output_dir), list(a.set)
    if a.array_sets:
        task = json.loads(a.array_sets)[int(os.environ["SLURM_ARRAY_TASK_ID"])]
        out, sets = out / task["suffix"], sets + task["sets"]
    from ..rundir import runlock

    try:
        runlock.acquire(out)  # held for the trainer too (HAPO_RUN_LOCK_HELD): one owner per run directory
    except runlock.RunDirBusy as e:
        print(f"hapo job: error: {e}", file=sys.stderr)
        return 1
    events = Events(out / "slurm_events.jsonl")
    events.log("start", nodes=os.environ.get("SLURM_JOB_NODELIST"), output_dir=str(out))
    flag = request_flag(out)
    flag.unlink(missing_ok=True)
    cfg = load_config(a.config, sets)

    state: dict = {"signal": None, "child": None}

    def on_signal(signum: int) -> None:
        if state["signal"] is None:
            events.log("stop_signal", signal=signal.Signals(signum).name)
        state["signal"] = signum
        flag.touch()  # OpenRLHF: the controller checks it after each global step
        child = state["child"]
        if child is not None and child.poll() is None and cfg.backend == "local":
            child.send_signal(signal.SIGUSR1)

    on_stop_signal(on_signal)
    if cfg.backend in ("openrlhf", "megatron") and not a.ray_check:
        # the full preflight on the node that trains, before Ray: CUDA, NCCL, packages, paths, disk
        from .doctor import FAIL, report, run_checks

        checks = run_checks(cfg, output_dir=str(out), interface=a.network_interface)
        print("hapo doctor:\n" + report(checks), flush=True)
        failed = [c.name for c in checks if c.status == FAIL]
        if failed:
            events.log("doctor_failed", checks=failed)
            return 1
    ray = None
    env = runlock.child_env(out)
    if cfg.backend in ("openrlhf", "megatron") or a.ray_check:
        ray = _start_ray(a, out, events)
        if ray is None:
            return 1
        env.update(ray.driver_env())  # RAY_ADDRESS, and the interface's socket variables when one is named
    cmd = [sys.executable, "-c", RAY_PROBE] if a.ray_check else _train_command(cfg.backend, a.config, out, sets)
    try:
        child = subprocess.Popen(cmd, env=env)
        state["child"] = child
        if state["signal"] is not None and cfg.backend == "local":  # arrived during start-up
            child.send_signal(signal.SIGUSR1)
        rc = child.wait()
    finally:
        if ray is not None:
            ray.stop()
    return _after_training(state["signal"], rc, a.max_requeues, events)


if __name__ == "__main__":
    sys.exit(main())
