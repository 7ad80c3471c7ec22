"""Context parallelism through megatron-core (issue 58) on the Transformer Engine stand-in: its
GPTModel at ``context_parallel_size`` 2 against CP 1, hapo's log-prob path (``context_parallel.CPRows``
in the schedule) with both heads, TP x CP with sequence parallelism against Hugging Face, two
optimizer steps with the distributed optimizer over DP x CP, checkpoints across CP, and the head's
signals under CP. The split itself and the stand-in's attention: test_cp_split.py."""

from pathlib import Path

import pytest
import torch

from hapo_openrlhf.megatron import context_parallel as CP
from tests.megatron.test_cp_split import LENGTHS

# -------------------------------------------- set-up shared by the workers below (issue 58)
def _init_cp(cp, tp=1):
    """Megatron's parallel state with ``cp`` context-parallel (and ``tp`` tensor-parallel) ranks over
    this job, the CPU shim installed, the model-parallel RNG seeded."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from tests.megatron.cuda_shim import install

    install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(7)


def _te_model(hf, cp, head, tp=1, tp_rank=0, sequence_parallel=False):
    """``hf``'s weights in a GPTModel on the TE spec at megatron-core's ``context_parallel_size`` = ``cp``
    (every weight loaded: only TE's ``_extra_state`` may be missing)."""
    from hapo_openrlhf.megatron.convert import hf_to_megatron
    from hapo_openrlhf.megatron.model import build_gpt_model

    model = build_gpt_model(hf.config, tp=tp, spec="te", sequence_parallel=sequence_parallel, head=head,
                            perform_initialization=False, context_parallel_size=cp)
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config, spec="te", tp=tp,
                                                               tp_rank=tp_rank), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return model


# ---------------------------------------- megatron-core's GPTModel at CP=2 on the stand-in (issue 58)
def _cp_model_worker(rank, out_dir, cp):
    """One forward + backward of a tiny Qwen3 GPTModel on the TE spec with megatron-core's
    ``context_parallel_size`` = ``cp``, each rank fed its share of a packed batch (hapo's split, global
    ``cu_seqlens`` / ``cu_seqlens_padded`` in ``PackedSeqParams``): per-token log-probs and entropy
    keyed by (sequence, position), and rank 0's gradients after summing them over the CP group."""
    import json

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.megatron.test_convert import tiny_model

    _init_cp(cp)
    hf = tiny_model("qwen3", False, layers=2)
    model = _te_model(hf, cp, "logits")
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    weights = [torch.randn(2, n, generator=gen) for n in LENGTHS]  # per (sequence, position): the loss's weights
    sh = CP.shard(seqs, cp, ps.get_context_parallel_rank())
    cu, cu_p = (torch.tensor(c, dtype=torch.int32) for c in (sh.cu_seqlens, sh.cu_seqlens_padded))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                          cu_seqlens_kv_padded=cu_p, max_seqlen_q=sh.max_seqlen, max_seqlen_kv=sh.max_seqlen)
    logits = model(input_ids=sh.input_ids[None], position_ids=sh.position_ids[None], attention_mask=None,
                   packed_seq_params=psp)[0, :, :hf.config.vocab_size].float()
    logp = torch.log_softmax(logits, -1)
    lp, en = logp.gather(-1, sh.labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    where = {}  # local token -> (sequence, position) for the tokens the loss reads
    for j, p in enumerate(sh.indices.tolist()):
        s = max(i for i, a in enumerate(sh.cu_seqlens_padded[:-1]) if a <= p)
        if sh.loss_mask[j]:
            where[j] = (s, p - sh.cu_seqlens_padded[s])
    w = torch.zeros(2, lp.shape[0])
    for j, (s, i) in where.items():
        w[:, j] = weights[s][:, i]
    ((lp * w[0] + en * w[1]) * sh.loss_mask).sum().backward()  # this rank's share of the batch's loss
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if cp > 1:  # the batch's gradient: every share's summed over the CP group (megatron's DDP does it over DP x CP)
        for g in grads.values():
            dist.all_reduce(g, group=ps.get_context_parallel_group())
    rows = {f"{s}/{i}": [float(lp[j]), float(en[j])] for j, (s, i) in where.items()}
    (Path(out_dir) / f"cp{cp}_rank{rank}.json").write_text(json.dumps(rows))
    # again through all_gather_tokens: every rank computes the whole batch's loss from the gathered
    # log-probs and entropy; the gradients summed over CP are the same
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=sh.input_ids[None], position_ids=sh.position_ids[None], attention_mask=None,
                   packed_seq_params=psp)[0, :, :hf.config.vocab_size].float()
    logp = torch.log_softmax(logits, -1)
    lp, en = logp.gather(-1, sh.labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    group = ps.get_context_parallel_group() if cp > 1 else None
    lp_all, en_all = (CP.all_gather_tokens(t, sh.cu_seqlens_padded, group) for t in (lp, en))
    assert lp_all.shape == en_all.shape == (sh.cu_seqlens_padded[-1],)
    w_all = torch.zeros(2, lp_all.shape[0])  # 0 on padding and on each sequence's last token
    for s, (a, n) in enumerate(zip(sh.cu_seqlens_padded[:-1], LENGTHS)):
        w_all[:, a:a + n - 1] = weights[s][:, :n - 1]
    (lp_all * w_all[0] + en_all * w_all[1]).sum().backward()
    gathered = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if cp > 1:
        for g in gathered.values():
            dist.all_reduce(g, group=group)
    if rank == 0:
        torch.save(grads, Path(out_dir) / f"cp{cp}_grads.pt")
        torch.save(gathered, Path(out_dir) / f"cp{cp}_gathered_grads.pt")
        torch.save(lp_all.detach(), Path(out_dir) / f"cp{cp}_lp_all.pt")


def test_a_te_spec_gpt_model_at_cp2_equals_cp1_logprobs_entropy_and_gradients(tmp_path):
    """megatron-core's own model with ``context_parallel_size`` 2 (its CP group, its THD RoPE per CP
    rank, its TEDotProductAttention passing ``cp_group`` to the stand-in) on hapo's split equals the same
    model at CP=1 on the whole batch, token for token and in every parameter's gradient."""
    import json

    from tests.megatron._dist import spawn_te

    target = "tests.megatron.test_context_parallel:_cp_model_worker"
    spawn_te(target, 1, str(tmp_path), 1)
    spawn_te(target, 2, str(tmp_path), 2)
    one = json.loads((tmp_path / "cp1_rank0.json").read_text())
    two = [json.loads((tmp_path / f"cp2_rank{r}.json").read_text()) for r in range(2)]
    assert not set(two[0]) & set(two[1]) and set(two[0]) | set(two[1]) == set(one)  # each token on one rank
    assert len(one) == sum(n - 1 for n in LENGTHS) and min(map(len, two)) > 0
    for rows in two:
        for key, (lp, en) in rows.items():
            assert lp == pytest.approx(one[key][0], abs=2e-5) and en == pytest.approx(one[key][1], abs=2e-5), key
    g1, g2 = (torch.load(tmp_path / f"cp{c}_grads.pt") for c in (1, 2))
    assert set(g1) == set(g2) and all(g.abs().sum() > 0 for g in g1.values())
    for name, g in g1.items():
        torch.testing.assert_close(g2[name], g, rtol=1e-4, atol=2e-5, msg=name)
    # all_gather_tokens: the whole batch's log-probs on every CP rank, in the padded packed order, equal
    # CP=1's at the real tokens; the loss computed from them on every rank gives the same gradients
    lp1, lp2 = (torch.load(tmp_path / f"cp{c}_lp_all.pt") for c in (1, 2))
    at = [a + i for a, n in zip(CP.cumulative(CP.padded_lengths(LENGTHS, 4)), LENGTHS) for i in range(n - 1)]
    at1 = [a + i for a, n in zip(CP.cumulative(LENGTHS), LENGTHS) for i in range(n - 1)]
    torch.testing.assert_close(lp2[at], lp1[at1], rtol=0, atol=2e-5)
    for c in (1, 2):
        for name, g in torch.load(tmp_path / f"cp{c}_gathered_grads.pt").items():
            torch.testing.assert_close(g, g1[name], rtol=1e-4, atol=2e-5, msg=(c, name))


# ------------------------------ hapo's log-prob path at CP=2 (context_parallel.CPRows, issue 58)
def _cp_rows_by_hand(model, ids, am):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron import head as heads
    from hapo_openrlhf.megatron.schedule import RowLayout

    lay = RowLayout.of(am, "thd")
    rows = CP.CPRows(lay.starts_host.tolist(), lay.lengths_host.tolist(), ids, None)
    out = model(**rows.model_inputs())
    weight = heads.output_weight(model) if heads.is_installed(model) else None
    return rows.logprobs_entropy(out, vocab_size=259, temperature=1.0, chunk_size=5,
                                 tp_group=ps.get_tensor_model_parallel_group(), tp_rank=0, weight=weight)


def _cp_logprobs_worker(rank, out_dir, cp):
    """hapo's next-token log-probs and entropy of a left/right padded [B, S] batch through a tiny
    Qwen3 on the TE spec, with the logits head and the fused head: at CP=1 hapo's THD path
    (``schedule.logprobs_and_entropy``) and ``context_parallel.CPRows`` without a group; at CP=2
    ``schedule.logprobs_and_entropy`` on each rank (CPRows under CP). Each: [B, S-1] values and the gradients (summed over CP) of a weighted loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy
    from tests.megatron.test_convert import tiny_model
    from tests.megatron.test_tensor_parallel import _batch, _both_real

    _init_cp(cp)
    hf = tiny_model("qwen3", False, layers=2)
    ids, am, w_lp, w_en = _batch()
    am[0, -3:] = 0  # right padding too
    am[2, :11] = 0  # a one-token row: no next token
    valid = _both_real(am).float()
    group = ps.get_context_parallel_group() if cp > 1 else None  # the gradients are summed over it
    results = {}
    for head in ("logits", "fused"):
        model = _te_model(hf, cp, head)
        if cp == 1:  # CPRows without a CP group, by hand, beside hapo's THD path
            paths = {"cp": lambda: _cp_rows_by_hand(model, ids, am),
                     "schedule": lambda: logprobs_and_entropy(model, ids, am, vocab_size=259, chunk_size=5)}
        else:  # the parallel state has CP 2: the schedule's entry point takes CPRows
            paths = {"cp": lambda: logprobs_and_entropy(model, ids, am, vocab_size=259, chunk_size=5)}
        for name, run in paths.items():
            model.zero_grad(set_to_none=True)
            lp, en = run()
            ((lp * w_lp * valid).sum() + (en * w_en * valid).sum()).backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            for g in grads.values() if group is not None else ():
                dist.all_reduce(g, group=group)
            results[f"{head}/{name}"] = {"lp": lp.detach(), "en": en.detach(), "grads": grads, "valid": valid}
    if rank == 0:
        torch.save(results, Path(out_dir) / f"cp{cp}.pt")
    else:  # every CP rank holds the whole batch's values
        torch.save({k: {"lp": v["lp"], "en": v["en"]} for k, v in results.items()}, Path(out_dir) / f"cp{cp}_r1.pt")


def test_hapos_logprobs_and_entropy_at_cp2_equal_cp1_with_both_heads(tmp_path):
    """``schedule.logprobs_and_entropy`` at CP=2 (``context_parallel.CPRows``) -- hapo's split, megatron-core's model on the TE
    stand-in, the logits or the fused head on each rank's tokens with their global labels, the values
    gathered over CP -- equals hapo's THD path at CP=1 ([B, S-1], left and right padding, a one-token
    row), and so do the gradients of a loss on them summed over CP; at CP=1 the two paths are one."""
    from tests.megatron._dist import spawn_te

    target = "tests.megatron.test_context_parallel:_cp_logprobs_worker"
    spawn_te(target, 1, str(tmp_path), 1)
    spawn_te(target, 2, str(tmp_path), 2)
    one, two, two_r1 = (torch.load(tmp_path / f) for f in ("cp1.pt", "cp2.pt", "cp2_r1.pt"))
    for head in ("logits", "fused"):
        ref = one[f"{head}/schedule"]
        valid = ref["valid"].bool()
        assert valid.sum() > 10 and not valid[2].any()
        for got in (one[f"{head}/cp"], two[f"{head}/cp"], two_r1[f"{head}/cp"]):
            torch.testing.assert_close(got["lp"][valid], ref["lp"][valid], rtol=0, atol=2e-5)
            torch.testing.assert_close(got["en"][valid], ref["en"][valid], rtol=0, atol=2e-5)
            assert (got["lp"][~valid] == 0).all()  # nothing where a row has no next real token
        for got in (one[f"{head}/cp"], two[f"{head}/cp"]):
            assert set(got["grads"]) == set(ref["grads"])
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=2e-5, msg=(head, n))


def _tp2_cp2_worker(rank, out_dir):
    """TP=2 x CP=2 with sequence parallelism on 4 ranks (TP groups (0, 1), (2, 3); CP groups (0, 2),
    (1, 3)), both heads: ``schedule.logprobs_and_entropy`` under CP and the gradients of a loss on it --
    summed over CP, Qwen3's TP-replicated norms summed over TP -- with rank 0 holding both TP shards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.schedule import allreduce_tp_replicated_grads, logprobs_and_entropy
    from tests.megatron.test_convert import tiny_model
    from tests.megatron.test_tensor_parallel import T, _batch, _both_real

    _init_cp(2, tp=2)
    tp_rank, cp_group = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_group()
    hf = tiny_model("qwen3", False, layers=2)
    ids, am, w_lp, w_en = _batch()
    am[0, -3:] = 0
    valid = _both_real(am).float()
    results = {}
    for head in ("logits", "fused"):
        model = _te_model(hf, 2, head, tp=2, tp_rank=tp_rank, sequence_parallel=True)
        lp, en = logprobs_and_entropy(model, ids, am, vocab_size=259, temperature=T, chunk_size=5)
        ((lp * w_lp * valid).sum() + (en * w_en * valid).sum()).backward()
        allreduce_tp_replicated_grads(model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=cp_group)
        shards = [None, None]
        dist.all_gather_object(shards, grads, group=ps.get_tensor_model_parallel_group())
        results[head] = {"lp": lp.detach(), "en": en.detach(), "grads": shards}
    if rank == 0:
        torch.save(results, Path(out_dir) / "tp2cp2.pt")


def test_tp2_x_cp2_with_sequence_parallelism_equals_hugging_face_with_both_heads(tmp_path):
    """4 ranks, TP=2 x CP=2 with sequence parallelism on the TE spec: hapo's log-probs and entropy
    under CP and every parameter's gradient (the TP shards merged) equal Hugging Face's (the
    tolerance of the TP=2 TE-spec test, test_te_spec.py)."""
    from hapo_openrlhf.megatron.convert import megatron_to_hf
    from tests.megatron._dist import spawn_te
    from tests.megatron.test_convert import tiny_model
    from tests.megatron.test_tensor_parallel import _batch, _both_real, _hf_reference

    spawn_te("tests.megatron.test_context_parallel:_tp2_cp2_worker", 4, str(tmp_path))
    got = torch.load(tmp_path / "tp2cp2.pt")
    hf = tiny_model("qwen3", False, layers=2)
    ids, am, w_lp, w_en = _batch()
    am[0, -3:] = 0
    ref_lp, ref_en, ref_grads = _hf_reference(hf, ids, am, w_lp.double(), w_en.double())
    valid = _both_real(am)
    for head, r in got.items():
        torch.testing.assert_close(r["lp"].double()[valid], ref_lp[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r["en"].double()[valid], ref_en[valid], rtol=1e-4, atol=1e-4)
        merged = megatron_to_hf({(0, t): r["grads"][t] for t in range(2)}, hf.config, tp=2, pp=1)
        assert set(merged) == set(ref_grads)
        for n, g in merged.items():
            torch.testing.assert_close(g.double(), ref_grads[n], rtol=1e-3, atol=1e-5, msg=(head, n))


# ------------------------------ two optimizer steps at CP=2 through hapo's schedule (issue 58)
def _cp_train_worker(rank, out):
    from megatron.core import parallel_state as ps

    from tests.megatron.test_ddp import train_two_steps

    _init_cp(2)
    assert ps.get_data_parallel_world_size() == 1 and ps.get_data_parallel_world_size(with_context_parallel=True) == 2
    train_two_steps(rank, 1, 1, True, "fp32", out, spec="te")


def test_two_steps_at_cp2_through_the_schedule_equal_hf_adamw(tmp_path):
    """test_ddp's two steps (packed micro-batches, hapo's global normaliser, Megatron's DDP and
    distributed optimizer, clipping) at CP=2 on the TE spec: ``schedule.forward_backward`` forwards
    each rank's share and gathers the log-probs (``context_parallel.CPRows``), megatron-core's DDP
    sums the shares' gradients over DP x CP and its distributed optimizer shards the state over it:
    the weights, grad norms and losses equal Hugging Face + AdamW's, as at CP=1; both CP ranks hold
    the same weights after each step, and each holds half the optimizer state."""
    from tests.megatron._dist import spawn_te
    from tests.megatron.test_ddp import _assert_matches_reference, hf_reference, tiny_qwen2

    out = tmp_path / "cp2_two_steps.pt"
    spawn_te("tests.megatron.test_context_parallel:_cp_train_worker", 2, str(out))
    got = torch.load(out)
    _assert_matches_reference(got, hf_reference(True), True)
    # fp32 model: Adam's two moments, 8 bytes per parameter unsharded (more with the padded vocabulary);
    # sharded over DP x CP = 2 each rank holds about half
    n_params = sum(v.numel() for k, v in tiny_qwen2(True, layers=2).state_dict().items() if k != "lm_head.weight")
    assert got["state_bytes"] <= 0.55 * 8 * n_params, (got["state_bytes"], n_params)


# ----------------------------------------------------------- checkpoints across CP (issue 58)
def _cp_resume_worker(rank, cp, ckpt, phase, out):

    from tests.megatron.test_ddp import _resume_worker

    _init_cp(cp)
    _resume_worker(rank, 1, "dp_reshardable", ckpt, phase, out, spec="te", init=False, dtype=torch.float32)


def test_a_cp2_checkpoint_resumes_bitwise_at_cp2_and_at_cp1(tmp_path):
    """test_ddp's resume at CP=2 on the TE spec (an fp32 model, the distributed optimizer sharded over
    DP x CP, ``dp_reshardable``): 2 steps, save, 2 more in fresh processes == 4 uninterrupted
    steps bitwise; ``hapo_layout.json`` records CP 2; the same checkpoint resumes at CP=1 on one rank
    (the state regathered from the two shards), equal up to reduction order, as DP=2 -> DP=1 does.
    An fp32 model, whose distributed optimizer's masters are views of the parameters themselves: its
    resume stopped in megatron-core's loader until ``ddp.MegatronOptimizer.load_state_dict`` ran it under
    ``no_grad`` (found here; at CP=1 and DP=2 too)."""
    import json

    from hapo_openrlhf.megatron import checkpoint
    from tests.megatron._dist import spawn_te

    target, ckpt = "tests.megatron.test_context_parallel:_cp_resume_worker", tmp_path / "ckpt"
    for phase in ("full", "first", "resume"):
        spawn_te(target, 2, 2, str(ckpt), phase, str(tmp_path / phase))
    layout = json.loads((ckpt / "step_2" / checkpoint.LAYOUT).read_text())
    assert (layout["context_parallel"], layout["data_parallel"], layout["optimizer"]) == (
        2, 1, "distributed/dp_reshardable")
    for r in range(2):
        full, resumed = torch.load(tmp_path / f"full.{r}"), torch.load(tmp_path / f"resume.{r}")
        assert full["losses"] == resumed["losses"] and len(full["losses"]) == 4
        for k, v in full["weights"].items():
            assert v.dtype == torch.float32 and torch.equal(v, resumed["weights"][k]), k
        assert all(torch.equal(a, b) for a, b in zip(full["masters"], resumed["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(full["moments"], resumed["moments"]))
    a0, a1 = (torch.load(tmp_path / f"full.{r}") for r in range(2))  # both CP ranks: one model
    assert all(torch.equal(v, a1["weights"][k]) for k, v in a0["weights"].items())

    spawn_te(target, 1, 1, str(ckpt), "resume", str(tmp_path / "cp1"))
    full, first, cp1 = (torch.load(tmp_path / f"{n}.0") for n in ("full", "first", "cp1"))
    assert cp1["losses"][:2] == full["losses"][:2] and cp1["steps"] == {4.0}
    # steps 3-4 (loss, grad norm) and the weights: CP=1 computes attention in one pass where CP=2 gathers
    # K / V, so fp32 rounding differs (an fp32 model: a bf16 one would differ at bf16's 2^-8)
    assert [x for st in cp1["losses"][2:] for x in st] == pytest.approx(
        [x for st in full["losses"][2:] for x in st], rel=1e-5)
    for k, v in full["weights"].items():
        assert not torch.equal(v, first["weights"][k]) or k.endswith("bias"), k  # steps 3-4 moved it
        torch.testing.assert_close(cp1["weights"][k], v, rtol=1e-5, atol=1e-6, msg=k)


# ---------------------- the head's token-local values under CP: the nucleus log-mass, PAEC's signals
def _cp_taps_worker(rank, out_dir, cp):
    """Through ``schedule.forward_backward`` on the TE spec with the fused head: the old-log-prob pass
    with ``taps.NucleusLogMass`` (log-probs, entropy, log P(nucleus)) and a training pass with
    ``taps.HeadSignals`` (PAEC's nucleus entropy and top-two gap handed to the loss), at CP = ``cp``."""

    from hapo_openrlhf.megatron.schedule import forward_backward
    from hapo_openrlhf.megatron.taps import HeadSignals, NucleusLogMass
    from tests.megatron.test_convert import tiny_model
    from tests.megatron.test_tensor_parallel import _batch

    _init_cp(cp)
    hf = tiny_model("qwen3", False, layers=2)
    model = _te_model(hf, cp, "fused")
    ids, am, _, _ = _batch()
    am[0, -3:] = 0
    mbs = [{"input_ids": ids[:2], "attention_mask": am[:2]}, {"input_ids": ids[2:], "attention_mask": am[2:]}]
    old = forward_backward(model, mbs, None, vocab_size=259, chunk_size=5, taps=[NucleusLogMass(0.9)])
    seen = []

    def loss_fn(lp, en, mb):
        seen.append(tuple(t.detach().clone() for t in mb["head_signals"]))
        return lp.sum() * 0, {}

    forward_backward(model, mbs, loss_fn, vocab_size=259, chunk_size=5, taps=[HeadSignals(0.9)])
    torch.save({"old": [tuple(t.detach() for t in r) for r in old], "signals": seen},
               Path(out_dir) / f"taps_cp{cp}_rank{rank}.pt")


def test_the_nucleus_logmass_and_paecs_signals_at_cp2_equal_cp1():
    """The two taps that read the head's token-local values run under CP (the schedule refuses the
    others by name): at CP=2 every rank returns the whole micro-batch's log-probs, entropy and log
    P(nucleus), and hands the loss the whole micro-batch's PAEC signals, equal to CP=1's."""
    import tempfile

    from tests.megatron._dist import spawn_te

    with tempfile.TemporaryDirectory() as d:
        target = "tests.megatron.test_context_parallel:_cp_taps_worker"
        spawn_te(target, 1, d, 1)
        spawn_te(target, 2, d, 2)
        one, *two = (torch.load(Path(d) / f) for f in ("taps_cp1_rank0.pt", "taps_cp2_rank0.pt", "taps_cp2_rank1.pt"))
    from tests.megatron.test_tensor_parallel import _batch, _both_real

    _, am, _, _ = _batch()
    am[0, -3:] = 0
    valid = [_both_real(am[:2]), _both_real(am[2:])]
    for got in two:
        for key in ("old", "signals"):
            assert len(got[key]) == len(one[key]) == 2
            for m, (a, b) in enumerate(zip(got[key], one[key])):
                assert len(a) == len(b) == (3 if key == "old" else 2)
                for x, y in zip(a, b):
                    torch.testing.assert_close(x[valid[m]], y[valid[m]], rtol=0, atol=2e-5)
    assert all(float(lm[valid[m]].max()) < 0 for m, (_, _, lm) in enumerate(one["old"]))  # top-p 0.9 < 1


def _gpu_smoke_cp_worker(rank, out_dir):
    from hapo_openrlhf.gpu_smoke import te_spec_check
    from tests.megatron.cuda_shim import install

    install()
    torch.save(te_spec_check("cpu", cp=2), Path(out_dir) / f"smoke{rank}.pt")


def test_the_gpu_smokes_cp2_check_runs_on_the_stand_in(tmp_path):
    """``hapo doctor --gpu-smoke``'s context-parallel check (there: two GPUs and the real TE's ring):
    the TE-spec model at CP 2 against Hugging Face, here on two gloo ranks under the stand-in."""
    from tests.megatron._dist import spawn_te

    spawn_te("tests.megatron.test_context_parallel:_gpu_smoke_cp_worker", 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"smoke{r}.pt")
        assert res["ok"] and res["cp"] == 2 and res["loaded_strict"] and res["stream_exact"] is None, res
        assert res["logprob_max_abs_err"] < 1e-4 and res["entropy_max_abs_err"] < 1e-4, res


def _memory_worker(rank, out_dir, cp):
    """A TE-spec tiny Qwen3's forward and backward through hapo's schedule on two 512-token sequences,
    at ``cp`` CP ranks: the elements of Q entering the core attention and of the largest tensor any op
    makes outside it (its forward and its backward), counted by a dispatch mode (the stand-in's own K/V gather and scores are not
    TE's kernel, which keeps two K/V chunks in flight: memory.activation_bytes counts those)."""
    import json

    from torch.utils._python_dispatch import TorchDispatchMode

    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy
    from tests.megatron.test_convert import tiny_model

    _init_cp(cp)
    hf = tiny_model("qwen3", False, layers=2)
    model = _te_model(hf, cp, "fused")
    seen = {"inside": 0, "largest": 0, "q": 0}
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        core.register_forward_pre_hook(lambda m, args: seen.update(inside=seen["inside"] + 1,
                                                                   q=max(seen["q"], args[0].numel())))
        core.register_forward_hook(lambda m, args, out: seen.update(inside=seen["inside"] - 1))
        core.register_full_backward_pre_hook(lambda m, grad_out: seen.update(inside=seen["inside"] + 1))
        core.register_full_backward_hook(lambda m, grad_in, grad_out: seen.update(inside=seen["inside"] - 1))

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not seen["inside"]:
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        seen["largest"] = max(seen["largest"], t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (2, 512), generator=g)
    am = torch.ones_like(ids)
    with Largest():
        lp, en = logprobs_and_entropy(model, ids, am, vocab_size=259, chunk_size=64)
        (lp.sum() + en.sum()).backward()
    if rank == 0:
        (Path(out_dir) / f"memory_cp{cp}.json").write_text(json.dumps({k: seen[k] for k in ("largest", "q")}))


def test_cp2_halves_the_attention_inputs_and_the_largest_activation_per_rank(tmp_path):
    """Issue 58's memory proxy on the CPU: per rank, Q entering the core attention and the largest
    tensor outside it (forward and backward, the fused head in 64-token chunks) are exactly half at
    CP 2 of what they are at CP 1. docs/megatron.md has the per-rank figures of the 64k and 128k
    configs (the dry run's arithmetic at full size)."""
    import json

    from tests.megatron._dist import spawn_te

    for cp in (1, 2):
        spawn_te("tests.megatron.test_context_parallel:_memory_worker", cp, str(tmp_path), cp)
    one, two = (json.loads((tmp_path / f"memory_cp{cp}.json").read_text()) for cp in (1, 2))
    assert one["q"] == 1024 * 4 * 24 and two["q"] * 2 == one["q"], (one, two)  # [T, heads, head_dim]
    assert two["largest"] * 2 == one["largest"], (one, two)
    assert one["largest"] >= 1024 * 128  # an activation ([T, ffn] or wider), not a weight
