"""Training a Qwen3-MoE model on the Megatron back end (issue 41): two AdamW steps with
clipping at EP=2 (and EP=1 at DP=2, and PP=2) under Megatron's DDP and distributed optimizer (each expert's gradient reduced
over its expert-data-parallel group, the rest over DP; the norm over both) equal transformers'
``Qwen3MoeForCausalLM`` stepped by torch's AdamW -- weights to 2e-6, norms and losses to 1e-5.

The load-balancing loss: at coefficient 0 it adds nothing (the run equals Hugging Face, which
has none); at 0.1 the run equals the Hugging Face reference plus ``0.1`` x the token-weighted
mean over micro-batches of megatron-core's own ``switch_load_balancing_loss_func`` on the
Hugging Face router's scores, summed over layers (``moe.scaled_aux_loss``) -- and differs from
the coefficient-0 run far beyond the tolerance. Padding tokens stay out of it (``padded`` rows).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ._dist import init_megatron, spawn
from .test_moe import tiny_moe

ROWS, S, STEPS, LR, CLIP, EPS, COEFF = 4, 10, 2, 1e-3, 1.0, 1e-4, 0.1


def _data(step: int):
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, 259, (ROWS, S), generator=g)
    am = torch.ones(ROWS, S, dtype=torch.long)
    am[1, :3] = 0  # left padding, as rollouts are
    am[3, -2:] = 0  # a short response
    return ids, am, torch.randn(ROWS, S - 1, generator=g)


def _valid(am):
    return (am[:, :-1] * am[:, 1:]).bool()


def _reference(coeff: float, dp: int):
    """(checkpoint-named HF state after STEPS, norms, losses): fp32 Qwen3-MoE, torch AdamW; with
    ``coeff`` megatron-core's load-balancing loss per micro-batch (one per data-parallel rank)."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    from hapo_openrlhf.megatron.moe import to_checkpoint_names

    hf = tiny_moe()
    k, E = hf.config.num_experts_per_tok, hf.config.num_experts
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0])) for layer in hf.model.layers]
    norms, losses = [], []
    for step in range(STEPS):
        ids, am, w = _data(step)
        logits.clear()
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        out = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
        lp = torch.log_softmax(out, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = _valid(am)
        loss = -(lp * w)[m].sum() / m.sum()
        total = loss
        if coeff:
            real = am.bool().reshape(-1)
            n_all = int(real.sum())
            for rows in torch.arange(ROWS).chunk(dp):  # each data-parallel rank's micro-batch
                mine = torch.zeros(ROWS, S, dtype=torch.bool)
                mine[rows] = True
                sel = mine.reshape(-1) & real
                n = int(sel.sum())
                for lg in logits:  # [B*S, E] per layer: megatron-core's aux-loss scores and routing
                    scores = torch.softmax(lg[sel].float(), -1)
                    tpe = torch.zeros_like(scores).scatter(1, torch.topk(scores, k, -1).indices, 1).sum(0)
                    aux = switch_load_balancing_loss_func(scores, tpe, n, k, E, coeff)
                    total = total + aux * n / n_all
        opt.zero_grad()
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)))
        losses.append(float(loss))
        opt.step()
    for h in hooks:
        h.remove()
    return to_checkpoint_names({n: v.detach().clone() for n, v in hf.state_dict().items()}, hf.config), norms, losses


def _train(coeff: float, layout: str, dispatcher: str, pp: int = 1, tp: int = 1, spec: str = "local"):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.ddp import MegatronOptimizer, wrap
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward
    from hapo_openrlhf.megatron.taps import AuxLossScale

    from ._dist import load_hf_into

    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    hf = tiny_moe()
    model = build_gpt_model(hf.config, ep=ep, moe={"dispatcher": dispatcher, "aux_loss_coeff": coeff},
                            perform_initialization=False, pp=pp, pp_rank=pp_rank, tp=tp, spec=spec,
                            sequence_parallel=tp > 1, context_parallel_size=cp)
    load_hf_into(model, hf, ep=ep, ep_rank=ep_rank, pp=pp, pp_rank=pp_rank, tp=tp, tp_rank=tp_rank, spec=spec)
    ddp = wrap(model, distributed_optimizer=True)
    opt = MegatronOptimizer(ddp, lr=LR, eps=EPS, clip_grad=CLIP)
    norms, losses = [], []
    for step in range(STEPS):
        ids, am, w = _data(step)
        n_global = int(_valid(am).sum())
        rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
        # one micro-batch per data-parallel rank; with pipelining two (each stage works on one while the
        # other stage has the other)
        step_rows = list(range(rows.start, rows.stop))
        parts = [step_rows] if pp == 1 else [step_rows[: len(step_rows) // 2], step_rows[len(step_rows) // 2:]]
        mbs = [{"input_ids": ids[r], "attention_mask": am[r], "w": w[r]} for r in parts]

        def loss_fn(lp, en, mb):  # this replica's share of the global mean, times DP (hapo's convention)
            return -(lp * mb["w"] * _valid(mb["attention_mask"])).sum() / n_global * dp, {}

        res = forward_backward(ddp, mbs, loss_fn, vocab_size=259, layout=layout,
                               taps=[AuxLossScale(float(am.sum()) / dp)])
        loss = torch.tensor(sum(float(r["loss"]) for r in res) / dp if tp_rank == cp_rank == 0 else 0.0,
                            dtype=torch.float64)
        dist.all_reduce(loss)  # the last stage of each replica holds its share (on every TP and CP rank: counted once)
        losses.append(float(loss))
        norms.append(opt.step())
    return model, hf.config, norms, losses


def _worker(rank, world, ep, layout, dispatcher, out, pp=1, tp=1, spec="local", micro_batches=None, cp=1):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import megatron_to_hf

    init_megatron(ep=ep, pp=pp, tp=tp, cp=cp)
    got = {}
    for coeff in (0.0, COEFF):
        model, cfg, norms, losses = _train(coeff, layout, dispatcher, pp, tp, spec)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        everyone = [None] * world
        dist.all_gather_object(everyone, (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                                          ps.get_tensor_model_parallel_rank(), sd))
        shards = {(s, e, r): d for s, e, r, d in everyone} if ep > 1 else {(s, r): d for s, _, r, d in everyone}
        got[coeff] = (megatron_to_hf(shards, cfg, tp=tp, pp=pp, ep=ep), norms, losses)
        # the experts are in megatron-core's expert-parallel buffers at every EP (model.build_gpt_model)
        assert {n for n, p in model.named_parameters() if not getattr(p, "allreduce", True)} == \
            {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
    if rank == 0:
        torch.save({"got": got, "ref": {c: _reference(c, micro_batches or world) for c in (0.0, COEFF)}}, out)


def _te_worker(rank, world, ep, layout, dispatcher, out, pp, tp, micro_batches, cp=1):
    """:func:`_worker` on Transformer Engine's spec (the stand-in; ranks from the TE fork server) with sequence
    parallelism at TP > 1 and context parallelism at ``cp`` > 1."""
    _worker(rank, world, ep, layout, dispatcher, out, pp=pp, tp=tp, spec="te", micro_batches=micro_batches, cp=cp)


@pytest.mark.parametrize("ep, pp, layout, dispatcher", [(2, 1, "thd", "alltoall"), (2, 1, "padded", "allgather"),
                                                        (1, 1, "thd", "alltoall"), (1, 2, "thd", "alltoall")],
                         ids=["ep2_thd_alltoall", "ep2_padded_allgather", "ep1_dp2", "pp2"])
def test_two_steps_with_the_distributed_optimizer_equal_hf_adamw(tmp_path, ep, pp, layout, dispatcher):
    """EP=2 (each rank two experts, both dispatchers), EP=1 at DP=2 (every expert on both ranks,
    reduced over the expert-data-parallel group) and PP=2 (one MoE layer per stage, two micro-batches
    through the 1F1B schedule; the replicated optimizer at DP=1)."""
    out = tmp_path / "res.pt"
    spawn(_worker, 2, 2, ep, layout, dispatcher, str(out), pp)
    _check_against_hf(torch.load(out))


def test_tp2_pp2_sequence_parallel_moe_with_the_load_balancing_loss_equals_hf_adamw(tmp_path):
    """TP=2 x PP=2 on four ranks, Transformer Engine's spec (the stand-in) with sequence parallelism,
    a load-balancing loss: megatron-core scatters GPTModel's padding mask to each TP rank's sequence
    chunk only on the first stage, so the second stage's routers got the whole mask against their
    chunk of tokens and stopped ([S/TP*B, E] against [S*B, 1]); the schedule now hands a later stage
    its own chunk. Two steps == Hugging Face + megatron-core's load-balancing loss, as above."""
    from ._dist import spawn_te

    out = tmp_path / "res.pt"
    spawn_te("tests.megatron.test_moe_train:_te_worker", 4, 4, 1, "thd", "alltoall", str(out), 2, 2, 2)
    _check_against_hf(torch.load(out))


def test_ep2_x_cp2_with_the_load_balancing_loss_equals_hf_adamw(tmp_path):
    """Context parallelism (issue 58) at EP 2 x CP 2 on two ranks (EP carved out of DP x CP), the TE
    spec (the stand-in's CP attention), packed micro-batches: each rank forwards its share of every
    sequence, its routers compute the load-balancing loss on that share against the expert counts of
    the whole micro-batch (megatron-core reduces them over TP x CP; under 0.19 it weights each rank's
    loss by the TP x CP group, ``compat.aux_loss_token_factor``); the shares' gradients are summed
    over DP x CP. Two steps == Hugging Face + megatron-core's load-balancing loss on the whole
    micro-batch (one data-parallel replica), as above, with and without the loss."""
    from ._dist import spawn_te

    out = tmp_path / "res.pt"
    spawn_te("tests.megatron.test_moe_train:_te_worker", 2, 2, 2, "thd", "alltoall", str(out), 1, 1, 1, 2)
    _check_against_hf(torch.load(out))


def _check_against_hf(res):
    start = {}
    from hapo_openrlhf.megatron.moe import to_checkpoint_names

    base = tiny_moe()
    start = to_checkpoint_names(base.state_dict(), base.config)
    for coeff in (0.0, COEFF):
        (sd, norms, losses), (ref_sd, ref_norms, ref_losses) = res["got"][coeff], res["ref"][coeff]
        assert set(sd) == set(ref_sd)
        moved = max(float((ref_sd[n] - start[n]).abs().max()) for n in ref_sd)
        assert moved > 500 * 2e-6  # two steps of lr 1e-3 moved the weights far beyond the tolerance
        for n, v in ref_sd.items():
            torch.testing.assert_close(sd[n], v, rtol=0, atol=2e-6, msg=lambda m, n=n: f"coeff {coeff} {n}: {m}")
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    # the load-balancing loss moved the routers (and through them the rest) beyond the tolerance
    a, b = res["got"][0.0][0], res["got"][COEFF][0]
    router = [n for n in a if n.endswith("mlp.gate.weight")]
    assert max(float((a[n] - b[n]).abs().max()) for n in router) > 1e-4
