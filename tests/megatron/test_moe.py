"""Qwen3-MoE on the Megatron back end (issue 41): megatron-core's ``MoELayer`` (local spec,
``SequentialMLP`` experts, the all-to-all and all-gather token dispatchers) against
transformers 5.15's ``Qwen3MoeForCausalLM``.

* The expert weights' two Hugging Face layouts -- the checkpoint's per-expert tensors and
  transformers' fused in-memory ``gate_up_proj`` / ``down_proj`` -- are what transformers itself
  writes and reads (``save_pretrained`` / ``from_pretrained``).
* HF -> Megatron -> HF is exact at TP x EP x PP in {1, 2}^3 (pure tensors).
* On gloo ranks at EP=1, EP=2 (both dispatchers) and EP=2 x DP=4 (four ranks, each expert on two
  data-parallel replicas): log-probs and entropy equal Hugging Face's, and so does every
  gradient -- the router's, every expert's (summed over the ranks that hold it, from the tokens
  of every data-parallel rank in its expert-parallel group) and the rest.
* MoE with TP > 1 needs sequence parallelism (megatron-core double-counts expert gradients
  without it, where every TP rank holds every token; it refuses that in training), which needs
  the TE spec: on the TE stand-in, TP=2 x EP=2 (four ranks) and TP=2 x EP=1 equal Hugging Face.
* Hostile layouts and settings are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ._dist import init_megatron, spawn

T = 0.8


def tiny_moe_config(layers: int = 2, experts: int = 4, top_k: int = 2, norm_topk_prob: bool = True, tied=False):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=259, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                          max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied)


def tiny_moe(**kw):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = tiny_moe_config(**kw)
    cfg._experts_implementation = "eager"  # transformers' loop over experts (grouped_mm has no float64)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.3)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # decisive routing: no near-tie between the k-th and the next expert
            elif "experts" in n:
                p.normal_(0.0, 0.1)
    return model


def test_checkpoint_names_are_what_transformers_writes_and_reads(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    from hapo_openrlhf.megatron.moe import to_checkpoint_names, to_fused_names

    model = tiny_moe()
    model.save_pretrained(tmp_path / "saved")
    on_disk = load_file(tmp_path / "saved" / "model.safetensors")
    ours = to_checkpoint_names(model.state_dict(), model.config)
    ours.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    assert ours.keys() == on_disk.keys()
    assert all(torch.equal(ours[k], v) for k, v in on_disk.items())
    fused = to_fused_names(on_disk, model.config)
    assert all(torch.equal(fused[k], v) for k, v in model.state_dict().items())
    # a checkpoint written under our names loads back through transformers' own conversion
    (tmp_path / "ours").mkdir()
    save_file({k: v.contiguous() for k, v in ours.items()}, tmp_path / "ours" / "model.safetensors")
    model.config.save_pretrained(tmp_path / "ours")
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("tp, ep, pp", [(t, e, p) for t in (1, 2) for e in (1, 2) for p in (1, 2)])
def test_round_trip_is_exact(tp, ep, pp):
    from hapo_openrlhf.megatron.convert import hf_to_megatron, megatron_to_hf
    from hapo_openrlhf.megatron.moe import to_checkpoint_names

    model = tiny_moe(layers=4)
    sd, cfg = model.state_dict(), model.config
    ckpt = to_checkpoint_names(sd, cfg)
    shards = {}
    for s in range(pp):
        for e in range(ep):
            for r in range(tp):
                shard = hf_to_megatron(sd, cfg, tp=tp, tp_rank=r, pp=pp, pp_rank=s, ep=ep, ep_rank=e)
                same = hf_to_megatron(ckpt, cfg, tp=tp, tp_rank=r, pp=pp, pp_rank=s, ep=ep, ep_rank=e)
                assert shard.keys() == same.keys() and all(torch.equal(shard[k], same[k]) for k in shard)
                experts = [k for k in shard if ".local_experts." in k]
                assert len(experts) == 2 * (4 // pp) * (4 // ep)  # fc1 + fc2 per local expert per layer
                shards[(s, e, r) if ep > 1 else (s, r)] = shard
    back = megatron_to_hf(shards, cfg, tp=tp, pp=pp, ep=ep)
    assert back.keys() == ckpt.keys()
    assert all(torch.equal(back[k], v) for k, v in ckpt.items())


def test_hostile_moe_layouts_and_settings_are_refused_by_name():
    from hapo_openrlhf.megatron.convert import hf_to_megatron
    from hapo_openrlhf.megatron.families import family_of
    from hapo_openrlhf.megatron.moe import moe_config_kwargs

    model = tiny_moe(experts=4)
    sd, cfg = model.state_dict(), model.config
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by expert parallel size 3"):
        hf_to_megatron(sd, cfg, ep=3)
    with pytest.raises(ValueError, match="moe_intermediate_size 32 is not divisible by tensor parallel size 3"):
        hf_to_megatron(sd, cfg, tp=3)
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be between 1 and num_experts 4"):
        family_of(tiny_moe_config(top_k=5))
    dense_between = tiny_moe_config()
    dense_between.mlp_only_layers = [1]
    with pytest.raises(ValueError, match="dense MLP layers between the sparse ones"):
        family_of(dense_between)
    # Transformer Engine's spec: the MoE layer's pre-MLP norm is a TENorm of its own, not fused into fc1
    te = hf_to_megatron(sd, cfg, spec="te")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te and not any("linear_fc1.layer_norm" in k for k in te)
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        moe_config_kwargs(cfg, dispatcher="flex")
    with pytest.raises(ValueError, match="aux_loss_coeff must be >= 0"):
        moe_config_kwargs(cfg, aux_loss_coeff=-0.1)
    from hapo_openrlhf.megatron.model import transformer_config

    with pytest.raises(ValueError, match="mixture of experts at tensor_parallel 2 needs sequence parallelism"):
        transformer_config(cfg, tp=2)
    from transformers import Qwen3Config

    with pytest.raises(ValueError, match="expert parallel size 2 needs a mixture-of-experts model"):
        hf_to_megatron({}, Qwen3Config(num_hidden_layers=2), ep=2)
    # megatron-core's fused router returns before compute_topk, where replay substitutes the routes
    from hapo_openrlhf.megatron.model import build_gpt_model

    with pytest.raises(ValueError, match="routing replay .* with moe_router_fusion: the fused router returns before"):
        build_gpt_model(cfg, routing_replay=True, moe_router_fusion=True)


def test_router_defaults_are_the_rl_safe_ones():
    from hapo_openrlhf.megatron.moe import moe_config_kwargs

    kw = moe_config_kwargs(tiny_moe_config(norm_topk_prob=True))
    assert kw["moe_aux_loss_coeff"] == 0.0 and kw["moe_router_load_balancing_type"] == "none"
    assert kw["moe_router_dtype"] == "fp32" and kw["moe_router_enable_expert_bias"] is False
    assert kw["moe_token_dispatcher_type"] == "alltoall" and kw["moe_router_pre_softmax"] is False
    assert moe_config_kwargs(tiny_moe_config(norm_topk_prob=False))["moe_router_pre_softmax"] is True
    assert moe_config_kwargs(tiny_moe_config(), aux_loss_coeff=0.01)["moe_router_load_balancing_type"] == "aux_loss"


def _batch(rows: int = 4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (rows, 12), generator=g)
    am = torch.ones(rows, 12, dtype=torch.long)
    am[1, :4] = 0  # left padding
    am[2, -3:] = 0  # a shorter response
    return ids, am, torch.randn(rows, 11, generator=g), torch.randn(rows, 11, generator=g)


def _both_real(am):
    return (am[:, :-1] * am[:, 1:]).bool()


def _worker(rank, world, tp, ep, dispatcher, norm_topk_prob, out, spec="local"):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import megatron_to_hf, to_sequential_names
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.moe import to_checkpoint_names
    from hapo_openrlhf.megatron.schedule import allreduce_tp_replicated_grads, logprobs_and_entropy

    from ._dist import load_hf_into
    from .test_convert import hf_logprobs_entropy

    init_megatron(tp=tp, ep=ep)
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    hf = tiny_moe(norm_topk_prob=norm_topk_prob)
    model = build_gpt_model(hf.config, tp=tp, ep=ep, moe={"dispatcher": dispatcher}, perform_initialization=False,
                            spec=spec, sequence_parallel=tp > 1)
    load_hf_into(model, hf, tp=tp, tp_rank=tp_rank, ep=ep, ep_rank=ep_rank, spec=spec)
    ids, am, w_lp, w_en = _batch()
    rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)  # each data-parallel rank its rows
    # the all-gather dispatcher gathers equal token counts from every EP rank: fixed-shape padded rows
    layout = "padded" if dispatcher == "allgather" else "thd"
    lp, en = logprobs_and_entropy(model, ids[rows], am[rows], vocab_size=259, temperature=T, chunk_size=5,
                                  layout=layout)
    m = _both_real(am[rows]).float()
    ((lp * w_lp[rows] * m).sum() + (en * w_en[rows] * m).sum()).backward()
    allreduce_tp_replicated_grads(model)
    # TEGroupedMLP's per-GEMM names (the TE spec) as SequentialMLP's, which the merge below reads
    grads = to_sequential_names({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    everyone = [None] * world
    dist.all_gather_object(everyone, (dp_rank, ep_rank, tp_rank, lp.detach(), en.detach(), grads))
    if rank != 0:
        return
    ref_lp, ref_en = hf_logprobs_entropy(hf, ids, am, T)  # fp64, the whole batch
    m = _both_real(am).double()
    ((ref_lp * w_lp.double() * m).sum() + (ref_en * w_en.double() * m).sum()).backward()
    ref_grads = to_checkpoint_names({n: p.grad for n, p in hf.named_parameters()}, hf.config)
    valid = _both_real(am)
    firsts = sorted((d, l, n) for d, e, r, l, n, _ in everyone if r == 0)  # one per data-parallel rank
    got_lp, got_en = torch.cat([l for _, l, _ in firsts]), torch.cat([n for _, _, n in firsts])
    torch.testing.assert_close(got_lp.double()[valid], ref_lp.detach()[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_en.double()[valid], ref_en.detach()[valid], rtol=1e-4, atol=1e-4)
    # a non-expert gradient: each rank holds its rows' share, summed over every rank of its TP slice; an
    # expert's: summed over the ranks that hold that expert slice (one here: the tokens of every
    # data-parallel rank reach it through the dispatcher)
    shards = {}
    for e in range(ep):
        for r in range(tp):
            mine = [g for _, e2, r2, _, _, g in everyone if r2 == r and e2 == e]
            dense = [g for _, _, r2, _, _, g in everyone if r2 == r]
            shards[(0, e, r) if ep > 1 else (0, r)] = {
                k: sum(g[k] for g in (mine if ".local_experts." in k else dense)) for k in mine[0]}
    merged = megatron_to_hf(shards, hf.config, tp=tp, pp=1, ep=ep)
    assert set(merged) == set(ref_grads)
    for n, g in merged.items():
        # fp32 against fp64, relative to the tensor's largest gradient (every gradient at 1e-4)
        err, scale = float((g.double() - ref_grads[n]).abs().max()), float(ref_grads[n].abs().max())
        assert scale > 0 and err <= 1e-4 * scale, (n, err, scale)
    torch.save({"ok": True, "n": len(merged)}, out)


def _te_worker(rank, world, tp, ep, dispatcher, norm_topk_prob, out):
    """:func:`_worker` on Transformer Engine's spec (the stand-in; ranks from the TE fork server) with
    sequence parallelism at TP > 1."""
    _worker(rank, world, tp, ep, dispatcher, norm_topk_prob, out, spec="te")


def _grouped_gemm_worker(rank, world, ep, out):
    """TEGroupedMLP (one TE GroupedLinear per projection) against SequentialMLP of TE linears on
    the same weights and rows: log-probs, entropy and every gradient (the same tensors under
    each one's names), on this rank."""
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import to_sequential_names
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy

    from ._dist import load_hf_into

    init_megatron(ep=ep)
    ep_rank, dp, dp_rank = ps.get_expert_model_parallel_rank(), ps.get_data_parallel_world_size(), \
        ps.get_data_parallel_rank()
    hf = tiny_moe()
    ids, am, w_lp, w_en = _batch()
    rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)
    got = {}
    for grouped in (True, False):
        model = build_gpt_model(hf.config, ep=ep, moe={"dispatcher": "alltoall"}, perform_initialization=False,
                                spec="te", grouped_gemm=grouped)
        experts = type(model.decoder.layers[0].mlp.experts).__name__
        load_hf_into(model, hf, ep=ep, ep_rank=ep_rank, spec="te", grouped_gemm=grouped)
        lp, en = logprobs_and_entropy(model, ids[rows], am[rows], vocab_size=259, temperature=T, chunk_size=5,
                                      layout="thd")
        m = _both_real(am[rows]).float()
        ((lp * w_lp[rows] * m).sum() + (en * w_en[rows] * m).sum()).backward()
        grads = to_sequential_names({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        got[grouped] = (experts, lp.detach(), en.detach(), grads)
    (k1, lp1, en1, g1), (k0, lp0, en0, g0) = got[True], got[False]
    assert (k1, k0) == ("TEGroupedMLP", "SequentialMLP"), (k1, k0)
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(en1, en0, rtol=1e-6, atol=1e-6)
    assert set(g1) == set(g0) and any(".local_experts." in n for n in g1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-6, msg=lambda msg, n=n: f"{n}: {msg}")
    if rank == 0:
        torch.save({"ok": True, "n": len(g0)}, out)


@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2)], ids=["ep1", "ep2"])
def test_grouped_gemm_experts_equal_sequential_ones_on_the_te_spec(tmp_path, world, ep):
    """The TE spec's experts are megatron-core's TEGroupedMLP (TE 2.20.2's GroupedLinear, the
    stand-in), the local spec's SequentialMLP: equal log-probs, entropy and gradients at EP=1 and
    EP=2 on the stand-in, from the same Hugging Face weights."""
    from ._dist import spawn_te

    out = tmp_path / "ok.pt"
    spawn_te("tests.megatron.test_moe:_grouped_gemm_worker", world, world, ep, str(out))
    assert torch.load(out)["ok"]


@pytest.mark.parametrize("world, tp, ep, dispatcher", [(4, 2, 2, "alltoall"), (2, 2, 1, "allgather")],
                         ids=["tp2_ep2_alltoall", "tp2_ep1_allgather"])
def test_te_spec_moe_with_sequence_parallelism_equals_hf(tmp_path, world, tp, ep, dispatcher):
    """Transformer Engine's spec for the MoE layers (TE's fused input norm + QKV, a ``TENorm`` before
    the router, TE linears for every expert; the TE 2.20.2 stand-in) at TP=2 with sequence parallelism:
    TP=2 x EP=2 on four ranks (expert tensor parallelism = TP) and TP=2 x EP=1 with the all-gather
    dispatcher -- log-probs, entropy and every gradient == Hugging Face through the fused head."""
    from ._dist import spawn_te

    out = tmp_path / "ok.pt"
    spawn_te("tests.megatron.test_moe:_te_worker", world, world, tp, ep, dispatcher, True, str(out))
    res = torch.load(out)
    assert res["ok"] and res["n"] == 3 + 2 * (4 + 2 + 2 + 1 + 4 * 3)


@pytest.mark.parametrize("world, tp, ep, dispatcher, norm_topk_prob", [
    (1, 1, 1, "alltoall", True), (2, 1, 2, "alltoall", True), (2, 1, 2, "allgather", False),
    (4, 1, 2, "alltoall", True)],
    ids=["ep1", "ep2_alltoall", "ep2_allgather_pre_softmax", "ep2_dp4"])
def test_moe_logprobs_entropy_and_grads_equal_hf(tmp_path, world, tp, ep, dispatcher, norm_topk_prob):
    out = tmp_path / "ok.pt"
    spawn(_worker, world, world, tp, ep, dispatcher, norm_topk_prob, str(out))
    res = torch.load(out)
    # embed, final norm, lm_head; per layer: q/k/v/o, q/k norm, 2 norms, the router, 4 experts x 3
    assert res["ok"] and res["n"] == 3 + 2 * (4 + 2 + 2 + 1 + 4 * 3)


def _stream_worker(rank, world, pp, ep, out):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import gather_hf_state_dict, hf_shapes, stream_hf_tensors
    from hapo_openrlhf.megatron.hf_save import save_hf_state_dict
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.moe import to_checkpoint_names

    from ._dist import load_hf_into

    init_megatron(pp=pp, ep=ep)
    stage = ps.get_pipeline_model_parallel_rank()
    hf = tiny_moe(layers=4)
    model = build_gpt_model(hf.config, pp=pp, pp_rank=stage, ep=ep, perform_initialization=False)
    load_hf_into(model, hf, pp=pp, pp_rank=stage, ep=ep, ep_rank=ps.get_expert_model_parallel_rank())
    got = []
    n = stream_hf_tensors(model, hf.config, lambda name, t: got.append((name, t.clone())))
    sd = gather_hf_state_dict(model, hf.config)
    if rank != 0:
        assert n == 0 and got == [] and sd is None
        return
    shapes, ref = hf_shapes(hf.config), to_checkpoint_names(hf.state_dict(), hf.config)
    assert [name for name, _ in got] == list(shapes) and n == len(shapes)
    for name, t in got:
        assert tuple(t.shape) == shapes[name] and torch.equal(t, ref[name]), name
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    save_hf_state_dict(sd, hf.config, torch.float32, out + ".model")  # the final save, then transformers reads it
    from transformers import Qwen3MoeForCausalLM

    back = Qwen3MoeForCausalLM.from_pretrained(out + ".model", dtype=torch.float32).state_dict()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    torch.save({"ok": True, "n": n}, out)


@pytest.mark.parametrize("world, pp, ep", [(2, 1, 2), (4, 2, 2)], ids=["ep2", "pp2_ep2"])
def test_streamed_moe_weights_and_the_final_save_equal_the_loaded_model(tmp_path, world, pp, ep):
    """The vLLM weight sync's and the final save's path (``convert.stream_hf_tensors``): global
    rank 0 receives every tensor once, in ``hf_shapes`` order -- each layer's experts from the
    expert-parallel rank (and pipeline stage) that holds them -- bitwise equal to the checkpoint
    the model was loaded from; the saved directory loads back through transformers exactly."""
    out = tmp_path / "ok.pt"
    spawn(_stream_worker, world, world, pp, ep, str(out))
    res = torch.load(out)
    # embed, final norm, lm_head; per layer 9 dense (q, k, v, o, q/k norm, 2 norms, router) + 4 experts x 3
    assert res["ok"] and res["n"] == 3 + 4 * (9 + 4 * 3)


def _recorded_routes(recorder, ids, am):
    """[B, S, layers, k] top-k experts the recording model chose for each token (-1 on padding and on
    each row's last token, which an engine never takes as input)."""
    with torch.no_grad():
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        out = recorder(input_ids=ids, attention_mask=am, position_ids=pos, output_router_logits=True)
    k = recorder.config.num_experts_per_tok
    B, S = ids.shape
    routes = torch.stack([torch.topk(lg.float().view(B, S, -1), k, dim=-1).indices for lg in out.router_logits], 2)
    last = torch.arange(S)[None] == (am.cumsum(-1).argmax(-1))[:, None]
    return torch.where((am.bool() & ~last)[:, :, None, None], routes, -1)


def _forced(model, routes_for_call, counts=None):
    """Hugging Face routing with the expert choices given (each router's own softmax, gathered at
    the given experts, renormalised as ``norm_topk_prob`` says): the reference for a replay.
    ``counts``: a dict whose ``tokens`` / ``differed`` count, over every token of a call but its last
    (an engine never records that one), the routings whose given experts are not the router's own top-k."""
    import types

    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(self, hidden_states, i=i):
            h = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(h, self.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            idx = routes_for_call()[:, i].to(h.device)
            if counts is not None:
                own = torch.topk(logits.float(), idx.shape[1], -1).indices.sort(-1).values
                differs = (own != idx.sort(-1).values).any(-1)[:-1]
                counts["tokens"] = counts.get("tokens", 0) + len(differs)
                counts["differed"] = counts.get("differed", 0) + int(differs.sum())
            top = probs.gather(1, idx)
            if self.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        gate.forward = types.MethodType(forward, gate)


def _replay_worker(rank, world, ep, out):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward
    from hapo_openrlhf.megatron.taps import ReplayRoutes, RouterStats

    from ._dist import load_hf_into
    from .test_convert import hf_logprobs_entropy

    init_megatron(ep=ep)
    trainer = tiny_moe()
    recorder = tiny_moe()  # the "rollout engine": the same weights, its routers perturbed
    with torch.no_grad():
        for layer in recorder.model.layers:
            layer.mlp.gate.weight.add_(0.8 * torch.randn(layer.mlp.gate.weight.shape,
                                                         generator=torch.Generator().manual_seed(5)))
    ids, am, _, _ = _batch()
    routes = _recorded_routes(recorder, ids, am)
    model = build_gpt_model(trainer.config, ep=ep, routing_replay=True, perform_initialization=False)
    load_hf_into(model, trainer, ep=ep, ep_rank=ps.get_expert_model_parallel_rank())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp))
    # the routing the routers end up using, per layer: replay must make it the recorded one
    used = {}

    def capture(i):
        def hook(router, args, output):
            used.setdefault(i, []).append(output[1].detach().clone())  # routing_map [tokens, experts]
        return hook

    from hapo_openrlhf.megatron.moe import stage_routers

    hooks = [r.register_forward_hook(capture(i)) for i, r in stage_routers(model)]
    mbs = [{"input_ids": ids[[r]], "attention_mask": am[[r]], "routed_experts": routes[[r]]} for r in rows]
    stats = {}
    with torch.no_grad():
        replayed = forward_backward(model, mbs, None, vocab_size=259, temperature=T, forward_only=True,
                                    taps=[ReplayRoutes(stats), RouterStats(stats)])
        used_replay = {i: list(v) for i, v in used.items()}
        used.clear()
        plain = forward_backward(model, [{k: v for k, v in mb.items() if k != "routed_experts"} for mb in mbs],
                                 None, vocab_size=259, temperature=T, forward_only=True)
    for h in hooks:
        h.remove()
    # the replayed routing is the recorded one, token by token, on every recorded token of every layer
    exact = True
    for j, r in enumerate(rows):
        n = int(am[r].sum())
        start = int((am[r] == 0).sum()) if am[r, 0] == 0 else 0
        for i, maps in used_replay.items():
            m = maps[j][: n - 1]  # packed THD: the row's tokens in order; its last one was not recorded
            want = torch.zeros(n - 1, m.shape[1], dtype=torch.bool).scatter_(1, routes[r, start:start + n - 1, i], True)
            exact &= bool(torch.equal(m, want))
    everyone = [None] * world
    dist.all_gather_object(everyone, (dp_rank, [x[0] for x in replayed], [x[0] for x in plain], exact, stats))
    if rank != 0:
        return
    everyone = sorted({e[0]: e for e in everyone}.values(), key=lambda e: e[0])
    lp_replay = torch.cat([torch.cat(e[1]) for e in everyone]).double()
    lp_plain = torch.cat([torch.cat(e[2]) for e in everyone]).double()
    current = {"routes": None}
    ref_plain, _ = hf_logprobs_entropy(trainer, ids, am, T)
    B, S = ids.shape
    flat = torch.where(routes < 0, torch.arange(routes.shape[-1]), routes).reshape(B * S, *routes.shape[2:])
    current["routes"] = flat
    _forced(trainer, lambda: current["routes"])
    ref_forced, _ = hf_logprobs_entropy(trainer, ids, am, T)
    valid = _both_real(am)
    tokens, differed = sum(e[4]["tokens"] for e in everyone), sum(e[4]["differed"] for e in everyone)
    torch.save({"exact": all(e[3] for e in everyone),
                "replay_vs_forced": float((lp_replay - ref_forced)[valid].abs().max()),
                "plain_vs_hf": float((lp_plain - ref_plain.detach())[valid].abs().max()),
                "plain_vs_forced": float((lp_plain - ref_forced.detach())[valid].abs().max()),
                "tokens": tokens, "differed": differed,
                "recorded": int((routes[..., 0] >= 0).sum())}, out)  # (token, layer) pairs


@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2)], ids=["ep1", "ep2"])
def test_routing_replay_makes_the_trainer_route_as_the_rollout_did(tmp_path, world, ep):
    """Rollout routing replay (R3), trainer side: routes recorded by a model whose routers were
    perturbed (a rollout engine that routes differently) are replayed through megatron-core's
    RouterReplay: the trainer's routing equals the recorded routes exactly, and its log-probs equal a
    Hugging Face forward of the trainer's weights with those expert choices (routing weights from
    its own router). Without replay they differ, and the replay counts the routings that would have."""
    out = tmp_path / "res.pt"
    spawn(_replay_worker, world, world, ep, str(out))
    res = torch.load(out)
    assert res["exact"], res
    assert res["replay_vs_forced"] < 1e-4, res
    assert res["plain_vs_hf"] < 1e-4, res  # no replay: the trainer's own routing, Hugging Face's
    assert res["plain_vs_forced"] > 1e-2, res  # ... which is not the rollout's
    # every recorded (token, layer) routing counted; the perturbed routers chose otherwise for some
    assert res["tokens"] == res["recorded"] and 0 < res["differed"] < res["tokens"], res


def _bf16_engine_worker(rank, world, out):
    """A rollout engine that computes in bf16 (as vLLM's engines do) with the trainer's weights:
    its routers pick other experts for near-tie tokens; replaying its routes removes that part of
    the engine/trainer mismatch. ``actor/vllm_kl`` as OpenRLHF computes it (the mean over response
    tokens of the engine's log-prob minus the trainer's), with replay off and on."""
    import copy

    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward
    from hapo_openrlhf.megatron.taps import ReplayRoutes, RouterStats

    from ._dist import load_hf_into

    init_megatron(ep=2)
    trainer = tiny_moe(layers=2)
    with torch.no_grad():  # a trained router's margins are small: near ties between the k-th and the next
        for layer in trainer.model.layers:
            layer.mlp.gate.weight.mul_(0.005)
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 259, (8, 24), generator=g)
    am = torch.ones_like(ids)
    routes = _recorded_routes(engine, ids, am)
    with torch.no_grad():
        z = engine(input_ids=ids, attention_mask=am).logits[:, :-1].float() / T
        lp_engine = torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).double()
    model = build_gpt_model(trainer.config, ep=2, routing_replay=True, perform_initialization=False)
    load_hf_into(model, trainer, ep=2, ep_rank=ps.get_expert_model_parallel_rank())
    dp_rank = ps.get_data_parallel_rank()
    rows = list(range(dp_rank * 4, dp_rank * 4 + 4))
    mbs = [{"input_ids": ids[rows], "attention_mask": am[rows]}]
    stats = {}
    with torch.no_grad():
        off = forward_backward(model, mbs, None, vocab_size=259, temperature=T, forward_only=True)[0][0]
        on = forward_backward(model, [{**mbs[0], "routed_experts": routes[rows]}], None, vocab_size=259,
                              temperature=T, forward_only=True, taps=[ReplayRoutes(stats), RouterStats(stats)])[0][0]
        try:  # routes handed in without the tap that replays them: refused by name, not silently ignored
            forward_backward(model, [{**mbs[0], "routed_experts": routes[rows]}], None, vocab_size=259,
                             forward_only=True, taps=[RouterStats({})])
            refused = ""
        except ValueError as e:
            refused = str(e)
    everyone = [None] * world
    dist.all_gather_object(everyone, (dp_rank, off.double(), on.double(), stats["tokens"], stats["differed"]))
    if rank != 0:
        return
    everyone.sort(key=lambda e: e[0])
    lp_off, lp_on = torch.cat([e[1] for e in everyone]), torch.cat([e[2] for e in everyone])
    m = torch.ones_like(lp_engine, dtype=torch.bool)  # every row is all real tokens: every next-token log-prob
    torch.save({"vllm_kl_off": float((lp_engine - lp_off)[m].mean()), "vllm_kl_on": float((lp_engine - lp_on)[m].mean()),
                "abs_off": float((lp_engine - lp_off)[m].abs().mean()), "abs_on": float((lp_engine - lp_on)[m].abs().mean()),
                "max_off": float((lp_engine - lp_off)[m].abs().max()), "max_on": float((lp_engine - lp_on)[m].abs().max()),
                "differed": float(sum(e[4] for e in everyone)), "tokens": float(sum(e[3] for e in everyone)),
                "refused": refused}, out)


def test_routing_replay_shrinks_the_bf16_engines_mismatch(tmp_path):
    """``actor/vllm_kl`` with R3 off vs on against a bf16 engine (a CPU-visible proxy for vLLM:
    same weights, bf16 arithmetic, its own routing) at EP=2: replaying the engine's routes makes the
    trainer route as the engine did wherever bf16 flipped a near tie, and the log-prob mismatch
    shrinks -- on average and at its worst token (docs/megatron.md has the figures)."""
    out = tmp_path / "res.pt"
    spawn(_bf16_engine_worker, 2, 2, str(out))
    r = torch.load(out)
    print(f"R3 vs a bf16 engine: {r}")
    assert 0 < r["differed"] < r["tokens"], r  # bf16 flipped some routings, not most
    assert r["abs_on"] < r["abs_off"] and r["max_on"] < r["max_off"], r
    assert abs(r["vllm_kl_on"]) < abs(r["vllm_kl_off"]), r
    assert "carry routed_experts but no taps.ReplayRoutes" in r["refused"], r["refused"]


@pytest.mark.parametrize("layout, pad_to", [("thd", 1), ("thd", 4), ("padded", 1), ("padded", 4), ("masked", 1)])
def test_routes_reach_the_routers_in_the_model_inputs_token_order(layout, pad_to):
    """``RowLayout.route_input`` lays the rollout's [B, S, layers, k] routes out in the order the
    routers see the micro-batch's tokens: a route that names its own token id lines up with the
    model input's ids (THD packed, padded and masked sequence-major), and the tokens the model adds
    (sequence-parallel padding, padded rows' tails) and each row's unrecorded last token are filled
    and marked not recorded; a TP rank's share with sequence parallelism is its chunk."""
    from hapo_openrlhf.megatron.schedule import RowLayout

    ids, am, _, _ = _batch()
    B, S = ids.shape
    routes = ids[:, :, None, None].expand(B, S, 2, 3).clone()  # layer l, slot j: the token's own id
    last = torch.arange(S)[None] == (am.cumsum(-1).argmax(-1))[:, None]
    routes[~am.bool() | last] = -1
    lay = RowLayout.of(am, layout, pad_to)
    inputs = lay.model_inputs(ids)
    model_ids = inputs["input_ids"].transpose(0, 1).reshape(-1) if layout != "thd" else inputs["input_ids"][0]
    got, recorded = lay.route_input(routes)
    assert got.shape == (model_ids.numel(), 2, 3) and recorded.shape == (model_ids.numel(),)
    assert torch.equal(got[recorded, 0, 0], model_ids[recorded])
    assert int(recorded.sum()) == int((routes[..., 0, 0] >= 0).sum())  # every recorded token, once
    assert torch.equal(got[~recorded], torch.arange(3).expand(int((~recorded).sum()), 2, 3))
    if pad_to > 1:
        halves = [lay.route_input(routes, tp_rank=r, tp=2) for r in range(2)]
        assert torch.equal(torch.cat([h[0] for h in halves]), got) and torch.equal(
            torch.cat([h[1] for h in halves]), recorded)


@pytest.mark.parametrize("layout, pad_to", [("thd", 4), ("padded", 4), ("masked", 1)])
def test_route_layout_reads_no_device_tensor_and_moves_one_ranks_share(layout, pad_to):
    """The GPU proxy for R3's per-micro-batch cost: the layout's index tensors on the meta device
    (a device nothing can be read back from), the routes and the row sizes on the host, as the
    actor keeps them. The checks and gathers run on the host -- a read of a device tensor (a sync
    on a GPU) would raise here -- and what reaches the device is this TP rank's share only, equal
    to the host computation's; uint8 routes (255: not recorded) lay out as int16 ones do."""
    from hapo_openrlhf.megatron.schedule import RowLayout

    ids, am, _, _ = _batch()
    B, S = ids.shape
    routes = (ids[:, :, None, None] % 7).expand(B, S, 2, 3).clone() + torch.arange(3)
    last = torch.arange(S)[None] == (am.cumsum(-1).argmax(-1))[:, None]
    routes[~am.bool() | last] = -1
    host = RowLayout.of(am, layout, pad_to)
    meta = RowLayout.of(am, layout, pad_to, device="meta")
    assert meta.lengths.is_meta and not meta.lengths_host.is_meta
    want, want_rec = host.route_input(routes.to(torch.int16), tp_rank=1, tp=2)
    got, rec = meta.route_input(routes.to(torch.int16), tp_rank=1, tp=2)
    assert got.is_meta and rec.is_meta and got.shape == want.shape and rec.shape == want_rec.shape
    assert got.shape[0] == host.route_input(routes)[0].shape[0] // 2  # one rank's share is moved
    small = torch.where(routes < 0, 255, routes).to(torch.uint8)
    got8, rec8 = host.route_input(small, tp_rank=1, tp=2)
    assert got8.dtype == torch.uint8 and torch.equal(got8.long(), want.long()) and torch.equal(rec8, want_rec)


def test_routes_with_gaps_or_the_wrong_shape_are_refused_by_name():
    from hapo_openrlhf.megatron.schedule import RowLayout

    ids, am, _, _ = _batch()
    routes = torch.zeros(*ids.shape, 2, 2, dtype=torch.long)
    lay = RowLayout.of(am, "thd")
    gap = routes.clone()
    gap[3, 5] = -1  # a real token in the middle of row 3
    with pytest.raises(ValueError, match=r"rows \[3\] have real tokens without recorded routes"):
        lay.route_input(gap)
    with pytest.raises(ValueError, match="routed experts must be \\[B, S, layers, top_k\\]"):
        lay.route_input(routes[:, :-1])


def _monitor_worker(rank, layout, out):
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.moe import router_metrics
    from hapo_openrlhf.megatron.schedule import forward_backward
    from hapo_openrlhf.megatron.taps import RouterStats

    from ._dist import load_hf_into

    init_megatron()
    hf = tiny_moe()
    model = build_gpt_model(hf.config, perform_initialization=False)
    load_hf_into(model, hf)
    ids, am, _, _ = _batch()
    stats = {}
    with torch.no_grad():
        forward_backward(model, [{"input_ids": ids[:2], "attention_mask": am[:2]},
                                 {"input_ids": ids[2:], "attention_mask": am[2:]}], None, vocab_size=259,
                         forward_only=True, layout=layout, taps=[RouterStats(stats)])
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        logits = hf(input_ids=ids, attention_mask=am, position_ids=pos, output_router_logits=True).router_logits
    real = am.bool().reshape(-1)
    k = hf.config.num_experts_per_tok
    ent, load = [], []
    for lg in logits:
        lp = torch.log_softmax(lg.float()[real], -1)
        ent.append(-(lp.exp() * lp).sum(-1))
        load.append(torch.zeros(lg.shape[-1]).index_add_(0, torch.topk(lg[real], k, -1).indices.reshape(-1),
                                                          torch.ones(int(real.sum()) * k)))
    want = {"moe/router_entropy": float(torch.cat(ent).mean()),
            "moe/expert_load_max_over_mean": max(float(v.max() / v.mean()) for v in load),
            "moe/dropped_routings": 0.0}
    torch.save({"got": router_metrics(stats), "want": want, "load": [stats["expert_load"][i] for i in range(2)],
                "want_load": load}, out)


@pytest.mark.parametrize("layout", ["thd", "padded"])
def test_router_metrics_are_those_of_the_hugging_face_router(tmp_path, layout):
    """Router entropy (mean over real tokens and layers), each expert's tokens per layer, the worst
    layer's busiest-over-mean load and the dropped routings (0: dropless) from the Megatron model's
    routers over two micro-batches equal what Hugging Face's router logits give for the same
    tokens; padding the layout adds is left out."""
    out = tmp_path / "res.pt"
    spawn(_monitor_worker, 1, layout, str(out))
    res = torch.load(out)
    assert set(res["got"]) == set(res["want"])
    assert res["got"]["moe/router_entropy"] == pytest.approx(res["want"]["moe/router_entropy"], rel=1e-5)
    assert res["got"]["moe/dropped_routings"] == 0.0
    for got, want in zip(res["load"], res["want_load"]):
        assert torch.equal(got.float(), want)
    assert res["got"]["moe/expert_load_max_over_mean"] == pytest.approx(res["want"]["moe/expert_load_max_over_mean"])
    assert res["got"]["moe/expert_load_max_over_mean"] > 1.0  # the tiny router is not balanced


def test_real_tokens_mark_the_rows_tokens_in_the_model_order():
    from hapo_openrlhf.megatron.schedule import RowLayout

    ids, am, _, _ = _batch()
    for layout, pad_to in (("thd", 1), ("thd", 4), ("padded", 4), ("masked", 1)):
        lay = RowLayout.of(am, layout, pad_to)
        inputs = lay.model_inputs(ids)
        model_ids = inputs["input_ids"].transpose(0, 1).reshape(-1) if layout != "thd" else inputs["input_ids"][0]
        real = lay.real_tokens()
        assert real.shape == model_ids.shape and int(real.sum()) == int(am.sum()), layout
        assert sorted(model_ids[real].tolist()) == sorted(ids[am.bool()].tolist()), layout
        if pad_to > 1:
            assert torch.equal(torch.cat([lay.real_tokens(r, 2) for r in range(2)]), real)


def _gpu_smoke_worker(rank, out):
    from hapo_openrlhf.gpu_smoke import moe_check

    init_megatron()
    torch.save(moe_check("cpu"), out)


def test_the_gpu_smokes_moe_check_runs_on_cpu(tmp_path):
    """``hapo doctor --gpu-smoke``'s ``megatron_moe_vs_hf`` (real CUDA kernels there) runs its check
    here on gloo: log-probs, entropy and the router entropy == Hugging Face's; the streamed weights exact."""
    out = tmp_path / "res.pt"
    spawn(_gpu_smoke_worker, 1, str(out))
    res = torch.load(out)
    assert res["ok"] and res["loaded_strict"] and res["stream_exact"], res
    assert res["logprob_max_abs_err"] < 1e-4 and res["router_entropy_abs_err"] < 1e-5, res
