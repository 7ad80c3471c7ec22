"""The Megatron policy actor behind OpenRLHF's policy-actor interface, on 2 gloo ranks
(no Ray; the e2e test runs it under OpenRLHF's controller).

Each layout -- TP=2 with full activation recomputation, PP=2 with tied embeddings and EntroReg,
DP=2 -- is checked against an independent single-process Hugging Face reference:

* ``forward`` (the old-log-prob pass) returns the Hugging Face log-probs of the
  response tokens at the rollout temperature, and keeps the behaviour entropy;
* ``append`` + ``fit`` (two optimizer steps of two micro-batches, global token-mean
  normaliser, clipping, AdamW, weight decay) leave exactly the weights of the
  reference that trains the same rows with ``HapoPolicyLoss`` + ``torch.optim.AdamW``;
* ``save_model`` writes them in Hugging Face layout; ``fit``'s status reports the same
  gradient norm and loss.

And a bf16 model (fp32 masters) at TP=2 resumes exactly: ``save_checkpoint`` between two
``fit`` calls, then fresh processes whose ``init_model_from_pretrained`` loads it -- the
path OpenRLHF's controller takes on a requeue -- return OpenRLHF's client states and
train the second batch to the same weights, masters and status, bitwise.

The args are OpenRLHF's own: ``flags.build_argv`` through OpenRLHF's real parser.
"""

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise RuntimeError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed")
    pytest.skip("megatron-core not installed (the megatron extra)", allow_module_level=True)

HERE = Path(__file__).resolve().parent
CFG = HERE / "e2e_tiny.yaml"
P, A, B = 6, 8, 4  # prompt width (left-padded), response width (right-padded), rows per micro-rollout batch


def _free_port() -> int:
    """A loopback port outside the ephemeral range, free now (cluster/ports.py: what rank 0 announces)."""
    from hapo_openrlhf.cluster.ports import rendezvous_port

    return rendezvous_port("127.0.0.1")


def _tiny_model_dir(path: Path, tied: bool, family: str = "qwen2") -> Path:
    from hapo_openrlhf.local.model import build_tokenizer
    from tests.megatron.test_convert import tiny_model
    from tests.megatron.test_moe import tiny_moe

    model = tiny_moe(tied=tied) if family == "qwen3_moe" else tiny_model(family, tied)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _experiences(n_batches: int, seed: int):
    """OpenRLHF experiences of B rows: a left-padded prompt, a right-padded response."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        seq = torch.zeros(B, P + A, dtype=torch.long)
        am = torch.zeros(B, P + A, dtype=torch.long)
        act = torch.zeros(B, A, dtype=torch.bool)
        plen = torch.randint(2, P + 1, (B,), generator=g)
        rlen = torch.randint(1, A + 1, (B,), generator=g)
        rlen[0] = A  # the widest response fixes the batch's width
        for i in range(B):
            seq[i, P - plen[i]: P + rlen[i]] = torch.randint(3, 259, (int(plen[i] + rlen[i]),), generator=g)
            am[i, P - plen[i]: P + rlen[i]] = 1
            act[i, : rlen[i]] = True
        out.append(Experience(
            sequences=seq, attention_mask=am, action_mask=act,
            advantages=torch.randn(B, A, generator=g) * act, rewards=torch.rand(B, generator=g),
            response_length=rlen.float(), total_length=(plen + rlen).float(),
            info={"reward": torch.rand(B, generator=g)}, index=list(range(B))))
    return out


def _rows(exp):
    """(unpadded token ids, response length) per row."""
    return [(s[m.bool()], int(a.sum())) for s, m, a in zip(exp.sequences, exp.attention_mask, exp.action_mask)]


def _hf_row(model, ids, r, temperature, top_p=1.0):
    """Log-probs, entropy and log P(top-p nucleus) of a row's last ``r`` tokens (float64 reference)."""
    from hapo_openrlhf.algos.nucleus import nucleus_logmass

    z = model(input_ids=ids[None]).logits[0, :-1].double() / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, ids[1:, None]).squeeze(-1)
    return lp[-r:], -(logp.exp() * logp).sum(-1)[-r:], nucleus_logmass(z, top_p)[-r:].double()


def _args(tmp_path, sets):
    from hapo_openrlhf.config import load_config
    from hapo_openrlhf.integrations.openrlhf.launch.flags import build_argv
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    cfg = load_config(CFG, ["backend=megatron", "model.path=/unused", "openrlhf.actor_gpus_per_node=2",
                            "rollout.temperature=0.7", "openrlhf.train_batch_size=8", "openrlhf.micro_train_batch_size=4",
                            "optim.weight_decay=0.01", "optim.grad_clip=0.5", "megatron.params_dtype=fp32", *sets])
    args = parse_with_upstream(build_argv(cfg, tmp_path))
    args.hapo = cfg.to_dict()
    # a large epsilon keeps AdamW's update linear in tiny gradients, so fp32 summation order
    # (sharded vs whole matrices) cannot flip the sign of a near-zero element's step
    args.actor.adam.eps = 1e-3
    return cfg, args


def _worker(rank, world, port, args, model_dir, per_rank, out_dir, routes=None):
    from tests.megatron.cuda_shim import install

    install()
    import torch.distributed as dist

    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import fingerprint
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    actor = MegatronPolicyActorImpl(world, rank, "127.0.0.1", port)
    actor.init_model_from_pretrained(SimpleNamespace(args=args, is_rank_0=lambda: rank == 0), str(model_dir),
                                     max_steps=4, vllm_engines=None)
    mine = per_rank[rank]
    if routes is not None:  # R3: what the controller sends before the step's first forward
        actor.set_routes(routes)
    if actor.loss_fn.signals_top_p is not None:  # PAEC: what the experience maker sends before the anchor
        actor.set_loss_state({"h_low": None})
    lps = [actor.forward(e.sequences, e.action_mask, e.attention_mask) for e in mine]
    ents, lms = zip(*[actor.pop_behaviour(fingerprint(e.sequences, e.attention_mask)) for e in mine])
    for e, lp in zip(mine, lps):
        e.action_log_probs = lp - 0.1 * e.advantages  # off-policy enough that some ratios clip
        if args.algo.kl.use_loss:
            e.base_action_log_probs = _base_log_probs(lp, e)
        actor.append(e)
    status = actor.fit(args.algo.kl.init_coef)  # OpenRLHF's controller passes kl_ctl (fixed: init_coef)
    actor.save_model()
    torch.save({"lps": lps, "ents": ents, "lms": lms, "status": status}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _base_log_probs(lp, e):
    """A KL reference's log-probs for the test: near the policy's, different per token."""
    return (lp - 0.3 * e.advantages.roll(1, -1).abs()) * e.action_mask


def _reference(cfg, args, model_dir, per_rank, dp, gas, replay=None):
    """HF model + HapoPolicyLoss + AdamW on the same rows, window by window (``replay``: (routes by
    row tokens, counts): every forward routes as the rollout recorded, :func:`_replaying`)."""
    from openrlhf.utils.deepspeed.deepspeed_utils import get_optimizer_grouped_parameters
    from transformers import AutoModelForCausalLM

    from openrlhf.models import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    from hapo_openrlhf.algos.nucleus import sharded_nucleus_stats
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import loss_from_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if replay is not None:
        model = _replaying(model, *replay)
    adam = args.actor.adam
    # OpenRLHF's DeepSpeed actor's parameter groups: no weight decay on biases and norm weights
    opt = torch.optim.AdamW(get_optimizer_grouped_parameters(model, adam.weight_decay), lr=adam.lr,
                            betas=tuple(adam.betas), eps=adam.eps)
    from hapo_openrlhf.config import transported

    loss_fn = loss_from_config(transported(args.hapo))
    T_temp = cfg.rollout.temperature
    n_mb = len(per_rank[0])
    norms, losses, kls = [], [], []
    # a mixture of experts: each training forward's router entropy and tokens per expert, per layer
    routers = {"entropy": 0.0, "n": 0, "load": {}}

    def router_hook(i):
        def hook(module, inputs, out):
            logp = torch.log_softmax(out[0].detach().double(), -1)
            routers["entropy"] += float(-(logp.exp() * logp).sum())
            routers["n"] += logp.shape[0]
            load = torch.zeros(logp.shape[1]).index_add_(0, out[2].flatten(), torch.ones(out[2].numel()))
            routers["load"][i] = routers["load"].get(i, 0) + load
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(router_hook(i)) for i, layer in enumerate(model.model.layers)
             if hasattr(layer.mlp, "gate")]
    for k in range(0, n_mb, gas):
        window = [per_rank[r][j] for j in range(k, k + gas) for r in range(dp)]
        rows = [(ids, r, e, i) for e in window for i, (ids, r) in enumerate(_rows(e))]
        T = sum(r for _, r, _, _ in rows)
        kl_mb = {}
        opt.zero_grad()
        total = 0.0
        for ids, r, e, i in rows:
            logits = model(input_ids=ids[None]).logits[0, :-1].float() / T_temp
            logp = torch.log_softmax(logits, -1)
            lp = logp.gather(-1, ids[1:, None]).squeeze(-1)[-r:]
            if loss_fn.needs_entropy:
                loss_fn.pending_entropy = (-(logp.exp() * logp).sum(-1))[None]
            if loss_fn.signals_top_p is not None:  # PAEC (before its anchor: the host loss)
                st = sharded_nucleus_stats(logits.detach(), loss_fn.signals_top_p, entropy=True, top2_gap=True)
                loss_fn.pending_signals = (st.entropy[None], st.top2_gap[None])
                loss_fn.loss_state = {"h_low": None}
            info = dict(dp_size=1, batch_num_tokens=torch.tensor(float(T)), global_batch_size=torch.tensor(float(len(rows))))
            loss, *_ = loss_fn(lp[None], e.action_log_probs[i, :r][None], e.advantages[i, :r][None],
                               action_mask=torch.ones(1, r, dtype=torch.bool), **info)
            total += float(loss.detach())  # the policy loss (upstream logs the KL term apart)
            if args.algo.kl.use_loss:  # the DeepSpeed actor's KL term (ActorPPOTrainer.training_step), upstream's code
                kl = compute_approx_kl(lp[None], e.base_action_log_probs[i, :r][None],
                                       log_probs_old=e.action_log_probs[i, :r][None],
                                       kl_estimator=args.algo.kl.estimator)
                kl_mb[id(e)] = kl_mb.get(id(e), 0.0) + float(kl.sum()) / T * dp  # the micro-batch's KL loss
                loss = loss + aggregate_loss(kl, torch.ones(1, r), **info) * args.algo.kl.init_coef
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)))
        losses.append(total)
        kls += [(kl_mb[id(e)], float(e.action_mask.sum())) for e in window if id(e) in kl_mb]
        opt.step()
    for h in hooks:
        h.remove()
    if hooks:
        kls = (kls, {"moe/router_entropy": routers["entropy"] / routers["n"],
                     "moe/expert_load_max_over_mean": max(float(v.max() / v.mean()) for v in routers["load"].values())})
    return model, norms, losses, kls


def _recorded_routes(model_dir, data):
    """Rollout routes of every row (R3): the top-k of an "engine" whose routers were perturbed, so
    that it routes differently from the trainer -- ``[n - 1, layers, k]`` per row, as vLLM returns
    them -- keyed by the row's tokens, and the table the controller would send."""
    from transformers import AutoModelForCausalLM

    from hapo_openrlhf.integrations.openrlhf.actors.routes import row_fingerprint

    engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in engine.model.layers:
            layer.mlp.gate.weight.add_(0.8 * torch.randn(layer.mlp.gate.weight.shape, generator=g))
    k = engine.config.num_experts_per_tok
    by_tokens = {}
    for e in data:
        for ids, _ in _rows(e):
            with torch.no_grad():
                logits = engine(ids[None, :-1], output_router_logits=True).router_logits
            by_tokens[tuple(ids.tolist())] = torch.stack([torch.topk(lg, k, -1).indices for lg in logits], 1).to(
                torch.int16).numpy()
    return by_tokens, {row_fingerprint(list(t)): [r] for t, r in by_tokens.items()}


def _replaying(model, by_tokens, counts):
    """A Hugging Face model that routes each row as recorded (test_moe._forced; the last token,
    unrecorded, takes experts 0..k-1), counting the routings its own routers would have chosen otherwise."""
    from tests.megatron.test_moe import _forced

    k = model.config.num_experts_per_tok
    current = {}
    forward = model.forward

    def replaying_forward(*a, input_ids=None, **kw):
        r = torch.as_tensor(by_tokens[tuple(input_ids[0].tolist())]).long()
        current["routes"] = torch.cat([r, torch.arange(k).expand(1, r.shape[1], k)])
        return forward(*a, input_ids=input_ids, **kw)

    model.forward = replaying_forward
    _forced(model, lambda: current["routes"], counts)
    return model


PACKED = ["openrlhf.packing_samples=true"]
BUDGET = [*PACKED, "openrlhf.dynamic_batch=true", "openrlhf.max_tokens_per_gpu=20"]


@pytest.mark.parametrize("name, sets, tied, family", [
    # packed THD micro-batches formed by a 20-token budget (rows are 8-14 tokens: 1-2 rows each)
    ("tp2_recompute_packed_budget", ["megatron.tensor_parallel=2", "megatron.recompute=true", *BUDGET], False, "qwen2"),
    ("pp2_tied_entro_reg_packed", ["megatron.pipeline_parallel=2", "algorithm.loss=entro_reg",
                                   "algorithm.loss_params={beta: 0.05}", *PACKED], True, "qwen2"),
    ("dp2_padded", ["rollout.top_p=1.0"], True, "qwen2"),  # right-aligned rows, causal attention without a mask
    # PAEC before its anchor (the host loss exactly) needs the head's nucleus entropy and top-two gap:
    # the logits head at TP=2 hands them to the loss, or the loss refuses to run
    ("tp2_local_attention_paec", ["megatron.tensor_parallel=2", "megatron.attention=local", "algorithm.loss=paec",
                                  "algorithm.loss_params={beta: 1.0, rho_min: 0.5, top_p: 0.9, mask: product, "
                                  "softness: 0.0}"], False, "qwen2"),
    # Qwen3 (QK-norm summed over TP by Megatron's finalize_model_grads, head_dim 24) and Llama 3
    # (llama3 RoPE scaling) through the whole actor: old log-probs, two optimizer steps, the saved model
    ("tp2_qwen3_packed", ["megatron.tensor_parallel=2", *PACKED], False, "qwen3"),
    ("pp2_llama_tied", ["megatron.pipeline_parallel=2"], True, "llama"),
    # the KL-to-reference loss (kl_coef > 0: OpenRLHF's k3 loss, and k2 set on its args) == the DeepSpeed actor's
    ("tp2_kl_k3", ["megatron.tensor_parallel=2", "algorithm.kl_coef=0.05"], False, "qwen2"),
    ("dp2_kl_k2", ["algorithm.kl_coef=0.05"], True, "qwen2"),
    # Transformer Engine's layer spec (the TE 2.20.2 stand-in, in fresh rank processes: megatron-core looks
    # for TE at import) with sequence parallelism: fused norms loaded by their TE names, tokens padded to a
    # multiple of TP, norm gradients summed over TP, TE's FusedAdam, the saved model by the HF names
    ("tp2_te_spec_sequence_parallel", ["megatron.tensor_parallel=2", "megatron.layer_spec=te",
                                       "megatron.sequence_parallel=true", *BUDGET], False, "qwen3"),
    # Qwen3-MoE (4 experts, top-2) at EP=2: each rank holds two experts, tokens cross the all-to-all
    # dispatcher; a 16-token budget gives the two ranks 2 and 4 micro-batches in a step: evened out to 4
    ("ep2_qwen3_moe_packed_budget", ["megatron.expert_parallel=2", *PACKED, "openrlhf.dynamic_batch=true",
                                     "openrlhf.max_tokens_per_gpu=16"], False, "qwen3_moe"),
    # ... with rollout routing replay (R3): routes recorded by an engine whose routers differ, sent as the
    # controller sends them (row fingerprint -> routes), replayed in the old-log-prob and training forwards;
    # the reference routes every row as recorded. Right-aligned padded rows here (packed THD: the e2e test)
    ("ep2_qwen3_moe_r3_padded", ["megatron.expert_parallel=2", "megatron.moe.routing_replay=r3"], False, "qwen3_moe"),
    # ... through pipeline stages (each replays its own layers' routes) on packed rows, and at TP=2 with
    # TE's spec + sequence parallelism (each TP rank replays its share of the tokens)
    ("pp2_qwen3_moe_r3_packed", ["megatron.pipeline_parallel=2", "megatron.moe.routing_replay=r3", *PACKED], False,
     "qwen3_moe"),
    ("tp2_te_sp_qwen3_moe_r3", ["megatron.tensor_parallel=2", "megatron.layer_spec=te", "megatron.sequence_parallel=true",
                                "megatron.moe.routing_replay=r3", *BUDGET], False, "qwen3_moe"),
    # ... and at TP=2 with Transformer Engine's spec (the stand-in) and sequence parallelism: each expert split
    # over the two TP ranks (expert tensor parallelism), each rank routing its half of the tokens
    ("tp2_te_sequence_parallel_qwen3_moe", ["megatron.tensor_parallel=2", "megatron.layer_spec=te",
                                            "megatron.sequence_parallel=true", *BUDGET], False, "qwen3_moe"),
])
def test_megatron_actor_matches_hf_reference(tmp_path, name, sets, tied, family):
    from transformers import AutoModelForCausalLM

    from tests.megatron._dist import start

    cfg, args = _args(tmp_path, sets)
    if name.endswith("_k2"):
        args.algo.kl.estimator = "k2"
    model_dir = _tiny_model_dir(tmp_path / "model", tied, family)
    mp_size = cfg.megatron.model_parallel_size
    dp = 2 // mp_size
    data = _experiences(4, seed=3)  # 16 rows: 2 optimizer steps of 8 rows
    # the controller's dispatch: a data-parallel replica's ranks all receive the same micro-batches
    k = 4 // dp
    per_rank = [data[(r // mp_size) * k: (r // mp_size + 1) * k] for r in range(2)]
    out = tmp_path / "out"
    out.mkdir()
    table, replay_counts = None, None
    if cfg.megatron.moe.routing_replay == "r3":
        by_tokens, table = _recorded_routes(model_dir, data)
        replay_counts = {"old": {}, "train": {}}
    if cfg.megatron.layer_spec == "te":
        from tests.megatron._dist import spawn_te

        spawn_te("tests.integrations.openrlhf.test_megatron_actor:_worker", 2, 2, _free_port(), args, model_dir,
                 per_rank, str(out), table, process_group=False)
    else:
        start(_worker, 2, (2, _free_port(), args, model_dir, per_rank, str(out), table))

    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if table is not None:
        ref_model = _replaying(ref_model, by_tokens, replay_counts["old"])
    got = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    # old log-probs (rank 0 of every replica answers the controller) and behaviour entropy
    with torch.no_grad():
        for r in range(0, 2, mp_size):
            for e, lp, ent, lm in zip(per_rank[r], got[r]["lps"], got[r]["ents"], got[r]["lms"]):
                assert lp.shape == ent.shape == e.action_mask.shape
                # log P(nucleus) (rollout/nucleus_logmass) under the config's top-p 0.95; none at top-p 1
                assert (lm is None) == (cfg.rollout.top_p == 1.0)
                for i, (ids, n) in enumerate(_rows(e)):
                    want_lp, want_en, want_lm = _hf_row(ref_model, ids, n, cfg.rollout.temperature, cfg.rollout.top_p)
                    torch.testing.assert_close(lp[i, :n].double(), want_lp, rtol=0, atol=2e-5)
                    torch.testing.assert_close(ent[i, :n].double(), want_en, rtol=0, atol=2e-5)
                    assert (lp[i, n:] == 0).all() and (ent[i, n:] == 0).all()
                    if lm is not None:
                        torch.testing.assert_close(lm[i, :n].double(), want_lm, rtol=0, atol=2e-5)
                        assert (lm[i, n:] == 0).all() and float(want_lm.min()) < -1e-3  # the nucleus cut mass
    # training: the same two optimizer steps as the reference
    for r in range(0, 2, mp_size):  # the reference trains on the old log-probs the actor produced
        for e, lp in zip(per_rank[r], got[r]["lps"]):
            e.action_log_probs = lp - 0.1 * e.advantages
            if args.algo.kl.use_loss:
                e.base_action_log_probs = _base_log_probs(lp, e)
    gas = cfg.openrlhf.train_batch_size // (cfg.openrlhf.micro_train_batch_size * dp)
    ref, norms, losses, kls = _reference(cfg, args, model_dir, [per_rank[r] for r in range(0, 2, mp_size)], dp, gas,
                                         replay=None if table is None else (by_tokens, replay_counts["train"]))
    routers = None
    if family == "qwen3_moe":
        kls, routers = kls
    assert len(norms) == 2 and norms[-1] > cfg.optim.grad_clip  # clipping was exercised
    trained = AutoModelForCausalLM.from_pretrained(args.ckpt.output_dir, dtype=torch.float32)
    want = ref.state_dict()
    for k, v in trained.state_dict().items():
        assert v.shape == want[k].shape, (k, v.shape, want[k].shape)
        err = (v - want[k]).abs()
        assert float(err.max()) <= 2e-6, (k, float(err.max()), int((err > 2e-6).sum()), v.numel())
    assert not torch.equal(trained.state_dict()["model.norm.weight"], ref_model.state_dict()["model.norm.weight"])
    for g in got:  # every rank returns the same status to the controller
        assert g["status"] == got[0]["status"]
    st = got[0]["status"]
    assert st["actor_grad_norm"] == pytest.approx(norms[-1], rel=1e-4)
    assert st["policy_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4, abs=1e-6)
    assert 0 < st["ppo_clip_ratio"] < 1
    assert st["actor_lr"] == cfg.optim.lr and "reward" in st and "response_length" in st
    if args.algo.kl.use_loss:  # the logged KL: upstream's token-weighted mean of each micro-batch's KL loss
        want = sum(v * t for v, t in kls) / sum(t for _, t in kls)
        assert want > 1e-3 and st["kl"] == pytest.approx(want, rel=1e-4)
        assert st["logprobs_diff"] > 0  # the reference sits below the policy on every token here
    else:
        assert "kl" not in st
    if routers is not None:  # the routers' statistics over both training forwards, every rank's tokens
        assert st["moe/router_entropy"] == pytest.approx(routers["moe/router_entropy"], rel=1e-5)
        assert st["moe/expert_load_max_over_mean"] == pytest.approx(routers["moe/expert_load_max_over_mean"], rel=1e-6)
        assert st["moe/dropped_routings"] == 0.0  # dropless
        if replay_counts is not None:  # R3: the routings the trainer's routers would have chosen otherwise
            old, train = (replay_counts[k] for k in ("old", "train"))
            L = ref_model.config.num_hidden_layers  # every recorded token, every layer, once in the old pass
            assert old["tokens"] == sum(len(ids) - 1 for e in data for ids, _ in _rows(e)) * L
            assert st["moe/rollout_routes_differed_fraction"] == pytest.approx(old["differed"] / old["tokens"])
            assert st["moe/replay_differed_fraction"] == pytest.approx(train["differed"] / train["tokens"])
            assert 0.05 < st["moe/rollout_routes_differed_fraction"] < 0.95  # the perturbed engine routes apart
            print(f"R3 actor: {old['differed']}/{old['tokens']} rollout routings differ from the trainer's own "
                  f"(old-log-prob pass), {train['differed']}/{train['tokens']} in training")
        else:
            assert "moe/replay_differed_fraction" not in st and "moe/rollout_routes_differed_fraction" not in st
    else:
        assert not any(k.startswith("moe/") for k in st)


def _resume_worker(rank, world, port, args, model_dir, batches, out_dir, phase, snapshots=False, split=False):
    """``split``: the second batch is dealt out over the ranks (a data-parallel resume of a run that
    had one replica: each rank its share, as OpenRLHF's controller dispatches)."""
    from tests.megatron.cuda_shim import install

    install()
    import torch.distributed as dist

    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import fingerprint
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    actor = MegatronPolicyActorImpl(world, rank, "127.0.0.1", port)
    actor.init_model_from_pretrained(SimpleNamespace(args=args, is_rank_0=lambda: rank == 0), str(model_dir),
                                     max_steps=4, vllm_engines=None)

    logged = []  # per RL step: whether the old-log-prob pass computed log P(nucleus)

    def train(exps):
        for e in exps:
            lp = actor.forward(e.sequences, e.action_mask, e.attention_mask)
            _, lm = actor.pop_behaviour(fingerprint(e.sequences, e.attention_mask))
            logged.append(lm is not None)
            e.action_log_probs = lp - 0.1 * e.advantages
            actor.append(e)
        return actor.fit()

    states = None
    if phase == "first":
        train(batches[0])
        actor.save_checkpoint("global_step1", {"global_step": 1, "data_loader_state_dict": {"consumed": 8}})
        if snapshots:  # the weights the checkpoint holds, in Hugging Face layout
            actor._save_hf(Path(out_dir) / "hf_at_save")
    else:
        states = actor.get_checkpoint_states()
        if snapshots:  # the weights as loaded, before any step
            actor._save_hf(Path(out_dir) / "hf_at_load")
    status = train(batches[1][rank::world] if split else batches[1])
    inner = actor.optimizer.torch_optimizers[0]
    torch.save({"status": status, "states": states, "nucleus_logged": logged,
                "masters": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
                "moments": [inner.state[p][k].clone() for g in inner.param_groups for p in g["params"]
                            for k in ("exp_avg", "exp_avg_sq")],
                "weights": {k: v.clone() for k, v in actor.model.state_dict().items() if not k.endswith("_extra_state")}},
               Path(out_dir) / f"{phase}{rank}.pt")
    actor._save_hf(Path(out_dir) / f"hf_{phase}")  # the model in Hugging Face layout, whatever the layout
    dist.destroy_process_group()


def test_bf16_actor_checkpoint_resumes_exactly(tmp_path):
    from tests.megatron._dist import start

    # the nucleus metric every 2 RL steps: step 1 (before the save) computes it, step 2 does not,
    # resumed or not (the cadence continues from the checkpoint's global_step)
    cfg, args = _args(tmp_path, ["megatron.tensor_parallel=2", "megatron.params_dtype=bf16",
                                 "rollout.nucleus_metric_every=2"])
    assert cfg.rollout.top_p < 1
    model_dir = _tiny_model_dir(tmp_path / "model", False)
    data = _experiences(4, seed=5)
    batches = [data[:2], data[2:]]
    out = tmp_path / "out"
    out.mkdir()
    for phase in ("first", "resume"):
        start(_resume_worker, 2, (2, _free_port(), args, model_dir, batches, str(out), phase))
    assert sorted(p.name for p in (Path(args.ckpt.path) / "_actor").iterdir()) == ["step_1"]
    for r in range(2):
        first, resumed = torch.load(out / f"first{r}.pt"), torch.load(out / f"resume{r}.pt")
        assert resumed["states"] == {"global_step": 1, "data_loader_state_dict": {"consumed": 8}}
        assert first["nucleus_logged"] == [True, True, False, False] and resumed["nucleus_logged"] == [False, False]
        assert first["status"] == resumed["status"]  # loss, grad norm, lr (scheduler resumed)
        assert all(m.dtype == torch.float32 and torch.equal(a, m) for a, m in zip(first["masters"], resumed["masters"]))
        assert all(torch.equal(a, m) for a, m in zip(first["moments"], resumed["moments"]))
        for k, v in first["weights"].items():
            assert torch.equal(v, resumed["weights"][k]), k
        assert any(v.dtype == torch.bfloat16 for v in first["weights"].values())


def test_actor_resumes_under_another_layout(tmp_path):
    """OpenRLHF's requeue path onto another layout: a Qwen3 actor saved at TP=2 resumes at
    PP=2 (``--set megatron.tensor_parallel=1 --set megatron.pipeline_parallel=2`` on the
    same run) through ``init_model_from_pretrained``: the controller's client states come
    back, and the next optimizer step equals the uninterrupted run's (loss, grad norm, the
    weights it writes)."""
    from safetensors.torch import load_file

    from tests.megatron._dist import start

    _, args_tp = _args(tmp_path, ["megatron.tensor_parallel=2"])
    _, args_pp = _args(tmp_path, ["megatron.pipeline_parallel=2"])
    assert args_tp.ckpt.path == args_pp.ckpt.path
    model_dir = _tiny_model_dir(tmp_path / "model", False, "qwen3")
    data = _experiences(4, seed=5)
    batches = [data[:2], data[2:]]
    out = tmp_path / "out"
    out.mkdir()
    start(_resume_worker, 2, (2, _free_port(), args_tp, model_dir, batches, str(out), "first"))
    start(_resume_worker, 2, (2, _free_port(), args_pp, model_dir, batches, str(out), "resume"))
    first, resumed = torch.load(out / "first0.pt"), torch.load(out / "resume0.pt")
    assert resumed["states"] == {"global_step": 1, "data_loader_state_dict": {"consumed": 8}}
    for k in ("policy_loss", "actor_grad_norm", "actor_lr"):
        assert resumed["status"][k] == pytest.approx(first["status"][k], rel=1e-5), k
    want = load_file(str(out / "hf_first" / "model.safetensors"))
    got = load_file(str(out / "hf_resume" / "model.safetensors"))
    assert set(got) == set(want) and any("q_norm" in k for k in got)
    for k, v in want.items():
        assert float((got[k] - v).abs().max()) <= 2e-6, k


TE_TP2 = ["megatron.tensor_parallel=2", "megatron.layer_spec=te", "megatron.sequence_parallel=true"]


@pytest.mark.parametrize("saved, resumed, first_sets", [(2, 1, []), (1, 2, TE_TP2)],
                         ids=["ep2_to_ep1", "tp2_te_sp_ep1_to_ep2"])
def test_moe_actor_resumes_under_another_expert_parallel_size(tmp_path, monkeypatch, saved, resumed, first_sets):
    """A Qwen3-MoE actor saved at one layout resumes at another (fresh processes; the distributed
    optimizer's state fully_reshardable): EP=2 x DP=2 -> EP=1 x DP=2, and TP=2 x EP=1 (Transformer
    Engine's spec with sequence parallelism, the stand-in) -> EP=2 x DP=2 (the local spec). The
    weights load bitwise, the controller's client states come back, and the next optimizer step
    equals the uninterrupted run's (loss, grad norm, router metrics, the weights it writes).
    dp_reshardable refuses the new EP by name."""
    from tests.megatron._dist import spawn_te, start

    common = ["megatron.distributed_optimizer=true", "megatron.optimizer_sharding=fully_reshardable"]
    _, args_a = _args(tmp_path, [f"megatron.expert_parallel={saved}", *common, *first_sets])
    _, args_b = _args(tmp_path, [f"megatron.expert_parallel={resumed}", *common])
    model_dir = _tiny_model_dir(tmp_path / "model", False, "qwen3_moe")
    data = _experiences(4, seed=5)
    batches = [data[:2], data[2:]]
    out = tmp_path / "out"
    out.mkdir()
    first = (2, _free_port(), args_a, model_dir, batches, str(out), "first", True)
    if first_sets:
        spawn_te("tests.integrations.openrlhf.test_megatron_actor:_resume_worker", 2, *first, process_group=False)
    else:
        start(_resume_worker, 2, first)
    # TP=2 (one replica) -> DP=2: each rank its half of the second batch, the same rows per optimizer step
    start(_resume_worker, 2, (2, _free_port(), args_b, model_dir, batches, str(out), "resume", True, bool(first_sets)))
    names = check_resumed_run(out, ("moe/router_entropy", "moe/expert_load_max_over_mean"))
    assert any(".experts.3.down_proj" in k for k in names)
    # the same checkpoint under dp_reshardable cannot move its experts: refused before any tensor is read
    import json

    from hapo_openrlhf.megatron.checkpoint import LAYOUT, check_resumable

    step = Path(args_a.ckpt.path) / "_actor" / "step_1"
    layout = json.loads((step / LAYOUT).read_text())
    assert layout["expert_parallel"] == saved and layout["optimizer"] == "distributed/fully_reshardable"
    (step / LAYOUT).write_text(json.dumps({**layout, "optimizer": "distributed/dp_reshardable"}))

    class Here:  # a dp_reshardable optimizer at the resumed EP
        checkpoint_format = "distributed/dp_reshardable"

    import hapo_openrlhf.megatron.checkpoint as ck

    monkeypatch.setattr(ck, "_layout", lambda optimizer: {**layout, "expert_parallel": resumed,
                                                          "optimizer": optimizer.checkpoint_format})
    with pytest.raises(ValueError, match=f"x EP {saved}, which can resume at another data-parallel size only, "
                                         f"not at .* x EP {resumed}"):
        check_resumable(step, Here())


def check_resumed_run(out: Path, status_keys=()) -> list[str]:
    """What :func:`_resume_worker`'s two phases wrote (with ``snapshots``) into ``out``: the weights loaded
    bitwise as saved, the controller's client states back, the next step's status (``policy_loss``,
    ``actor_grad_norm``, ``actor_lr`` and ``status_keys``) and the weights it writes equal to the
    uninterrupted run's. Returns the Hugging Face names."""
    from safetensors.torch import load_file

    at_save = load_file(str(out / "hf_at_save" / "model.safetensors"))
    at_load = load_file(str(out / "hf_at_load" / "model.safetensors"))
    assert set(at_save) == set(at_load)
    for k, v in at_save.items():
        assert torch.equal(at_load[k], v), k
    first, again = torch.load(out / "first0.pt"), torch.load(out / "resume0.pt")
    assert again["states"] == {"global_step": 1, "data_loader_state_dict": {"consumed": 8}}
    for k in ("policy_loss", "actor_grad_norm", "actor_lr", *status_keys):
        assert again["status"][k] == pytest.approx(first["status"][k], rel=1e-5), k
    want = load_file(str(out / "hf_first" / "model.safetensors"))
    got = load_file(str(out / "hf_resume" / "model.safetensors"))
    moved = max(float((want[k] - at_save[k]).abs().max()) for k in want)
    assert moved > 100 * 2e-6  # the resumed step moved the weights far beyond the tolerance
    for k, v in want.items():
        assert float((got[k] - v).abs().max()) <= 2e-6, k
    return sorted(at_save)


def _reference_worker(rank, world, port, args, model_dir, exps, out_dir):
    from tests.megatron.cuda_shim import install

    install()
    import torch.distributed as dist

    from hapo_openrlhf.integrations.openrlhf.actors.megatron_reference import MegatronReferenceActorImpl

    ref = MegatronReferenceActorImpl(world, rank, "127.0.0.1", port)
    ref.init_model_from_pretrained(SimpleNamespace(args=args, is_rank_0=lambda: rank == 0), str(model_dir))
    assert not any(p.requires_grad for p in ref.model.parameters()) and not hasattr(ref, "optimizer")
    got = [ref.forward(e.sequences, e.action_mask, e.attention_mask) for e in exps]
    torch.save(got, Path(out_dir) / f"ref{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tp2", "cp2_te"])
def test_megatron_reference_actor_returns_the_models_log_probs(tmp_path, layout):
    """The KL reference (kl_coef > 0 on backend: megatron): a frozen Qwen3 GPTModel at TP=2 -- or at
    context parallelism 2 on Transformer Engine's spec (the stand-in), packed, each rank forwarding its
    share -- with no optimizer, whose ``forward`` is OpenRLHF's reference contract: the action log-probs
    at the rollout temperature (masked, on the CPU) == Hugging Face's, on every rank."""
    from transformers import AutoModelForCausalLM

    from tests.megatron._dist import spawn_te, start

    sets = (["megatron.tensor_parallel=2"] if layout == "tp2" else
            ["megatron.context_parallel=2", "megatron.layer_spec=te", *PACKED])
    cfg, args = _args(tmp_path, [*sets, "algorithm.kl_coef=0.05"])
    model_dir = _tiny_model_dir(tmp_path / "model", False, "qwen3")
    exps = _experiences(2, seed=9)
    out = tmp_path / "out"
    out.mkdir()
    if layout == "tp2":
        start(_reference_worker, 2, (2, _free_port(), args, model_dir, exps, str(out)))
    else:
        spawn_te("tests.integrations.openrlhf.test_megatron_actor:_reference_worker", 2, 2, _free_port(), args,
                 model_dir, exps, str(out), process_group=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for r in range(2):
        got = torch.load(out / f"ref{r}.pt")
        for e, lp in zip(exps, got):
            assert lp.shape == e.action_mask.shape and lp.dtype == torch.float32
            for i, (ids, n) in enumerate(_rows(e)):
                with torch.no_grad():
                    want, _, _ = _hf_row(hf, ids, n, cfg.rollout.temperature)
                torch.testing.assert_close(lp[i, :n].double(), want, rtol=0, atol=2e-5)
                assert (lp[i, n:] == 0).all()


def _nonfinite_worker(rank, world, port, args, model_dir, data, out_dir, bad):
    """One good fit, then fits whose gradient on rank 0 only has one ``bad`` element (a
    tensor hook, before Megatron's DDP accumulates it into its fp32 buffer)."""
    from tests.megatron.cuda_shim import install

    install()
    import torch.distributed as dist

    from hapo_openrlhf.algos.grad_guard import NonFiniteGradientError
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import fingerprint
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl

    actor = MegatronPolicyActorImpl(world, rank, "127.0.0.1", port)
    actor.init_model_from_pretrained(SimpleNamespace(args=args, is_rank_0=lambda: rank == 0), str(model_dir),
                                     max_steps=4, vllm_engines=None)

    def fit(e):
        lp = actor.forward(e.sequences, e.action_mask, e.attention_mask)
        actor.pop_behaviour_entropy(fingerprint(e.sequences, e.attention_mask))
        e.action_log_probs = lp - 0.1 * e.advantages
        actor.append(e)
        return actor.fit()

    def snapshot():
        inner = actor.optimizer.torch_optimizers[0]
        return {"masters": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
                "moments": [v.clone() for g in inner.param_groups for p in g["params"]
                            for v in inner.state[p].values() if torch.is_tensor(v)],
                "steps": [g.get("step") for g in inner.param_groups],
                "sched": actor.schedulers[0].last_epoch,
                "weights": {k: v.clone() for k, v in actor.model.state_dict().items() if not k.endswith("_extra_state")}}

    good = fit(data[rank])
    before = snapshot()
    if rank == 0:
        p = next(p for p in actor.model.parameters() if p.requires_grad)
        p.register_hook(lambda g: g.clone().view(-1).index_fill_(0, torch.tensor([0]), bad).view_as(g))
    skipped = fit(data[2 + rank])
    after = snapshot()
    err = None
    try:
        fit(data[2 + rank])
    except NonFiniteGradientError as e:
        err = str(e)
    torch.save({"good": good, "skipped": skipped, "before": before, "after": after, "err": err,
                "dtypes": sorted({str(v.dtype) for v in before["weights"].values()})},
               Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_skips_the_step_and_n_in_a_row_stop(tmp_path, bad):
    """bf16 (no grad scaler, so megatron-core checks nothing) at DP=2 with the distributed
    optimizer; the bad element is on rank 0 only, so the ranks must agree to skip."""
    import math

    from tests.megatron._dist import start

    cfg, args = _args(tmp_path, ["megatron.params_dtype=bf16", "optim.max_consecutive_skips=2"])
    model_dir = _tiny_model_dir(tmp_path / "model", False)
    data = _experiences(4, seed=7)
    out = tmp_path / "out"
    out.mkdir()
    start(_nonfinite_worker, 2, (2, _free_port(), args, model_dir, data, str(out), bad))
    for r in range(2):
        got = torch.load(out / f"rank{r}.pt")
        assert "torch.bfloat16" in got["dtypes"]
        assert got["good"]["actor_skipped_steps"] == 0 and math.isfinite(got["good"]["actor_grad_norm"])
        st = got["skipped"]
        assert st["actor_skipped_steps"] == 1  # logged on every rank, with the offending norm
        assert (math.isnan(st["actor_grad_norm"]) if math.isnan(bad) else st["actor_grad_norm"] == math.inf)
        b, a = got["before"], got["after"]
        assert a["sched"] == b["sched"] and a["steps"] == b["steps"]
        assert len(a["moments"]) > 0 and all(torch.equal(x, y) for x, y in zip(b["moments"], a["moments"]))
        assert all(torch.equal(x, y) for x, y in zip(b["masters"], a["masters"]))
        assert all(torch.equal(v, a["weights"][k]) for k, v in b["weights"].items())
        # the second skip in a row stops the run on every rank, by name
        assert got["err"] and "2 step(s) in a row" in got["err"] and "max_consecutive_skips" in got["err"]
