"""Megatron distributed checkpoints at TP=2 (Megatron's DDP and replicated optimizer at
DP=1): train 2 steps, save, resume in fresh processes, train 2 more == 4 uninterrupted
steps (losses, every weight and Adam moment, bitwise); the same checkpoint also resumes
at TP=1 (model and optimizer state resharded on load). The distributed optimizer's
checkpoints: tests/megatron/test_ddp.py."""

import json

import pytest
import torch

from hapo_openrlhf.algos import compute_policy_loss

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import tiny_qwen2

B, S, TP = 4, 8, 2


def _step_data(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 259, (B, S), generator=g)
    am = torch.ones(B, S, dtype=torch.long)
    am[1, :2] = 0
    mask = (am[:, :-1] * am[:, 1:]).float()
    return ids, am, mask, -torch.rand(B, S - 1, generator=g) * 3, torch.randn(B, S - 1, generator=g)


def _worker(rank, ckpt_root, phase, out, tp=TP):
    """phase 'full': 4 steps; 'first': 2 steps then save; 'resume': load then steps 3-4."""
    from hapo_openrlhf.megatron import checkpoint
    from hapo_openrlhf.megatron.ddp import MegatronOptimizer, wrap
    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward

    init_megatron(tp=tp)
    hf = tiny_qwen2(False, layers=2)
    model = build_qwen2_gpt_model(hf.config, tp=tp)
    if phase != "resume":  # the resumed run starts from Megatron's random init: everything must come from disk
        load_hf_into(model, hf, tp=tp, tp_rank=rank)
    # a large epsilon keeps AdamW's update linear in tiny gradients, so fp32 summation order (TP=2 vs the
    # resharded TP=1 run) cannot flip the sign of a near-zero element's step
    ddp = wrap(model, distributed_optimizer=False)
    opt = MegatronOptimizer(ddp, lr=1e-3, weight_decay=0.01, eps=1e-3, clip_grad=0.0)
    start, losses = 0, []
    if phase == "resume":
        state = checkpoint.load(checkpoint.latest(ckpt_root), ddp, opt)
        start, losses = state["step"], list(state["losses"])
    stop = 2 if phase == "first" else 4
    for step in range(start, stop):
        ids, am, mask, old, adv = _step_data(step)
        n = float(mask.sum())

        def loss_fn(lp, en, mb):
            return compute_policy_loss("ppo", lp, old, adv, mask, normalizer=n)[0], {}

        stats = forward_backward(ddp, [{"input_ids": ids, "attention_mask": am}], loss_fn, vocab_size=259)
        opt.step()
        losses.append(float(stats[0]["loss"]))
    if phase == "first":
        import multiprocessing

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        checkpoint.save(ckpt_root, 2, ddp, opt, {"step": 2, "losses": losses})
        # the save started no process that outlives it (megatron-core's writer would leave a spawned
        # Manager behind for its results queue), and left megatron-core's module state as it found it
        assert multiprocessing.active_children() == [] and filesystem_async._results_queue is None
    if phase != "first":
        inner = opt.torch_optimizers[0]
        torch.save({"losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()
                                                  if not k.endswith("_extra_state")},
                    "exp_avg": [inner.state[p]["exp_avg"].clone() for g in inner.param_groups for p in g["params"]],
                    "steps": {float(st["step"]) for st in inner.state.values()}},
                   f"{out}.{rank}")


def test_tp2_checkpoint_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    spawn(_worker, TP, str(ckpt), "full", str(tmp_path / "full"))
    spawn(_worker, TP, str(ckpt), "first", None)
    assert [p.name for p in ckpt.iterdir()] == ["step_2"]  # complete, no .tmp left behind
    # a newer checkpoint with a truncated shard is skipped for the newest one that verifies
    import shutil

    from hapo_openrlhf.megatron import checkpoint

    shutil.copytree(ckpt / "step_2", tmp_path / "step_3")
    manifest = json.loads((tmp_path / "step_3" / checkpoint.MANIFEST).read_text())["files"]
    big = max(manifest, key=lambda n: manifest[n]["size"])
    (tmp_path / "step_3" / big).write_bytes((tmp_path / "step_3" / big).read_bytes()[:10])
    shutil.move(tmp_path / "step_3", ckpt / "step_3")
    assert checkpoint.latest(ckpt).name == "step_2"
    spawn(_worker, TP, str(ckpt), "resume", str(tmp_path / "resumed"))
    shutil.rmtree(ckpt / "step_3")
    for rank in range(TP):
        full, resumed = torch.load(tmp_path / f"full.{rank}"), torch.load(tmp_path / f"resumed.{rank}")
        assert len(full["losses"]) == 4 and full["losses"] == resumed["losses"]
        assert full["weights"].keys() == resumed["weights"].keys()
        for k in full["weights"]:
            assert torch.equal(full["weights"][k], resumed["weights"][k]), k
        assert len(full["exp_avg"]) == len(resumed["exp_avg"]) > 0 and resumed["steps"] == {4.0}
        for a, b in zip(full["exp_avg"], resumed["exp_avg"]):
            assert torch.equal(a, b)

    # resharding on load (Megatron's): the TP=2 checkpoint continues on one rank, equal to
    # the TP=2 run up to float reduction order
    from hapo_openrlhf.megatron.convert import megatron_to_hf

    spawn(_worker, 1, str(ckpt), "resume", str(tmp_path / "tp1"), 1)
    full = [torch.load(tmp_path / f"full.{r}") for r in range(TP)]
    tp1 = torch.load(tmp_path / "tp1.0")
    torch.testing.assert_close(torch.tensor(tp1["losses"]), torch.tensor(full[0]["losses"]), rtol=1e-5, atol=1e-6)
    cfg = tiny_qwen2(False, layers=2).config
    a = megatron_to_hf({(0, r): full[r]["weights"] for r in range(TP)}, cfg, tp=TP, pp=1)
    b = megatron_to_hf({(0, 0): tp1["weights"]}, cfg, tp=1, pp=1)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)


def test_incomplete_checkpoint_is_ignored_and_refused(tmp_path):
    from hapo_openrlhf.megatron import checkpoint

    (tmp_path / "step_4.tmp").mkdir()
    (tmp_path / "step_2").mkdir()
    assert checkpoint.latest(tmp_path).name == "step_2"
    assert checkpoint.latest(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(tmp_path / "step_4.tmp", model=None)
    # a manifest that no longer matches: skipped; none that matches: an error listing them
    (tmp_path / "step_2" / "common.pt").write_bytes(b"x" * 10)
    checkpoint.write_manifest(tmp_path / "step_2")
    (tmp_path / "step_2" / "common.pt").write_bytes(b"y" * 10)  # same size, other content
    with pytest.raises(ValueError, match="step_2: common.pt does not match its CRC-32"):
        checkpoint.latest(tmp_path)


@pytest.mark.parametrize("manifest, why", [
    ("[]", "unreadable or not a JSON object with 'files'"),
    ('"x"', "unreadable or not a JSON object with 'files'"),
    ("{torn", "unreadable or not a JSON object with 'files'"),
    ('{"files": 5}', "is malformed"),
    ('{"files": {"common.pt": 10}}', "is malformed"),
    ('{"files": {"common.pt": {"size": "10"}}}', "is malformed"),
    ('{"files": {"../../etc/passwd": {"size": 10}}}', "outside the checkpoint"),
])
def test_a_malformed_manifest_makes_the_checkpoint_unverifiable_not_a_crash(tmp_path, manifest, why):
    """hapo_manifest.json of the wrong shape: the step is skipped with the reason, and the
    next older one that verifies is used (never a KeyError/TypeError mid-resume)."""
    from hapo_openrlhf.megatron import checkpoint

    for step in (1, 2):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "common.pt").write_bytes(b"x" * 10)
        checkpoint.write_manifest(tmp_path / f"step_{step}")
    (tmp_path / "step_2" / checkpoint.MANIFEST).write_text(manifest)
    assert why in checkpoint.verify(tmp_path / "step_2")
    assert checkpoint.latest(tmp_path).name == "step_1"


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _dcp_step(root, step, value):
    """A DCP checkpoint as megatron-core's torch_dist writes it (tensors + a byte entry), with
    the project's manifest."""
    import torch.distributed.checkpoint as dcp

    from hapo_openrlhf.megatron import checkpoint

    d = root / f"step_{step}"
    dcp.save({"w": torch.full((4,), float(value)), "extra": {"lr": 0.1, "note": "plain data"}},
             checkpoint_id=str(d), no_dist=True)
    checkpoint.write_manifest(d)
    return d


@pytest.mark.parametrize("plant", ["metadata", "byte_entry"])
def test_a_planted_dcp_checkpoint_is_refused_without_running_and_resume_falls_back(tmp_path, plant):
    """DCP unpickles .metadata with pickle.load and byte entries with torch.load(weights_only=
    False): a planted newest checkpoint whose manifest verifies must be refused before
    megatron-core reads it -- the marker is never created -- and the older one is used."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from hapo_openrlhf.megatron import checkpoint
    from hapo_openrlhf.megatron.safe_load import _read_metadata, scan

    marker = tmp_path / "MARKER"
    _dcp_step(tmp_path, 1, 1.0)
    d = _dcp_step(tmp_path, 2, 2.0)
    assert scan(tmp_path / "step_1") is None and scan(d) is None  # a real DCP checkpoint passes
    if plant == "metadata":
        md = _read_metadata(d)
        (d / ".metadata").write_bytes(pickle.dumps({"meta": md, "x": _RunsCode(marker)}))
        why = "global posix.system is not a checkpoint data class"
    else:
        md = _read_metadata(d)
        buf = __import__("io").BytesIO()
        torch.save({"x": _RunsCode(marker)}, buf)
        (d / "__9_0.distcp").write_bytes(buf.getvalue())
        md.state_dict_metadata["evil"] = BytesStorageMetadata()
        md.storage_data[MetadataIndex("evil")] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
        (d / ".metadata").write_bytes(pickle.dumps(md))
        why = "the entry 'evil' in __9_0.distcp holds objects other than tensors"
    checkpoint.write_manifest(d)  # the attacker rewrites the CRC-32s too
    assert why in checkpoint.verify(d)
    assert checkpoint.latest(tmp_path).name == "step_1"
    with pytest.raises(ValueError, match="is not loaded"):
        checkpoint.load(d, model=None)
    assert not marker.exists()
