"""What the checks share: a logged child process, a one-rank job, the peak memory of a call."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path



def run(cmd: list[str], log: Path, timeout: int = 900, env: dict | None = None) -> int:
    import subprocess

    with open(log, "ab") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})}).returncode


def peak(fn):
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t0


def one_rank_child(log: Path, code: str) -> tuple[int | None, dict]:
    """Run ``code`` in a child Python as rank 0 of a one-rank job (its ``MASTER_PORT`` from
    ``cluster.ports.rendezvous_port``: no fixed port to collide with another job on the node); it
    prints one JSON line last.
    (exit code, that object), or (None, a failure naming the log) when no JSON came back."""
    from ..cluster.ports import rendezvous_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous_port("127.0.0.1")), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    rc = run([sys.executable, "-c", code], log, timeout=600, env=env)
    lines = log.read_text().strip().splitlines() if log.exists() else []
    try:
        return rc, json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return None, {"ok": False, "error": f"exit {rc}; see {log}"}


def one_rank_job(device: str, cp: int = 1) -> bool:
    """torch.distributed (from the environment, NCCL on CUDA else gloo) and Megatron's parallel
    state at TP = PP = 1 (and ``cp`` context-parallel ranks: the job's world), unless they are up;
    whether ``device`` is CUDA."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    return cuda


def check_in_child(work: Path, check: str, needs: tuple[str, ...]) -> dict:
    """``gpu_smoke.<check>('cuda')`` in a child Python as a one-rank job on one GPU (its log
    ``work/<check>.log``); skipped, saying so, without the packages in ``needs``."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in needs):
        return {"ok": True, "skipped": f"needs {' and '.join(needs)}"}
    code = f"import json; from hapo_openrlhf.gpu_smoke import {check}; print(json.dumps({check}('cuda')))"
    rc, res = one_rank_child(work / f"{check}.log", code)
    if rc is None:
        return res
    return {**res, "ok": rc == 0 and res["ok"]}


def ranks_child(work: Path, name: str, code: str, *, world: int) -> tuple[list[int], dict]:
    """Run ``code`` in ``world`` child Pythons, one GPU each (RANK / LOCAL_RANK / WORLD_SIZE set, a
    ``MASTER_PORT`` from ``cluster.ports.rendezvous_port``, logs
    ``work/<name>_rank<r>.log``); rank 0 prints one JSON line last. (exit codes, that object)."""
    import subprocess

    from ..cluster.ports import rendezvous_port

    procs, logs = [], [work / f"{name}_rank{r}.log" for r in range(world)]
    port = rendezvous_port("127.0.0.1")
    for rank, log in enumerate(logs):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        with open(log, "w") as f:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env))
    try:
        rcs = [p.wait(timeout=600) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [-1] * world, {"ok": False, "error": f"timed out; see {logs[0]}"}
    lines = logs[0].read_text().strip().splitlines() if logs[0].exists() else []
    try:
        return rcs, json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return rcs, {"ok": False, "error": f"exit {rcs}; see {logs}"}
