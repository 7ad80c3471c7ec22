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


def check_registry_advantages_reached_loss(dump, step, loss_rows, rows_per_step=16):
    """For one global step of the e2e config (HAPO alpha 0.2, phi 2, z-score): the dumped
    advantages are the registry's for the dumped batch, and the rows that reached the loss
    carry exactly the advantages of their experience rows (identical samples share them).
    Returns the dumped batch and the experience rows."""
    import pytest
    import torch

    from hapo_openrlhf import algos

    d = torch.load(Path(dump) / f"advantages_step{step}.pt")
    inputs = algos.AdvantageInputs(rewards=d["rewards"], response_mask=d["response_mask"], entropy=d["entropy"],
                                   group_index=d["group_index"])
    want = algos.run_estimator("hapo", inputs, alpha=0.2, phi=2.0, normalize="zscore").advantages
    torch.testing.assert_close(d["advantages"], want)
    exp_rows = jsonl(Path(dump) / f"experiences_step{step}.jsonl")
    by_tokens = {tuple(r["tokens"]): r["advantages"] for r in exp_rows}
    got = loss_rows[(step - 1) * rows_per_step: step * rows_per_step]
    assert sorted(tuple(r["tokens"]) for r in got) == sorted(tuple(r["tokens"]) for r in exp_rows)
    for r in got:
        assert r["advantages"] == pytest.approx(by_tokens[tuple(r["tokens"])], abs=1e-6)
    return d, exp_rows
