"""A non-finite gradient in PRIME's PRM on OpenRLHF skips the PRM's step (issue 59), as the
policy's does (``nonfinite.py``) and the embedded PRM's does: ``HapoPRMActor.prm_update`` (the
actor's own method, unwrapped from Ray) on a real DeepSpeed engine (OpenRLHF's ZeRO-2 config in
fp32), one gloo rank, two micro-batches per step. The second update's backward carries a NaN (from
an activation, as an overflow would): its step is skipped -- phi's weights and Adam moments
untouched, ``prm/grad_norm`` nan, ``prm/skipped_steps`` 1 (DeepSpeed's count) -- and the next,
finite update steps again."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("openrlhf")


class _LogProbs(torch.nn.Module):
    """A tiny causal "LM": log-probs of each sequence's next tokens on the last A positions."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)

    def forward(self, sequences, action_mask, attention_mask, ring_attn_group=None):
        logp = torch.log_softmax(self.out(torch.tanh(self.emb(sequences[:, :-1]))), -1)
        logp = logp.gather(-1, sequences[:, 1:, None]).squeeze(-1)
        return logp[:, -action_mask.shape[1]:]


def _worker(rank, out_dir):
    import deepspeed
    from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config

    from hapo_openrlhf.integrations.openrlhf.actors import prm_actor
    from hapo_openrlhf.integrations.openrlhf.actors.nonfinite import DeepSpeedGradGuard

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.cuda.current_device = lambda: "cpu"  # the actor moves its micro-batches to this device
    torch.manual_seed(0)
    phi, ref = _LogProbs(), _LogProbs()
    ref.load_state_dict(phi.state_dict())
    ds = get_train_ds_config(offload=False, adam_offload=False, stage=2, param_dtype="fp32", max_norm=10.0)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train_batch_size=4,
              zero_allow_untested_optimizer=True)
    engine, opt, _, _ = deepspeed.initialize(model=phi, optimizer=torch.optim.AdamW(phi.parameters(), lr=1e-2),
                                             config=ds)
    actor = object.__new__(prm_actor.HapoPRMActor.__ray_metadata__.modified_class)
    actor.strategy = SimpleNamespace(accumulated_gradient=2, ring_attn_group=None, all_reduce=lambda d: d,
                                     backward=lambda loss, model, optim: engine.backward(loss))
    actor.model = type("M", (), {"model": engine, "train": lambda s: None, "eval": lambda s: None,
                                 "__call__": lambda s, *a, **k: engine(*a, **k)})()
    actor.ref = type("R", (), {"__call__": lambda s, *a, **k: ref(*a, **k)})()
    actor.beta, actor.optim, actor.grad_guard = 0.05, opt, DeepSpeedGradGuard(engine, max_consecutive=3)
    g = torch.Generator().manual_seed(1)

    def update():
        actor.buffer = []
        for b in range(2):
            seq = torch.randint(0, 11, (2, 7), generator=g)
            am = torch.ones(2, 4, dtype=torch.bool)
            e = SimpleNamespace(sequences=seq, action_mask=am, attention_mask=torch.ones(2, 7), index=[2 * b, 2 * b + 1])
            actor.prm_append(e, torch.tensor([1.0, 0.0]))
        return actor.prm_update()["status"]

    def snapshot():
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        return ([p.detach().clone() for p in engine.module.parameters()],
                [v.clone() for st in inner.state.values() for v in st.values() if torch.is_tensor(v)])

    first = update()
    before = snapshot()
    def poison(module, inputs, out):  # a NaN in the backward, upstream of the embedding's gradient
        out.register_hook(lambda grad: grad.clone().view(-1).index_fill_(0, torch.tensor([1]), math.nan).view_as(grad))

    hook = engine.module.emb.register_forward_hook(poison)
    bad = update()
    after = snapshot()
    hook.remove()
    third = update()
    torch.save({"first": first, "bad": bad, "third": third, "before": before, "after": after,
                "final": snapshot()}, os.path.join(out_dir, "rank0.pt"))


def test_a_non_finite_prm_gradient_skips_the_prm_step(tmp_path):
    from tests.megatron._dist import spawn

    spawn(_worker, 1, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    first, bad, third = got["first"], got["bad"], got["third"]
    assert math.isfinite(first["prm/grad_norm"]) and first["prm/grad_norm"] > 0 and first["prm/skipped_steps"] == 0
    assert math.isnan(bad["prm/grad_norm"]) and bad["prm/skipped_steps"] == 1 and math.isfinite(bad["prm/loss"])
    (w0, m0), (w1, m1) = got["before"], got["after"]
    assert len(m0) > 0 and all(torch.equal(a, b) for a, b in zip(m0, m1))  # the Adam moments and step count
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))  # phi's weights
    assert math.isfinite(third["prm/grad_norm"]) and third["prm/skipped_steps"] == 1  # the next finite step runs
    assert any(not torch.equal(a, b) for a, b in zip(w1, got["final"][0]))
