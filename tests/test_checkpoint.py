import os
import random

import numpy as np
import pytest
import torch

from hapo_openrlhf.rundir.checkpoint import (
    latest_checkpoint,
    list_complete,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def test_save_load_roundtrip_and_pointer(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {0: {"w": torch.full((2,), float(step))}}, {"note": "x"}, keep_last=2)
    assert [d.name for d in list_complete(tmp_path)] == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    state, meta = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["w"].tolist() == [3.0, 3.0] and meta["step"] == 3 and meta["world_size"] == 1


def test_incomplete_checkpoint_is_skipped(tmp_path):
    save_checkpoint(tmp_path, 1, {0: {"w": 1}}, {})
    # a crash mid-save: a temp dir and a step dir without meta.json
    (tmp_path / ".tmp-step_00000002-99999").mkdir()
    (tmp_path / "step_00000002").mkdir()
    torch.save({"w": 2}, tmp_path / "step_00000002" / "shard_rank00000.pt")
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    # a stale pointer to a missing dir is ignored too
    (tmp_path / "latest").write_text("step_00000009\n")
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(tmp_path / "step_00000002")


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {0: {"w": 1}}, {})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, {0: {"w": 2}}, {})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert load_checkpoint(latest_checkpoint(tmp_path))[0] == {"w": 1}


def test_world_size_mismatch_is_a_clear_error(tmp_path):
    save_checkpoint(tmp_path, 1, {0: {}, 1: {}}, {})
    with pytest.raises(ValueError, match="saved by 2 rank\\(s\\) but this run has 1"):
        load_checkpoint(latest_checkpoint(tmp_path), rank=0, world_size=1)
    assert load_checkpoint(latest_checkpoint(tmp_path), rank=1, world_size=2)[1]["world_size"] == 2


def test_rng_state_restores_every_generator():
    st = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(st)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_resave_same_step_replaces_atomically(tmp_path):
    save_checkpoint(tmp_path, 4, {0: {"w": 1}}, {})
    save_checkpoint(tmp_path, 4, {0: {"w": 2}}, {})
    assert load_checkpoint(latest_checkpoint(tmp_path))[0] == {"w": 2}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


class _RunsCode:
    """A pickle payload: unpickling it calls ``os.system`` (what an attacker plants)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_malicious(ckpt_root, step, marker):
    """A checkpoint directory whose shard runs ``touch marker`` when unpickled, with a
    ``meta.json`` whose size and CRC-32 match it (so it verifies)."""
    import json

    from hapo_openrlhf.rundir.checkpoint import file_crc32, shard_name

    d = ckpt_root / f"step_{step:08d}"
    d.mkdir(parents=True)
    shard = d / shard_name(0)
    torch.save({"model": _RunsCode(marker)}, shard)
    meta = {"step": step, "world_size": 1, "files": {shard.name: {"size": shard.stat().st_size,
                                                                  "crc32": file_crc32(shard)}}}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_a_malicious_shard_that_verifies_is_refused_without_running(tmp_path):
    from hapo_openrlhf.rundir.checkpoint import UnsafeCheckpoint, verify_checkpoint

    marker = tmp_path / "MARKER"
    d = _plant_malicious(tmp_path / "ck", 9, marker)
    assert verify_checkpoint(d) is None  # the CRC guards against accidents, not attackers
    with pytest.raises(UnsafeCheckpoint, match="shard_rank00000.pt holds objects other than tensors"):
        load_checkpoint(d)
    assert not marker.exists()


def test_a_checkpoint_written_before_safe_loading_still_loads(tmp_path):
    """Older shards pickled numpy's RNG state as an ndarray: still readable (numeric arrays
    only), and the restored generators continue as they would have."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": None}
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    save_checkpoint(tmp_path, 1, {0: {"rng": st, "w": torch.ones(2)}}, {})
    state, _ = load_checkpoint(latest_checkpoint(tmp_path))
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_new_rng_state_needs_no_numpy_globals(tmp_path):
    torch.save(rng_state(), tmp_path / "rng.pt")
    torch.load(tmp_path / "rng.pt", weights_only=True)  # plain PyTorch, no allow-list


@pytest.mark.slow
def test_resume_never_runs_a_planted_checkpoint_and_falls_back(tmp_path):
    """Through the CLI's main (in this process, issue 57): a planted newest checkpoint that verifies
    by CRC is refused (no code runs) and the run resumes from the newest real one."""
    from tests.conftest import REPO, cli_in_process

    out, marker = tmp_path / "run", tmp_path / "MARKER"
    base = ["train", "--config", str(REPO / "configs" / "cpu_tiny.yaml"), "--output-dir", str(out)]
    small = ["warmup.steps=20", "data.synthetic.eval_size=8", "rollout.prompts_per_step=4", "trainer.save_every=2",
             "trainer.eval_every=0", "trainer.sample_every=0", "eval.n_samples=1"]
    sets = [x for kv in small for x in ("--set", kv)]
    assert cli_in_process([*base, *sets, "--set", "trainer.steps=2"]).returncode == 0
    _plant_malicious(out / "checkpoints", 9, marker)
    p = cli_in_process([*base, "--resume", *sets, "--set", "trainer.steps=3"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert not marker.exists()
    assert "step_00000009: cannot be loaded" in p.stderr and "holds objects other than tensors" in p.stderr
    assert "resumed from" in p.stderr and "(step 2)" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("meta", ["[]", '"a string"', '{"files": 5}', '{"files": {"shard_rank00000.pt": 3}}',
                                  '{"world_size": "2"}', "{torn"])
def test_a_malformed_meta_json_is_unverifiable_and_resume_falls_back(tmp_path, meta):
    from hapo_openrlhf.rundir.checkpoint import resumable_checkpoints

    save_checkpoint(tmp_path, 1, {0: {"w": 1}}, {}, keep_last=5)
    save_checkpoint(tmp_path, 2, {0: {"w": 2}}, {}, keep_last=5)
    (tmp_path / "step_00000002" / "meta.json").write_text(meta)
    good, bad = resumable_checkpoints(tmp_path)
    assert [d.name for d in good] == ["step_00000001"]
    assert len(bad) == 1 and "step_00000002" in bad[0] and "meta.json" in bad[0]
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(ValueError, match="step_00000002.*meta.json"):
        load_checkpoint(tmp_path / "step_00000002")


def test_a_file_size_limit_is_named_not_called_a_full_disk(tmp_path):
    """torch.save fails the same way for ENOSPC and EFBIG; under `ulimit -f` the error says
    which (the disk has room)."""
    import subprocess
    import sys

    code = f"""
import resource, torch
from hapo_openrlhf.rundir.checkpoint import save_checkpoint
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    save_checkpoint({str(tmp_path)!r}, 1, {{0: {{"w": torch.zeros(1 << 18)}}}}, {{}})
except OSError as e:
    from hapo_openrlhf.cli import describe_error
    print(e.errno, describe_error(e))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    import errno

    assert p.stdout.startswith(f"{errno.EFBIG} a file-size limit stopped writing"), p.stdout + p.stderr[-2000:]
    assert "file-size limit of 65536 bytes" in p.stdout and "full disk" not in p.stdout
    assert not list(tmp_path.glob("step_*"))  # nothing half-written took a checkpoint's name
