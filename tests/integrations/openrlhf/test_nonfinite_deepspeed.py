"""The non-finite-gradient guard on OpenRLHF's DeepSpeed actor (``nonfinite.py``), on real
DeepSpeed engines built from OpenRLHF's own ``get_train_ds_config`` at ZeRO-0/1/2/3 and bf16,
2 gloo ranks (data parallel), 2 micro-batches per optimizer step, stepped after every
micro-batch as OpenRLHF's ``training_step`` does. The bad gradient comes from an activation
hook on rank 0 only -- where one comes from in practice (a backward overflow), so every
parameter hook downstream sees it -- and both ranks must skip together.

Without the guard (today's main), ZeRO-3 under bf16 applies the step: DeepSpeed checks for
inf/NaN there only under fp16."""

import math
import os

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("openrlhf")


def _worker(rank, stage, bad, out_dir):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config

    from hapo_openrlhf.algos.grad_guard import NonFiniteGradientError
    from hapo_openrlhf.integrations.openrlhf.actors.nonfinite import DeepSpeedGradGuard

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")  # joins the group the spawner made
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ds = get_train_ds_config(offload=False, adam_offload=False, stage=stage, param_dtype="bf16", max_norm=1.0)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train_batch_size=8,
              zero_allow_untested_optimizer=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)
    guard = DeepSpeedGradGuard(engine, max_consecutive=2)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)

    def optimizer_step():
        for _ in range(2):
            engine.backward(engine(x).float().pow(2).mean())
            guard.step()
        return guard.norm

    def snapshot():
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        moments = [v.clone() for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        masters = [(safe_get_full_fp32_param(p) if stage else p.detach()).clone() for p in engine.module.parameters()]
        return masters, moments, sched.get_last_lr()

    norms = [optimizer_step()]
    before = snapshot()
    if rank == 0:
        def poison(module, inputs, out):
            out.register_hook(lambda g: g.clone().view(-1).index_fill_(0, torch.tensor([1]), bad).view_as(g))

        engine.module[0].register_forward_hook(poison)
    norms.append(optimizer_step())
    after = snapshot()
    skipped = guard.skipped
    err = None
    try:
        optimizer_step()
    except NonFiniteGradientError as e:
        err = str(e)
    torch.save({"norms": norms, "before": before, "after": after, "skipped": skipped, "err": err,
                "optimizer": type(engine.optimizer).__name__}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("stage,bad", [(0, math.inf), (1, math.nan), (2, math.inf), (3, math.nan), (3, math.inf)])
def test_a_non_finite_gradient_skips_the_deepspeed_step(tmp_path, stage, bad):
    from tests.megatron._dist import spawn

    spawn(_worker, 2, stage, bad, str(tmp_path))
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        good, skipped_norm = got["norms"]
        assert math.isfinite(good) and good > 0
        assert math.isnan(skipped_norm) if math.isnan(bad) else skipped_norm == math.inf
        assert got["skipped"] == 1  # DeepSpeed's own count (engine.skipped_steps, in its checkpoints)
        (m0, s0, lr0), (m1, s1, lr1) = got["before"], got["after"]
        assert lr0 == lr1  # the LR schedule did not step
        assert len(s0) > 0 and all(torch.equal(a, b) for a, b in zip(s0, s1))  # moments and step counts
        assert all(torch.equal(a, b) for a, b in zip(m0, m1))  # the (fp32 master) weights
        assert got["err"] and "2 step(s) in a row" in got["err"], got["err"]
