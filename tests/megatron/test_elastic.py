"""Elastic resume: a Megatron checkpoint (``fully_reshardable``) saved under one TP x PP x DP
layout resumes under another, in fresh processes -- weights, fp32 masters and Adam moments
redistributed -- and the resumed steps equal the uninterrupted run's. A Qwen3 model (QK-norm,
head_dim != hidden / heads) in fp32, so the masters are the weights and "equal" is tight."""

import pytest
import torch
import torch.distributed as dist

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import tiny_model
from .test_ddp import CLIP, EPS, LR, resume_step

FAMILY, LAYERS = "qwen3", 4


def _worker(rank, tp, pp, ckpt, phase, out, distributed=None):
    """phase 'full': 4 steps; 'first': 2 steps, save; 'resume': load (any layout), steps 3-4.
    Rank 0 writes the Hugging Face state dict after the last loaded/saved step and at the end,
    the losses and grad norms, and Adam's step count."""
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron import checkpoint
    from hapo_openrlhf.megatron.convert import gather_hf_state_dict
    from hapo_openrlhf.megatron.ddp import MegatronOptimizer, wrap
    from hapo_openrlhf.megatron.model import build_gpt_model
    init_megatron(tp=tp, pp=pp)
    dp = ps.get_data_parallel_world_size()
    hf = tiny_model(FAMILY, tied=False, layers=LAYERS)
    model = build_gpt_model(hf.config, tp=tp, pp=pp, pp_rank=ps.get_pipeline_model_parallel_rank(),
                            perform_initialization=False)
    if phase != "resume":  # a resumed run gets every weight and state from disk
        load_hf_into(model, hf, tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=pp,
                     pp_rank=ps.get_pipeline_model_parallel_rank())
    ddp = wrap(model, distributed_optimizer=dp > 1 if distributed is None else distributed)
    opt = MegatronOptimizer(ddp, lr=LR, eps=EPS, clip_grad=CLIP, weight_decay=0.01, sharding="fully_reshardable")
    start, losses, snaps = 0, [], {}
    if phase == "resume":
        try:
            state = checkpoint.load(checkpoint.latest(ckpt), ddp, opt)
        except ValueError as e:
            torch.save({"refused": str(e)}, out)
            return
        start, losses = state["step"], list(state["losses"])
        snaps["loaded"] = gather_hf_state_dict(model, hf.config)
    for step in range(start, 2 if phase == "first" else 4):
        losses.append(resume_step(ddp, opt, step, tp))
        if step == 1:
            snaps["step2"] = gather_hf_state_dict(model, hf.config)
    if phase == "first":
        checkpoint.save(ckpt, 2, ddp, opt, {"step": 2, "losses": losses})
    snaps["end"] = gather_hf_state_dict(model, hf.config)
    inner = opt.torch_optimizers[0]
    steps = [float(st["step"]) for st in inner.state.values()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, steps)
    if rank == 0:
        torch.save({"losses": losses, "snaps": snaps, "adam_steps": {s for r in everyone for s in r},
                    "layout": (tp, pp, dp)}, out)


def _run(tmp_path, name, tp, pp, dp, ckpt, phase, distributed=None):
    out = tmp_path / f"{name}.pt"
    spawn(_worker, tp * pp * dp, tp, pp, str(ckpt), phase, str(out), distributed)
    return torch.load(out)


@pytest.mark.parametrize("saved, resumed, distributed", [
    ((2, 2, 1), (1, 1, 1), None),  # TP2 x PP2 -> one rank (Megatron's replicated optimizer)
    ((1, 2, 1), (2, 1, 1), None),  # PP2 -> TP2
    ((1, 2, 2), (2, 1, 2), None),  # PP2 x DP2 -> TP2 x DP2: the distributed optimizer's shards too
    ((1, 1, 2), (1, 1, 1), True),  # DP2 -> DP1 with distributed_optimizer: true in both runs
], ids=lambda t: "tp{}xpp{}xdp{}".format(*t) if isinstance(t, tuple) else str(t))
def test_checkpoint_resumes_under_another_layout(tmp_path, saved, resumed, distributed):
    ckpt = tmp_path / "ckpt"
    full = _run(tmp_path, "full", *saved, ckpt / "unused", "full", distributed)
    first = _run(tmp_path, "first", *saved, ckpt, "first", distributed)
    got = _run(tmp_path, "resumed", *resumed, ckpt, "resume", distributed)
    assert "refused" not in got and got["layout"] == resumed
    # the loaded weights (here the fp32 masters themselves) are the saved ones, bitwise, in any layout
    saved_sd, loaded = first["snaps"]["end"], got["snaps"]["loaded"]
    assert set(saved_sd) == set(loaded) and any("q_norm" in k for k in loaded)
    for k, v in saved_sd.items():
        assert torch.equal(v, loaded[k]), k
    assert first["losses"] == full["losses"][:2] and got["losses"][:2] == full["losses"][:2]
    # the next steps equal the uninterrupted run's: Adam's moments and step count came back
    assert got["adam_steps"] == {4.0} == full["adam_steps"]
    want = [x for st in full["losses"][2:] for x in st]
    assert [x for st in got["losses"][2:] for x in st] == pytest.approx(want, rel=1e-5)
    moved = 0.0
    for k, v in full["snaps"]["end"].items():
        err = float((got["snaps"]["end"][k] - v).abs().max())
        assert err <= 2e-6, (k, err)
        moved = max(moved, float((v - full["snaps"]["step2"][k]).abs().max()))
    # steps 3-4 moved weights by ~lr: lost or misplaced moments would show 100x over the tolerance
    assert moved > 100 * 2e-6, moved


def test_a_dp_reshardable_checkpoint_refuses_a_new_tp_naming_both_layouts(tmp_path, monkeypatch):
    """What cannot be served is refused before any tensor is read, naming both layouts."""
    import hapo_openrlhf.megatron.checkpoint as ck

    d = tmp_path / "step_2"
    d.mkdir()
    (d / ck.LAYOUT).write_text('{"tensor_parallel": 1, "pipeline_parallel": 2, "data_parallel": 2, '
                               '"optimizer": "distributed/dp_reshardable"}')
    here = {"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 2, "expert_parallel": 1,
            "optimizer": "distributed/dp_reshardable"}
    monkeypatch.setattr(ck, "_layout", lambda optimizer: here)
    with pytest.raises(ValueError, match=r"at TP 1 x PP 2 x EP 1, which can resume at another data-parallel size "
                                         r"only, not at TP 2 x PP 1 x EP 1 .*fully_reshardable to change "
                                         r"tensor_parallel and pipeline_parallel"):
        ck.check_resumable(d, object())
    # a mixture of experts: which experts each flat buffer holds is fixed by EP (a layout written before
    # MoE has no expert_parallel: EP 1)
    here.update(tensor_parallel=1, pipeline_parallel=2, expert_parallel=2)
    with pytest.raises(ValueError, match=r"x EP 1, which can resume .* not at TP 1 x PP 2 x EP 2 .*to change "
                                         r"expert_parallel\)"):
        ck.check_resumable(d, object())
    here.update(expert_parallel=1, data_parallel=4)
    ck.check_resumable(d, object())  # another DP: what dp_reshardable serves
    # DP 2 -> 1 with distributed_optimizer: null changes the optimizer's format: both layouts named, and the fix
    here.update(tensor_parallel=1, pipeline_parallel=2, data_parallel=1, optimizer="replicated")
    with pytest.raises(ValueError, match=r"\(TP 1 x PP 2 x DP 2\) holds .* \(TP 1 x PP 2 x DP 1\) is 'replicated'.*"
                                         r"set it to true in both runs"):
        ck.check_resumable(d, object())


def test_a_checkpoint_from_an_unsupported_megatron_core_is_refused_before_any_tensor(tmp_path, monkeypatch):
    """``hapo_layout.json`` records the megatron-core that wrote it: one outside >=0.16.1,<0.20
    (or not a version) is refused by name; inside the range, and unrecorded (hapo pinned
    0.16.1 before it recorded the version), it passes on to the layout checks."""
    import json

    import hapo_openrlhf.megatron.checkpoint as ck
    import hapo_openrlhf.megatron.compat as compat

    here = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "optimizer": "replicated"}
    monkeypatch.setattr(ck, "_layout", lambda optimizer: {**here, "megatron_core": "0.19.2"})
    monkeypatch.setattr(compat, "installed", lambda: "0.19.2")
    d = tmp_path / "step_2"
    d.mkdir()
    for saved, refused in (("0.15.0", "megatron-core 0.15.0, outside"), ("0.20.0rc1", "0.20.0rc1, outside"),
                           ("1.0.0", "1.0.0, outside"), ("not-a-version", "is not a version"),
                           (7, "is not a version"), ("0.16.1", None), ("0.19.2+5a1c0de", None), (None, None)):
        (d / ck.LAYOUT).write_text(json.dumps({**here, **({"megatron_core": saved} if saved is not None else {})}))
        if refused is None:
            ck.check_resumable(d, object())
        else:
            with pytest.raises(ValueError, match=refused) as e:
                ck.check_resumable(d, object())
            assert "step_2" in str(e.value)
    # written by megatron-core >= 0.19 (common state in the shards, no common.pt): refused under 0.18,
    # read from 0.19 on
    (d / ck.LAYOUT).write_text(json.dumps({**here, "megatron_core": "0.19.2"}))
    monkeypatch.setattr(compat, "installed", lambda: "0.18.0")
    with pytest.raises(ValueError, match=r"written by megatron-core 0.19.2, which keeps the common state inside the "
                                         r"torch_dist shards \(no common.pt\); megatron-core 0.18.0 .*>=0.19,<0.20"):
        ck.check_resumable(d, object())
    monkeypatch.setattr(compat, "installed", lambda: "0.19.1")
    ck.check_resumable(d, object())
