"""Shared by the end-to-end tests: launch ``shim/run_e2e.py`` (OpenRLHF's loop on CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

HERE = Path(__file__).resolve().parent
RUN = HERE / "shim" / "run_e2e.py"
CFG = HERE / "e2e_tiny.yaml"


def run_e2e(out, dump, sets, **env):
    """One launch of the e2e config with ``--set`` overrides; hapo's dumps go to ``dump``.
    (DeepSpeed JIT-builds its CPU Adam / shm ops once into TORCH_EXTENSIONS_DIR.)"""
    full_env = {**os.environ, "HAPO_OPENRLHF_DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", **env}
    args = [sys.executable, str(RUN), str(CFG), str(out)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=1200)


def jsonl(path):
    return [json.loads(ln) for ln in Path(path).read_text().splitlines()]
