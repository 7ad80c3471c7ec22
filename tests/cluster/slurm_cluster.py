"""A real Slurm cluster on localhost for the tests: munged + slurmctld + slurmd, state in a temp dir.

Debian's ``slurm-wlm`` and ``munge`` (installed by .ci/run). Two node names (``n1``, ``n2``)
run as two ``slurmd -N`` daemons on this host, so multi-node jobs get two "nodes".
Must run as root (slurmd and munged want to). Comes up in a few seconds.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import time
from pathlib import Path

from hapo_openrlhf.cluster.ports import rendezvous_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


def available() -> str | None:
    """None when a cluster can be started here, else the reason."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm/munge not installed (missing {missing}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the test Slurm cluster must run as root"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 2, gpu_nodes: int = 8):
        self.root = Path(root)
        self.nodes = nodes
        self.cpus = cpus
        # configured-only nodes (no slurmd): a "gpu" partition of 8 x 8-GPU nodes, so that
        # `sbatch --test-only` can check the paper-scale scripts against a real controller
        self.gpu_nodes = gpu_nodes
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    def start(self) -> "SlurmCluster":
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = r / "munge" / "munge.socket"
        self.procs.append(subprocess.Popen(
            [_exe("munged"), "-F", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={r / 'munge' / 'munged.pid'}", f"--seed-file={r / 'munge' / 'seed'}",
             f"--log-file={r / 'log' / 'munged.log'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        user = getpass.getuser()
        ctl_port = rendezvous_port("127.0.0.1")
        lines = [
            "ClusterName=hapotest", "SlurmctldHost=localhost", f"SlurmctldPort={ctl_port}",
            f"SlurmUser={user}", f"SlurmdUser={user}", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={sock},cred_expire=10", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ReturnToService=2", "MpiDefault=none", "SchedulerType=sched/backfill", "JobRequeue=1",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "MinJobAge=600", "KillWait=5",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MaxJobCount=1000", "GresTypes=gpu", "SuspendProgram=/bin/true", "ResumeProgram=/bin/true",
            "SuspendTime=600", "ResumeTimeout=600", f"SuspendExcNodes={','.join(self.nodes)}",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={rendezvous_port('127.0.0.1')} "
                         f"CPUs={self.cpus} RealMemory=4000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
                     f"OverSubscribe=YES")
        if self.gpu_nodes:
            lines.append(f"NodeName=g[1-{self.gpu_nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=128 "
                         f"Gres=gpu:8 RealMemory=1000000 State=CLOUD")
            lines.append(f"PartitionName=gpu Nodes=g[1-{self.gpu_nodes}] MaxTime=INFINITE State=UP")
        conf = r / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        self.env = {"SLURM_CONF": str(conf)}
        env = {**os.environ, **self.env}
        for n in self.nodes:
            (r / "spool" / n).mkdir(exist_ok=True)
        self.procs.append(subprocess.Popen([_exe("slurmctld"), "-D", "-i", "-f", str(conf)], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for n in self.nodes:
            self.procs.append(subprocess.Popen([_exe("slurmd"), "-D", "-N", n, "-f", str(conf)], env=env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait_idle(60)
        return self

    def run(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        p = subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True, text=True, **kw)
        if check and p.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr}")
        return p

    def _wait_idle(self, timeout: float) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            p = self.run("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t", check=False)
            states = dict(ln.split() for ln in p.stdout.splitlines() if ln.strip())
            if p.returncode == 0 and len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        logs = "\n".join(f.read_text()[-2000:] for f in (self.root / "log").glob("*.log"))
        raise RuntimeError(f"Slurm did not come up in {timeout}s: {p.stdout} {p.stderr}\n{logs}")

    def job_state(self, job_id: str) -> dict[str, str]:
        p = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        out = {}
        for tok in p.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                out[k] = v
        return out

    def wait_for(self, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=900) -> dict:
        t0 = time.time()
        while time.time() - t0 < timeout:
            st = self.job_state(job_id)
            if st.get("JobState") in states:
                return st
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {self.job_state(job_id)}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
