"""A checkpoint moves up between the megatron-core versions CI runs (0.16.1 here, 0.19.2 in
``.venv-py312`` on Python 3.12, which scripts/test.sh builds and names in HAPO_MC_OTHER_PYTHON): written under
0.16.1, resumed under 0.19.2 in fresh processes, the run equals the uninterrupted one
bitwise -- weights, fp32 masters, Adam moments, losses and grad norms -- with both
optimizer shardings. Down, a 0.19.2 checkpoint (its common state inside the shards, no
common.pt) is refused under 0.16.1 by name, before any tensor is read. (A version outside
the range is refused by name: test_elastic.py.)"""

import json
import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from ._dist import spawn
from .test_ddp import _resume_worker

OTHER = os.environ.get("HAPO_MC_OTHER_PYTHON")
ROOT = Path(__file__).resolve().parents[2]


def _other_version() -> str:
    return subprocess.run([OTHER, "-c", "from importlib.metadata import version; print(version('megatron-core'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _in_other(*runs: tuple[str, Path, str, Path]) -> None:
    """``_resume_worker`` on two gloo ranks under the other interpreter's megatron-core, once per
    ``(sharding, checkpoint, phase, out)``, in one interpreter (its imports and fork server paid once)."""
    calls = "; ".join(f"spawn(_resume_worker, 2, 1, {sh!r}, {str(ck)!r}, {ph!r}, {str(o)!r})" for sh, ck, ph, o in runs)
    code = f"from tests.megatron._dist import spawn; from tests.megatron.test_ddp import _resume_worker; {calls}"
    p = subprocess.run([OTHER, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]


def _equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and len(a["losses"]) == 4
    assert a["weights"].keys() == b["weights"].keys()
    for k, v in a["weights"].items():
        assert torch.equal(v, b["weights"][k]), k
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a["moments"], b["moments"], strict=True))
    assert a["steps"] == b["steps"] == {4.0}


@pytest.mark.skipif(not OTHER, reason="HAPO_MC_OTHER_PYTHON is not set (scripts/test.sh sets it to .venv-py312's "
                                      "python, megatron-core 0.19.2)")
def test_a_checkpoint_resumes_bitwise_under_a_newer_megatron_core_and_is_refused_under_an_older(tmp_path):
    """Both optimizer shardings (dp_reshardable, fully_reshardable), each with its own checkpoints; the
    other interpreter runs its share of both in one launch (issue 57: not two per sharding)."""
    here, there = version("megatron-core"), _other_version()
    if here == there:
        pytest.skip(f"HAPO_MC_OTHER_PYTHON runs the same megatron-core ({here})")
    shardings = ("dp_reshardable", "fully_reshardable")
    for sh in shardings:
        d = tmp_path / sh
        d.mkdir()
        spawn(_resume_worker, 2, 1, sh, str(d / "unused"), "full", str(d / "full"))
        # here -> there: written here
        spawn(_resume_worker, 2, 1, sh, str(d / "a"), "first", str(d / "first_a"))
        layout = json.loads(next((d / "a").glob("step_*/hapo_layout.json")).read_text())
        assert layout["megatron_core"] == here
    # there: each here-written checkpoint resumed; and a checkpoint of its own per sharding
    _in_other(*[(sh, tmp_path / sh / "a", "resume", tmp_path / sh / "resumed_there") for sh in shardings],
              *[(sh, tmp_path / sh / "b", "first", tmp_path / sh / "first_b") for sh in shardings])
    for sh in shardings:
        d = tmp_path / sh
        # there -> here: refused, naming both versions and the direction
        assert json.loads(next((d / "b").glob("step_*/hapo_layout.json")).read_text())["megatron_core"] == there
        spawn(_resume_worker, 2, 1, sh, str(d / "b"), "resume", str(d / "refused"))
        why = torch.load(d / "refused.0")["refused"]
        assert f"written by megatron-core {there}" in why and "no common.pt" in why and "up across versions" in why
        for r in range(2):
            full, got = torch.load(d / f"full.{r}"), torch.load(d / f"resumed_there.{r}")
            assert "refused" not in got, got
            _equal(full, got)
