"""Host syncs and full-vocabulary tensors in the per-micro-batch hot path (issue 43, item 5),
counted on CPU by a TorchDispatchMode: every ``_local_scalar_dense`` (``.item()``,
``float(t)``, ``int(t)``, ``bool(t)``), ``nonzero`` (and the ops that call it), plus every
``Tensor.tolist()`` -- each a device-to-host synchronisation on a GPU -- and every op whose
output holds more than chunk x V elements (a full-vocabulary tensor the fused heads exist to
avoid; one chunk's [chunk, V] block is what they compute).

* the Megatron actor: one optimizer step of one micro-batch through ``fit`` (forward,
  backward and loss inside Megatron's schedule; then the step and the status), 1 gloo rank,
  the fused vocabulary-parallel head, packed THD rows;
* the DeepSpeed actor's own part of a micro-batch: OpenRLHF's ``Actor.forward`` with hapo's
  fused head, ``HapoPolicyLoss`` and the backward (DeepSpeed's engine is upstream's).

The ceilings are today's counts: a regression that adds a sync or a [T, V] tensor fails.
What remains is named in docs/performance.md ("Host syncs")."""

import collections
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


def _origin() -> str:
    """``file:line`` of the innermost frame in hapo_openrlhf or an upstream package that
    caused the sync (``hapo_openrlhf/...`` or ``megatron/core/...``, ``transformers/...``)."""
    import traceback

    for f in reversed(traceback.extract_stack()[:-2]):
        name = f.filename.replace("\\", "/")
        if "/tests/" in name or "/torch/" in name:
            continue
        if "hapo_openrlhf/" in name:
            return "hapo_openrlhf/" + name.split("hapo_openrlhf/")[-1] + f":{f.lineno}"
        if "site-packages/" in name:
            return name.split("site-packages/")[-1] + f":{f.lineno}"
    return "?"


class Counter(TorchDispatchMode):
    def __init__(self, big: int):
        super().__init__()
        self.big = big
        self.syncs = collections.Counter()
        self.full_vocab = collections.Counter()
        self.where = collections.Counter()
        self.paused = 0

    def host_side(self, fn):
        """``fn`` reads CPU tensors only (a host-side copy): its reads are no device syncs."""
        counter = self

        def wrapped(*a, **k):
            counter.paused += 1
            try:
                return fn(*a, **k)
            finally:
                counter.paused -= 1

        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in SYNC_OPS and not self.paused:
            self.syncs[name] += 1
            self.where[_origin()] += 1
        if any(isinstance(t, torch.Tensor) and t.numel() > self.big for t in tree_flatten(out)[0]):
            self.full_vocab[name] += 1
        return out

    def __enter__(self):
        orig = torch.Tensor.tolist
        counter = self

        def tolist(t):
            if not counter.paused:
                counter.syncs["tolist"] += 1
                counter.where[_origin()] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return orig(t)

        self._orig, torch.Tensor.tolist = orig, tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._orig
        return super().__exit__(*exc)


def _model_dir(path: Path, vocab: int) -> Path:
    """A Qwen2 whose vocabulary dwarfs everything else (hidden 16 < chunk): only a
    full-vocabulary tensor reaches chunk x V elements."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hapo_openrlhf.local.model import build_tokenizer

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _megatron_worker(rank, port, args, model_dir, exp, out_dir, big):
    from tests.megatron.cuda_shim import install

    install()
    from types import SimpleNamespace

    import hapo_openrlhf.megatron.schedule as schedule
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import fingerprint
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    actor = MegatronPolicyActorImpl(1, 0, "127.0.0.1", port)
    actor.init_model_from_pretrained(SimpleNamespace(args=args, is_rank_0=lambda: True), str(model_dir),
                                     max_steps=4, vllm_engines=None)
    lp = actor.forward(exp.sequences, exp.action_mask, exp.attention_mask)
    actor.pop_behaviour(fingerprint(exp.sequences, exp.attention_mask))
    exp.action_log_probs = lp - 0.1 * exp.advantages
    if args.hapo["algorithm"]["loss"] == "stare":  # what the experience maker sends a stateful loss
        actor.set_loss_state({"gate_on": True, "reweight_w": 1.1, "reweight_m": 0.9})
    actor.append(exp)
    inner = Counter(big)
    fb = schedule.forward_backward

    def counted(*a, **k):  # the micro-batch: forward, loss and backward in Megatron's schedule
        mbs = a[1]
        # the sizes and the vocabulary check come from the CPU copies the actor keeps (host-side reads)
        assert all("attention_mask_cpu" in mb and "input_ids_cpu" in mb for mb in mbs)
        assert all(not mb["attention_mask_cpu"].is_cuda and not mb["input_ids_cpu"].is_cuda for mb in mbs)
        with inner:
            return fb(*a, **k)

    schedule.forward_backward = counted
    whole = Counter(big)
    for c in (inner, whole):
        schedule.RowLayout.of = classmethod(c.host_side(schedule.RowLayout.of.__func__))
        schedule.ids_within_vocabulary = c.host_side(schedule.ids_within_vocabulary)
    with whole:
        actor.fit()
    torch.save({"where": dict(inner.where), "step_where": dict(whole.where),
                "micro_batch": (dict(inner.syncs), dict(inner.full_vocab)),
                "step": (dict(whole.syncs), dict(whole.full_vocab))}, Path(out_dir) / "megatron.pt")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None and os.environ.get("HAPO_REQUIRE_MEGATRON") != "1",
                    reason="megatron-core not installed (the megatron extra)")
@pytest.mark.parametrize("loss", ["ppo", "stare"])
def test_megatron_actor_micro_batch_host_syncs_and_full_vocabulary_tensors(tmp_path, loss):
    """``stare``: STARE's micro-batch selection (issue 54) adds exactly one host read (its k, the
    ceiling of P times the candidates' count) per micro-batch, from algos/stare.py."""
    from tests.megatron._dist import start

    from .test_megatron_actor import _args, _experiences, _free_port

    chunk, vocab, padded = 24, 8000, 8064  # Megatron pads the vocabulary to a multiple of 128
    method = ["algorithm.loss=stare", "algorithm.loss_params={variant: C2, top_ratio: 0.2}"] if loss == "stare" else []
    cfg, args = _args(tmp_path, ["openrlhf.actor_gpus_per_node=1", "openrlhf.train_batch_size=4",
                                 "openrlhf.micro_train_batch_size=4", "openrlhf.packing_samples=true",
                                 f"algorithm.entropy_chunk_size={chunk}", "rollout.top_p=1.0", *method])
    model_dir = _model_dir(tmp_path / "model", vocab)
    exp = _experiences(1, seed=11)[0]
    assert int(exp.attention_mask.sum()) > chunk  # a [T, V] tensor would be counted
    start(_megatron_worker, 1, (_free_port(), args, model_dir, exp, str(tmp_path), chunk * padded))
    got = torch.load(tmp_path / "megatron.pt")
    (mb_syncs, mb_big), (step_syncs, step_big) = got["micro_batch"], got["step"]
    print("Megatron micro-batch syncs", mb_syncs, got["where"], "full-vocabulary", mb_big,
          "| whole step", step_syncs, step_big)
    # what remains in the micro-batch: megatron-core's unfused RoPE (q and k, each layer: upstream's,
    # with apply_rope_fusion off) and, without flash-attn, the per-sequence SDPA loop's boundaries
    allowed = ("megatron/core/models/common/embeddings/rope_utils.py", "hapo_openrlhf/megatron/attention.py")
    stare = {w: n for w, n in got["where"].items() if w.startswith("hapo_openrlhf/algos/stare.py")}
    assert all(w.startswith(allowed) for w in got["where"] if w not in stare), got["where"]
    assert sum(stare.values()) == (1 if loss == "stare" else 0), stare  # one tolist: both candidate counts
    assert sum(mb_syncs.values()) <= MEGATRON_MICRO_BATCH_SYNCS + sum(stare.values()), mb_syncs
    assert sum(mb_big.values()) == 0, mb_big  # the fused head: no [T, V] tensor
    assert sum(step_syncs.values()) <= MEGATRON_STEP_SYNCS + sum(stare.values()), (step_syncs, got["step_where"])


def test_deepspeed_actor_micro_batch_host_syncs_and_full_vocabulary_tensors():
    from hapo_openrlhf.integrations.openrlhf.actors.fused_head import install_fused_head
    from hapo_openrlhf.integrations.openrlhf.actors.loss import HapoPolicyLoss

    from .test_fused_head import _actor, _batch

    chunk, V = 32, 4000  # hidden 16 < chunk < the 36 tokens: only a [T, V] tensor reaches chunk x V
    actor = _actor(packing=False, V=V, H=16)
    assert install_fused_head(actor, chunk_size=chunk) is None
    seq, attn, am = _batch()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(am.shape, generator=g)
    adv = torch.randn(am.shape, generator=g)
    loss_fn = HapoPolicyLoss("ppo", {}, "token-mean", norm_constant=8.0)
    actor.train()
    with Counter(chunk * V) as c:
        lp, out = actor(seq, am, attn, return_output=True, return_entropy=True)
        # upstream hands the step's token count as a tensor on the device (get_loss_batch_info)
        loss, *_ = loss_fn(lp, old, adv, action_mask=am.bool(), batch_num_tokens=am.sum().float())
        loss.backward()
    print("DeepSpeed actor micro-batch syncs", dict(c.syncs), dict(c.where), "full-vocabulary", dict(c.full_vocab))
    # what remains: transformers' own mask handling inside the model's forward
    assert all(w.startswith("transformers/") for w in c.where), dict(c.where)
    assert sum(c.syncs.values()) <= DEEPSPEED_MICRO_BATCH_SYNCS, dict(c.syncs)
    assert sum(c.full_vocab.values()) == 0, dict(c.full_vocab)


# ceilings: the counts measured when this test was written (docs/performance.md, "Host syncs")
# (before: 23 in the Megatron micro-batch, 69 in its step, 7 in the DeepSpeed micro-batch)
MEGATRON_MICRO_BATCH_SYNCS = 10  # 2 layers: 8 from upstream's RoPE, 2 from the SDPA loop without flash-attn
# + the step: megatron-core's optimizer and clipping, the guard's flags, the status (57 until issue 54 read the
# step's loss statistics and the status in one transfer each: 41; a method's own metrics then add none)
MEGATRON_STEP_SYNCS = 41
DEEPSPEED_MICRO_BATCH_SYNCS = 2  # transformers' mask handling
