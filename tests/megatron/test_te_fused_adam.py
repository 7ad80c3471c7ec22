"""Resume with Transformer Engine's FusedAdam (issue 44): megatron-core builds its optimizers
on TE's ``FusedAdam`` whenever ``transformer_engine`` imports, and TE keeps Adam's step in
the param groups, never per parameter -- its ``state_dict`` looks every per-parameter key up
in a map of ``exp_avg`` / ``exp_avg_sq`` / ``master_param``. Under the stand-in
(te_standin.py, TE 2.20.2's semantics) the resume tests that exist for torch's AdamW run
again: bitwise equal to the uninterrupted run at DP=2 with ``dp_reshardable`` and
``fully_reshardable``, and with the replicated optimizer at DP=1."""

from pathlib import Path

import pytest
import torch

from ._dist import spawn
from .test_ddp import _resume_worker


def _assert_bitwise(tmp_path, world):
    for r in range(world):
        full, resumed = torch.load(tmp_path / f"full.{r}"), torch.load(tmp_path / f"resumed.{r}")
        assert full["optimizer"] == resumed["optimizer"] == "tests.megatron.te_standin.FusedAdam"
        assert full["losses"] == resumed["losses"] and len(full["losses"]) == 4
        assert full["steps"] == resumed["steps"] == {4.0}  # the param groups' step came back
        for k, v in full["weights"].items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, resumed["weights"][k]), k
        assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(full["masters"], resumed["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(full["moments"], resumed["moments"]))


@pytest.mark.parametrize("world, sharding, distributed", [
    (2, "dp_reshardable", True), (2, "fully_reshardable", True), (1, "dp_reshardable", False)],
    ids=["dp2_dp_reshardable", "dp2_fully_reshardable", "dp1_replicated"])
def test_a_te_fused_adam_run_resumes_bitwise(tmp_path, world, sharding, distributed):
    """Before the fix every resume stopped in TE's ``state_dict`` with ``KeyError('step')``:
    the actor's optimizer gave each parameter a ``step`` entry to load into (right for
    torch's AdamW, whose step is per parameter)."""
    ckpt = tmp_path / "ckpt"
    for phase, out in (("full", "full"), ("first", "first"), ("resume", "resumed")):
        spawn(_resume_worker, world, 1, sharding, str(ckpt), phase, str(tmp_path / out), True, distributed)
    _assert_bitwise(tmp_path, world)


def test_the_stand_in_refuses_a_per_parameter_step_as_te_does():
    """The failure the resume hit, in the stand-in alone: a ``step`` in the per-parameter
    state is a ``KeyError`` on ``state_dict`` (TE 2.20.2's ``get_unscaled_state``)."""
    from .te_standin import FusedAdam

    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq"} and opt.param_groups[0]["step"] == 1
    sd = opt.state_dict()
    assert sd["param_groups"][0]["step"] == 1
    opt.state[p]["step"] = torch.zeros(())
    with pytest.raises(KeyError, match="step"):
        opt.state_dict()


def _smoke_resume_worker(rank, out, te):
    from hapo_openrlhf.gpu_smoke import optimizer_resume as _optimizer_resume

    from .cuda_shim import install

    install()
    if te:
        from .te_standin import Patch, use_te_fused_adam

        use_te_fused_adam(Patch())
    res = {d: _optimizer_resume("cpu", Path(out).parent / f"ckpt_{d}", distributed=d) for d in (True, False)}
    torch.save(res, out)


@pytest.mark.parametrize("te", [False, True], ids=["torch_adamw", "te_fused_adam"])
def test_the_gpu_smokes_resume_check_runs_on_cpu(tmp_path, te):
    """The body of `hapo doctor --gpu-smoke`'s optimizer-resume check (there: CUDA, the image's
    own optimizer -- TE's FusedAdam wherever TE imports) under the CPU shim: with torch's AdamW
    and with the TE stand-in, distributed and replicated, four steps == two + a checkpoint +
    two from it, bitwise; the check names the optimizer megatron-core built."""
    out = tmp_path / "res.pt"
    spawn(_smoke_resume_worker, 1, str(out), te)
    res = torch.load(out)
    want = "tests.megatron.te_standin.FusedAdam" if te else "torch.optim.adamw.AdamW"
    for d in (True, False):
        assert res[d]["optimizer"] == want and res[d]["same_start"] and res[d]["bitwise"], res
