"""The Megatron-core policy actor behind OpenRLHF 0.11.2's policy-actor interface
(``backend: megatron``; docs/megatron.md).

OpenRLHF's controller drives its policy actors through a handful of methods on a
``RayActorGroup``; this class implements the same ones, so the controller, the vLLM
engines, hapo's experience maker and its loss are unchanged:

==========================  ====================================================
``init_model_from_pretrained``  torch.distributed + Megatron parallel state (ranks
                            ordered tp-pp-dp, so each data-parallel replica is
                            ``TP x PP`` consecutive Ray actors: OpenRLHF's
                            "duplicate actors"), a ``GPTModel`` stage (Qwen2,
                            Qwen3 or Llama) loaded from the Hugging Face
                            checkpoint inside Megatron's
                            DDP (fp32 grad buffers), Megatron's optimizer (the
                            distributed one at DP > 1), the LR schedule, hapo's
                            loss, resume, the vLLM sync group.
``forward``                 old log-probs through the Megatron schedule (forward
                            only), plus the behaviour entropy (and log P(nucleus))
                            kept for ``pop_behaviour``; from vocabulary shards.
``append`` / ``fit``        the replay buffer and the PPO epochs: per optimizer
                            step, the global token count, ``forward_backward`` with
                            hapo's loss on the last stage into DDP's fp32 buffers,
                            Megatron's step (DP reduce-scatter or all-reduce, tied
                            embeddings, grad norm and clipping over the shards,
                            AdamW on fp32 masters, parameter all-gather), the
                            scheduler.
``broadcast_to_vllm``       streamed: per layer, TP all-gather on the device,
                            Hugging Face layout, point-to-point to rank 0 ->
                            bf16 (the engines' dtype) -> OpenRLHF's weight-sync
                            group (NCCL or Ray collective).
``save_checkpoint`` /       Megatron distributed checkpoints under
``get_checkpoint_states``   ``ckpt.path/_actor/step_N`` (the optimizer's sharded
                            state in ``megatron.optimizer_sharding``) with OpenRLHF's
                            ``client_states`` (data position, step, best metric).
``save_model``              the trained model in Hugging Face layout.
==========================  ====================================================

What OpenRLHF's DeepSpeed actor does and this one does not: EMA, LoRA,
sleep/offload (so no colocated vLLM); the config loader rejects those settings for
``backend: megatron``. The KL-to-reference loss (``algo.kl.use_loss``, k1/k2/k3) is
computed here with OpenRLHF's own ``compute_approx_kl`` and ``aggregate_loss`` from the
log-probs a :class:`~.megatron_reference.MegatronReferenceActor` group returns. Packed
samples (THD) and token-budget micro-batches (``dynamic_batch``) are this actor's own
(``megatron.schedule``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import ray
import torch
import torch.distributed as dist
from openrlhf.models import aggregate_loss
from openrlhf.models.utils import compute_approx_kl, masked_mean
from openrlhf.trainer.ppo_utils.experience import (
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)
from openrlhf.trainer.ray.launcher import BaseModelActor
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from ....algos.losses import LOSSES
from ....config import transported
from ....algos.grad_guard import SkipGuard
from ....cluster.ports import OutsideEphemeralPort
from .deepspeed_actor import BehaviourEntropyStore, loss_from_config
from .loss import DUMP_ENV, LossStateSink
from .megatron_io import (VLLM_DTYPE, MegatronWeightsIO, SafetensorsDir, check_tp_peers_share_a_node,  # noqa: F401
                          device, resolve_pretrained)

from ....megatron.setup import DTYPES
def _host_values(rows: list[list[Any]]) -> list[list[float]]:
    """Rows of 0-d tensors (on the device) and numbers as Python floats, read from the device in
    one transfer (each ``float(t)`` would wait for the GPU on its own: one sync per metric and
    micro-batch, twelve more a micro-batch for STARE's six metrics)."""
    if not rows:
        return []
    flat = [v for r in rows for v in r]
    dev = next((v.device for v in flat if torch.is_tensor(v)), torch.device("cpu"))
    vals = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev).reshape(()) for v in flat])
    it = iter(vals.tolist())
    return [[next(it) for _ in r] for r in rows]


def left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad ``t`` [B, S] on the left to ``width`` columns (masked out by the attention mask)."""
    return torch.nn.functional.pad(t, (width - t.shape[1], 0))


class MegatronPolicyActorImpl(OutsideEphemeralPort, MegatronWeightsIO, BehaviourEntropyStore, LossStateSink,
                              BaseModelActor):
    r3 = False  # rollout routing replay (the policy under megatron.moe.routing_replay: r3; never the reference)
    _rollout_route_stats: dict | None = None
    # ------------------------------------------------------------------ setup
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        from transformers.trainer import get_scheduler

        from ....megatron.checkpoint import latest, load
        from ....megatron.ddp import MegatronOptimizer, use_distributed_optimizer, wrap

        cfg = transported(strategy.args.hapo)
        m = cfg.megatron
        self.r3 = cfg.routing_replay
        self._build_model(strategy, pretrain, routing_replay=self.r3)
        args = self.args
        if self.r3:  # this step's rollout routes (routes.RouteStore; the controller sends them, set_routes)
            from ....megatron.moe import moe_of
            from .routes import RouteStore

            spec = moe_of(self.hf_config)
            self.routes = RouteStore(int(self.hf_config.num_hidden_layers), spec.top_k, spec.num_experts)
        self._rollout_route_stats: dict | None = {} if self.r3 else None
        self.vllm_engines = vllm_engines

        # Megatron's DDP (fp32 grad buffers) and optimizer: fp32 masters for a bf16 model, and with
        # the distributed optimizer masters + moments sharded over DP (megatron/ddp.py)
        # (megatron-core shards it over DP x CP: CP ranks hold the same parameters)
        self.distributed_optimizer = use_distributed_optimizer(m.distributed_optimizer, self.dp_size * self.cp)
        self.ddp = wrap(self.model, distributed_optimizer=self.distributed_optimizer)
        adam = args.actor.adam
        self.optimizer = MegatronOptimizer(self.ddp, lr=adam.lr, betas=tuple(adam.betas), eps=adam.eps,
                                           weight_decay=adam.weight_decay, clip_grad=float(args.actor.max_norm),
                                           sharding=m.optimizer_sharding)
        if dist.get_rank() == 0:
            from ....megatron.head import is_installed

            cp = f" x CP {self.cp} ({m.cp_comm_type})" if self.cp > 1 else ""
            print(f"Megatron actor: TP {self.tp}{cp} x PP {self.pp} x DP {self.dp_size}, {self.params_dtype}, "
                  f"head {'fused' if is_installed(self.model) else 'logits'}, "
                  f"optimizer {self.optimizer.checkpoint_format}", flush=True)
        name = args.actor.lr_scheduler
        self.schedulers = [get_scheduler(
            name, opt, num_warmup_steps=math.ceil(max_steps * args.actor.lr_warmup_ratio),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=({"min_lr_rate": args.actor.min_lr_ratio}
                                       if name in {"cosine_with_min_lr", "cosine_warmup_with_min_lr"} else {}))
            for opt in self.optimizer.torch_optimizers]
        self.loss_fn = loss_from_config(cfg)
        self.grad_guard = SkipGuard(cfg.optim.max_consecutive_skips, "the Megatron actor")
        self.items: list[Experience] = []
        self.kl_ctl = 0.0

        self.ckpt_root = Path(args.ckpt.path) / "_actor"
        self.checkpoint_states: dict[str, Any] = {}
        # rank 0 chooses the checkpoint and every rank loads that one (ranks reading a caching
        # network filesystem after a requeue could otherwise see different "latest" steps)
        mine = latest(self.ckpt_root) if args.ckpt.load_enable and dist.get_rank() == 0 else None
        choice = [str(mine) if mine is not None else None]
        dist.broadcast_object_list(choice, src=0)
        found = Path(choice[0]) if choice[0] else None
        if found is not None:
            if dist.get_rank() == 0:
                print(f"Loading the checkpoint: {found}", flush=True)
            state = load(found, self.ddp, self.optimizer)
            for sched, sd in zip(self.schedulers, state["scheduler"], strict=True):
                sched.load_state_dict(sd)
            self.grad_guard.load_state_dict(state.get("grad_guard", {}))
            self.checkpoint_states = state["client_states"]
        # RL steps trained so far: the nucleus metric's cadence continues across a resume
        self.steps_done = int(self.checkpoint_states.get("global_step", 0))

        if self.vllm_engines is not None and dist.get_rank() == 0:
            # OpenRLHF's own group set-up (NCCL / Ray collective between rank 0 and every engine)
            ActorPPOTrainer._init_vllm_sync_group(self, args.vllm.sync_backend)
        dist.barrier()

    def _build_model(self, strategy, pretrain, routing_replay: bool = False) -> None:
        """The process groups and this rank's GPTModel stage, loaded from the Hugging Face
        checkpoint ``pretrain`` (collective): what the policy and the KL reference share
        (``routing_replay``: the policy's routers replay the rollout's routes under R3)."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from transformers import AutoConfig, AutoTokenizer

        from ....megatron.setup import build_stage, init_parallel_state, load_hf_weights

        self.strategy = strategy
        self.args = args = strategy.args
        cfg = transported(args.hapo)
        m = cfg.megatron
        self.tp, self.pp, self.ep, self.cp = m.tensor_parallel, m.pipeline_parallel, m.expert_parallel, m.context_parallel
        dup = args.ds.ring_attn_size * args.ds.tensor_parallel_size
        if dup != m.model_parallel_size:
            raise ValueError(f"OpenRLHF's controller groups {dup} actors per data-parallel replica "
                             f"(ring_attn_size x ds.tensor_parallel_size) but the Megatron layout is "
                             f"TP {self.tp} x CP {self.cp} x PP {self.pp}: launch through hapo_openrlhf's flags "
                             f"(flags.build_argv)")
        if self.cp > 1:  # the comm type the installed TE lacks: one line, before any process group
            from ....megatron.context_parallel import check_installed_te

            check_installed_te(m.cp_comm_type)

        from ....cluster.netif import check_process_env

        check_process_env()  # a misnamed socket interface fails here, not as a hang in the first collective
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(minutes=m.timeout_minutes))
        # the same start-up the full-size dry run checks (megatron/setup.py, megatron/dryrun.py)
        ranks = init_parallel_state(self.tp, self.pp, self.ep, self.cp)
        seed = int(args.train.seed)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.tp_rank, self.pp_rank, self.ep_rank, self.dp_size = ranks.tp_rank, ranks.pp_rank, ranks.ep_rank, ranks.dp_size
        check_tp_peers_share_a_node(ps.get_tensor_model_parallel_group())

        path = resolve_pretrained(pretrain)
        self.hf_config = AutoConfig.from_pretrained(path)
        from ....megatron.families import check_actor_family

        self.moe = check_actor_family(self.hf_config, m).moe  # before any weight is read
        self.params_dtype = DTYPES[m.params_dtype]
        self.vocab_size = int(self.hf_config.vocab_size)
        model = build_stage(self.hf_config, m, ranks, routing_replay=routing_replay, cuda=torch.cuda.is_available())
        # micro-batch layout (megatron.schedule): packed THD with openrlhf.packing_samples, else
        # right-aligned padded rows (FlashCoreAttention) or Megatron's masked local attention
        self.layout = ("thd" if args.ds.packing_samples else
                       "padded" if m.attention == "flash" or m.layer_spec == "te" else "masked")
        self.token_budget = int(args.train.max_tokens_per_gpu) if args.train.dynamic_batch_enable else None
        load_hf_weights(model, SafetensorsDir(path), self.hf_config, m, ranks, what=pretrain)
        self.model = model.to(device())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.temperature = float(args.rollout.temperature)
        self.top_p = float(cfg.rollout.top_p)  # < 1: the old-log-prob pass logs log P(nucleus)
        self.nucleus_every = cfg.rollout.nucleus_metric_every  # on steps 1, 1 + N, ...
        self.entropy_chunk = cfg.algorithm.entropy_chunk_size

    # ------------------------------------------------------ old log-probs
    def _row_groups(self, lengths: list[int], rows_per_mb: int) -> list[list[int]]:
        """Row indices per micro-batch: by the token budget (``train.dynamic_batch_enable``,
        ``train.max_tokens_per_gpu`` tokens per micro-batch of this model replica), else
        ``rows_per_mb`` consecutive rows. A mixture of experts dispatches tokens over its
        expert-parallel group in every MoE layer, so every data-parallel rank runs the same
        number of micro-batches (``schedule.even_out``: the most any rank needs; collective)."""
        from ....megatron.schedule import even_out, token_budget_batches

        if self.token_budget is not None and self.layout != "masked":
            if self.cp > 1:  # the budget counts what one CP rank holds: each row padded for the split, / CP
                from ....megatron.context_parallel import tokens_per_rank

                sp = self.model.config.sequence_parallel
                lengths = [tokens_per_rank([int(n)], self.cp, tp=self.tp, sequence_parallel=sp) for n in lengths]
            groups = token_budget_batches(lengths, self.token_budget)
        else:
            groups = [list(range(i, min(i + rows_per_mb, len(lengths)))) for i in range(0, len(lengths), rows_per_mb)]
        if self.moe and self.ep > 1:
            from megatron.core import parallel_state as ps

            n = torch.tensor([len(groups)], device=device())  # an EP group may span DP and CP ranks
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
            groups = even_out(groups, lengths, int(n))
        return groups

    def _logprobs_entropy(self, sequences: torch.Tensor, attention_mask: torch.Tensor):
        """[B, S-1] log-probs and entropy (no grad) on every rank of the model-parallel group.
        The rows go through the schedule as several micro-batches (by the token budget, or
        split in 2 x PP with pipelining) so pipeline stages overlap."""
        from megatron.core import parallel_state as ps

        from ....megatron.schedule import forward_backward
        from ....megatron.taps import NucleusLogMass, ReplayRoutes

        from ....algos.nucleus import metric_due

        dev = device()
        B, S = sequences.shape
        top_p = self.top_p if metric_due(self.top_p, self.nucleus_every, self.steps_done) else 1.0
        lengths = attention_mask.sum(-1).tolist()
        per = B if self.pp == 1 or self.layout == "masked" else max(1, -(-B // (2 * self.pp)))
        groups = self._row_groups(lengths, per)
        mbs = [{"input_ids": sequences[g].to(dev), "attention_mask": attention_mask[g].to(dev),
                "input_ids_cpu": sequences[g].cpu(), "attention_mask_cpu": attention_mask[g].cpu()} for g in groups]
        if self.r3:  # the rollout's routes, replayed; how many the router would have chosen otherwise is counted
            for mb in mbs:  # kept on the host: RowLayout.route_input moves one micro-batch's at a time
                mb["routed_experts"] = self.routes.tensor(mb["input_ids_cpu"], mb["attention_mask_cpu"])
        self.model.eval()
        with torch.no_grad():
            # under R3 the replay's counts only (no router entropy / load on this pass)
            taps = [NucleusLogMass(top_p)] + ([ReplayRoutes(self._rollout_route_stats)] if self.r3 else [])
            out = forward_backward(self.model, mbs, None, vocab_size=self.vocab_size, temperature=self.temperature,
                                   chunk_size=self.entropy_chunk, forward_only=True, layout=self.layout, taps=taps)
        self.model.train()
        # log-probs, entropy and (under top-p) log P(nucleus), each [B, S-1]
        vals = [torch.zeros(B, S - 1, dtype=torch.float32, device=dev) for _ in range(3 if top_p < 1 else 2)]
        for g, got in zip(groups, out or []):
            idx = torch.tensor(g, device=dev)
            for v, x in zip(vals, got, strict=True):
                v[idx] = x.float()
        if self.pp > 1:  # the last stage computed them: hand them to the stage that answers the controller
            src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
            for v in vals:
                dist.broadcast(v, src=src, group=group)
        return vals[0], vals[1], (vals[2] if len(vals) == 3 else None)

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[Union[int, list[int]]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
    ) -> torch.Tensor:
        """OpenRLHF's old-log-prob forward: action log-probs [B, A] (masked, on the CPU);
        the behaviour entropy (and, under top-p, log P(nucleus)) of the same pass is kept
        for ``pop_behaviour``."""
        if mm_train_inputs_list and any(mm_train_inputs_list):
            raise ValueError("the Megatron actor has no vision inputs")
        lp, en, lm = self._logprobs_entropy(sequences, attention_mask)
        A = action_mask.shape[1]
        am = action_mask.to(lp.device).float()
        self._keep_behaviour_entropy(sequences, attention_mask, (en[:, -A:] * am).cpu(),
                                     None if lm is None else (lm[:, -A:] * am).cpu())
        return (lp[:, -A:] * am).cpu()

    def set_routes(self, routes: dict[str, list]) -> None:
        """This step's rollout routes (R3): ``row fingerprint -> [routes]`` (Ray references from the
        engines, or arrays), from the controller before the step's first forward (routes.py)."""
        if not self.r3:
            raise RuntimeError("set_routes: the actor was built without megatron.moe.routing_replay: r3")
        self.routes.set(routes)

    # ------------------------------------------------------------ training
    def append(self, experience: Experience) -> None:
        experience.to_device(torch.device("cpu"))
        self.items.extend(remove_padding_in_sequences(split_experience_batch(experience)))

    def _loss_norm(self, window: list[Experience]) -> dict[str, Any]:
        """The step's global normalisers (no ``/ gas``: Megatron's schedule does not scale
        micro-batch losses, ``calculate_per_token_loss=True``)."""
        from megatron.core import parallel_state as ps

        counts = torch.zeros(3, dtype=torch.float64)  # from the CPU masks: nothing waits for the GPU
        for e in window:
            m = e.action_mask.float()
            counts[0] += m.sum()
            counts[1] += (m.sum(-1) > 0).sum()
            counts[2] += e.attention_mask.sum()  # every real token passes the routers of a MoE model
        if self.dp_size > 1:  # one all-reduce and one read per optimizer step, not per micro-batch
            counts = counts.to(device())
            dist.all_reduce(counts, group=ps.get_data_parallel_group())
        tokens, rows, real = counts.tolist()
        return {"dp_size": self.dp_size, "batch_num_tokens": tokens, "global_batch_size": rows,
                "real_tokens": real}

    def _micro_batches(self, window: list[Experience]) -> list[dict[str, Any]]:
        """The step's micro-batches as model inputs. With Megatron's masked attention they
        are left-padded to one length (its pipeline exchanges fixed shapes); the packed and
        right-aligned layouts drop the padding themselves. The response stays the last
        ``A`` positions of each row, as OpenRLHF slices it."""
        dev = device()
        S = max(e.sequences.shape[1] for e in window)
        out = []
        for e in window:
            pad = (lambda t: left_pad(t, S)) if self.layout == "masked" else (lambda t: t)
            # the CPU copies give the schedule its sizes and the vocabulary check without a host sync
            mb = {"input_ids": pad(e.sequences).to(dev), "attention_mask": pad(e.attention_mask).to(dev),
                  "input_ids_cpu": pad(e.sequences), "attention_mask_cpu": pad(e.attention_mask),
                  "action_mask": e.action_mask.to(dev), "old_log_probs": e.action_log_probs.to(dev),
                  "advantages": e.advantages.to(dev)}
            if e.rollout_log_probs is not None:  # the engines' log-probs (mismatch correction)
                mb["rollout_log_probs"] = e.rollout_log_probs.to(dev)
            if e.base_action_log_probs is not None:  # the KL reference's (algo.kl.use_loss)
                mb["base_log_probs"] = e.base_action_log_probs.to(dev)
            if self.r3:  # the rollout's routes, replayed in the training forward too (on the host, as above)
                mb["routed_experts"] = self.routes.tensor(mb["input_ids_cpu"], mb["attention_mask_cpu"])
            if os.environ.get(DUMP_ENV):
                mb["rows"] = [row[m.bool()].tolist() for row, m in zip(e.sequences, e.attention_mask)]
            out.append(mb)
        return out

    def _optimizer_step(self, window: list[Experience], route_stats: dict | None = None) -> dict[str, float]:
        from ....megatron.schedule import forward_backward
        from ....megatron.taps import AuxLossScale, HeadSignals, ReplayRoutes, RouterStats

        info = self._loss_norm(window)
        aux_norm = info.pop("real_tokens") / self.dp_size  # the load-balancing loss's (moe.scaled_aux_loss)
        kl_cfg = self.args.algo.kl

        def loss_fn(lp, en, mb):
            A = mb["action_mask"].shape[1]
            if self.loss_fn.needs_entropy:
                self.loss_fn.pending_entropy = en
            if "head_signals" in mb:  # PAEC: the nucleus entropy and top-two gap of this forward
                self.loss_fn.pending_signals = mb["head_signals"]
            if "rows" in mb:
                self.loss_fn.pending_sequences = mb["rows"]
            loss, clip_ratio, ppo_kl, vllm_kl, is_filter = self.loss_fn(
                lp[:, -A:], mb["old_log_probs"], mb["advantages"], action_mask=mb["action_mask"],
                rollout_log_probs=mb.get("rollout_log_probs"), **info)
            stats = {"ppo_clip_ratio": clip_ratio.detach().float(), "ppo_kl": ppo_kl.detach().float(),
                     "tokens": mb["action_mask"].sum().float(), "policy_loss": loss.detach().float()}
            if kl_cfg.use_loss:  # OpenRLHF's ActorPPOTrainer.training_step, with its own functions
                lp_a = lp[:, -A:]
                if kl_cfg.init_coef > 0:
                    if "base_log_probs" not in mb:
                        raise RuntimeError("algo.kl.use_loss with init_coef > 0 but the experience has no "
                                           "base_action_log_probs (no reference model group?)")
                    kl = compute_approx_kl(lp_a, mb["base_log_probs"], log_probs_old=mb["old_log_probs"],
                                           kl_estimator=kl_cfg.estimator, unbiased_gradient=kl_cfg.unbiased_gradient)
                    diff = lp_a.float() - mb["base_log_probs"].float()
                else:
                    kl, diff = torch.zeros_like(lp_a), torch.zeros_like(lp_a)
                kl_loss = aggregate_loss(kl, mb["action_mask"], **info)
                loss = loss + kl_loss * self.kl_ctl
                stats.update(kl=kl_loss.detach().float(),
                             logprobs_diff=masked_mean(diff, mb["action_mask"]).detach().float())
            if vllm_kl is not None:  # upstream logs them per micro-batch into experience.info
                m = self.loss_fn.last_metrics
                stats.update(vllm_kl=vllm_kl.detach().float(), is_filter_ratio=is_filter.detach().float(),
                             is_ratio_mean=torch.as_tensor(m["actor/is_ratio_mean"]).float(),
                             is_ratio_max=torch.as_tensor(m["actor/is_ratio_max"]).float())
            # a method's own metrics (stare/...), token-weighted like upstream's per micro-batch info
            stats.update({k: torch.as_tensor(v).float() for k, v in self.loss_fn.method_metrics().items()})
            return loss, stats

        self.model.train()
        d = os.environ.get(DUMP_ENV)
        if d and dist.get_rank() == 0:  # tests: how the step was cut into micro-batches
            with open(os.path.join(d, "megatron_micro_batches_rank0.jsonl"), "a") as f:
                f.write(json.dumps({"layout": self.layout, "budget": self.token_budget,
                                    "tokens": [int(e.attention_mask.sum()) for e in window],
                                    "rows": [int(e.attention_mask.shape[0]) for e in window]}) + "\n")
        # PAEC's head signals; R3's replay; the routers' statistics (closed in reverse: stats, then replay's counts)
        taps = [HeadSignals(self.loss_fn.signals_top_p)] if self.loss_fn.signals_top_p is not None else []
        taps += ([ReplayRoutes(route_stats)] if self.r3 else []) + ([RouterStats(route_stats)] if route_stats is not None
                                                                   else [])
        out = forward_backward(self.ddp, self._micro_batches(window), loss_fn, vocab_size=self.vocab_size,
                               temperature=self.temperature, chunk_size=self.entropy_chunk, layout=self.layout,
                               taps=[*taps, AuxLossScale(aux_norm)])
        lr = self.schedulers[0].get_last_lr()[0]
        norm = self.optimizer.step()  # reduce over DP, clip at actor.max_norm, AdamW, gather parameters
        # a non-finite gradient: the optimizer skipped the update (every rank alike), the schedule
        # stays; N in a row stop the run (algos/grad_guard.py)
        skipped = self.grad_guard.update(norm if self.optimizer.skipped else None,
                                         step=self.schedulers[0].last_epoch + 1)
        if not skipped:
            for sched in self.schedulers:
                sched.step()
        stats = {"actor_grad_norm": norm, "actor_lr": lr}
        if out:  # last stage: the step's loss and the token-weighted PPO statistics (this replica)
            keys = [k for k in ("ppo_clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio", "is_ratio_mean",
                                "is_ratio_max", "kl", "logprobs_diff", *LOSSES.get(self.loss_fn.name).metrics)
                    if k in out[0]]
            rows = _host_values([[o["tokens"], o["policy_loss"], *(o[k] for k in keys)] for o in out])
            stats["_loss_sum"] = sum(r[1] for r in rows)  # without the KL term, as upstream logs it
            stats["_tokens"] = sum(r[0] for r in rows)
            for j, k in enumerate(keys):
                stats["_w_" + k] = sum(r[2 + j] * r[0] for r in rows)
        return stats

    @staticmethod
    def _info_sums(e: Experience, sums: dict[str, list[float]]) -> None:
        """Upstream's metric weighting: 0-d info values per token, per-sample values per sample."""
        n_tok, n_smp = float(e.action_mask.sum()), float(e.action_mask.shape[0])
        values: dict[str, torch.Tensor] = {}
        for k, v in e.info.items():
            if isinstance(v, torch.Tensor):
                values[k] = v
            elif isinstance(v, list):
                values[k] = torch.tensor(v, dtype=torch.float)
        for f in fields(Experience):
            if f.name in {"rewards", "scores"} or not Experience.is_episode_tensor_field(f.name):
                continue
            v = getattr(e, f.name)
            if isinstance(v, torch.Tensor) and f.name not in values:
                values[f.name] = v
        for k, v in values.items():
            w = n_tok if v.dim() == 0 else n_smp
            s = sums.setdefault(k, [0.0, 0.0])
            s[0] += float(v.float().mean()) * w
            s[1] += w

    def fit(self, kl_ctl: float = 0) -> dict[str, float]:
        """PPO epochs over the replay buffer; returns the same status dict on every rank."""
        from megatron.core import parallel_state as ps

        args = self.args
        self.kl_ctl = float(kl_ctl)  # the KL loss's coefficient this step (OpenRLHF's kl controller)
        mb = int(args.train.micro_batch_size)
        if not self.items or len(self.items) % mb:
            raise ValueError(f"the Megatron actor got {len(self.items)} samples, not a positive multiple of "
                             f"train.micro_batch_size {mb} (no sample is dropped)")
        gas = max(int(args.train.batch_size) // (mb * self.dp_size), 1)
        step_rows = mb * gas
        # each optimizer step's rows, as micro-batches (mb rows, or by the token budget)
        steps = []
        for k in range(0, len(self.items), step_rows):
            items = self.items[k:k + step_rows]
            groups = self._row_groups([int(e.attention_mask.sum()) for e in items], mb)
            steps.append([make_experience_batch([items[i] for i in g]) for g in groups])
        sums: dict[str, list[float]] = {}
        loss_sum = 0.0
        last: dict[str, float] = {}
        route_stats = {} if self.moe else None  # the routers over every training forward of this fit
        for _ in range(int(args.train.max_epochs)):
            for window in steps:
                st = self._optimizer_step(window, route_stats)
                last = {"actor_grad_norm": st["actor_grad_norm"], "actor_lr": st["actor_lr"]}
                loss_sum += st.get("_loss_sum", 0.0)
                keys = ("ppo_clip_ratio", "ppo_kl") + (
                    ("vllm_kl", "is_filter_ratio", "is_ratio_mean", "is_ratio_max")
                    if self.loss_fn.is_correction.enabled else ()) + (
                    ("kl", "logprobs_diff") if args.algo.kl.use_loss else ()) + LOSSES.get(
                    self.loss_fn.name).metrics  # a method's own metrics (stare/...): the same keys on every rank
                for key in keys:
                    s = sums.setdefault(key, [0.0, 0.0])
                    s[0] += st.get("_w_" + key, 0.0)
                    s[1] += st.get("_tokens", 0.0)
                for e in window:
                    self._info_sums(e, sums)
        self.items.clear()
        self.steps_done += 1
        n_steps = int(args.train.max_epochs) * len(steps)
        # the mean over optimizer steps of each step's whole loss: a replica's micro-batch losses
        # sum to dp_size x its share (normaliser count / dp_size), and the weights sum dp_size times
        sums["policy_loss"] = [loss_sum, float(n_steps)]
        keys = sorted(sums)
        vec = torch.tensor([x for k in keys for x in sums[k]], dtype=torch.float64, device=device())  # NCCL: on GPU
        if self.pp > 1:  # loss statistics live on the last stage
            dist.broadcast(vec, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if self.dp_size > 1:
            dist.all_reduce(vec, group=ps.get_data_parallel_group())
        pairs = vec.view(-1, 2).tolist()  # one read of the step's sums
        status = {k: a / b if b > 0 else 0.0 for k, (a, b) in zip(keys, pairs)}
        status.update(last)
        status["actor_skipped_steps"] = float(self.grad_guard.skipped)  # the same on every rank
        if self.moe:  # router entropy, expert load, dropped routings over every rank (moe.reduce_route_stats)
            from ....megatron.moe import reduce_route_stats

            status.update(reduce_route_stats(route_stats, self.hf_config))
        if self.r3:  # the old-log-prob forwards: the weights the engines rolled out with
            got = reduce_route_stats(self._rollout_route_stats, self.hf_config)
            status["moe/rollout_routes_differed_fraction"] = got.get("moe/replay_differed_fraction", 0.0)
            self._rollout_route_stats = {}
            self.routes.set({})  # the step's routes are spent: their object-store references go now
        return status

    # ------------------------------------------------ not on this back end
    def reload_states(self):
        raise NotImplementedError("the Megatron actor has no sleep mode (openrlhf.vllm_enable_sleep must be false)")

    offload_states = reload_states


MegatronPolicyActor = ray.remote(num_gpus=1)(MegatronPolicyActorImpl)
