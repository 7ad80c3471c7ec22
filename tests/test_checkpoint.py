import os
import random

import numpy as np
import pytest
import torch

from hapo_openrlhf.checkpoint import (
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
