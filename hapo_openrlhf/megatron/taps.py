"""The schedule's per-micro-batch hooks ("taps"): each feature that needs to act around the
micro-batches of ``schedule.forward_backward`` is one tap, handed in a list, instead of one keyword
option per feature. A tap may

* ``start(model, micro_batches, training)``: check the micro-batches and install what it needs, before
  the schedule runs (``training``: a pass that computes gradients);
* ``context(config, training)``: a context the whole schedule runs inside;
* ``before_forward(mb, layout, tp_rank, sp_tp)``: act before a micro-batch's forward (this rank's
  tokens: ``sp_tp`` ways split under sequence parallelism);
* ``on_head(logits, layout, head, batch, values, training)``: on the last stage, after the head, add
  to what the loss receives (``batch``) or to what a forward-only pass returns (``values``);
* ``close()``: undo what it installed and hand its results over, after the schedule (also on error).

The taps: :class:`NucleusLogMass` (log P(nucleus) on the old-log-prob pass under top-p),
:class:`HeadSignals` (PAEC's nucleus entropy and top-two gap for the loss), :class:`ReplayRoutes`
(rollout routing replay, with the counts of routings that differed), :class:`RouterStats` (the
routers' entropy, load and drops over the real tokens) and :class:`AuxLossScale` (the load-balancing
loss's weight for a training pass). Micro-batches carrying ``routed_experts`` need a
:class:`ReplayRoutes` tap: routes handed in and not replayed would be a silent no-op.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from .moe import scaled_aux_loss, stage_routers


class Head(NamedTuple):
    """What the last stage's head computes with, for a tap that reads the head's output."""

    vocab_size: int
    temperature: float
    chunk_size: int
    tp_group: Any
    tp_rank: int
    weight: torch.Tensor | None  # the fused head's output weight shard (None: the logits path)


class Tap:
    """A no-op tap; a subclass overrides what it needs (module docstring)."""

    def start(self, model, micro_batches: list[dict], training: bool) -> None:
        pass

    def context(self, config, training: bool):
        return contextlib.nullcontext()

    def before_forward(self, mb: dict, layout, tp_rank: int, sp_tp: int) -> None:
        pass

    def on_head(self, logits: torch.Tensor, layout, head: Head, batch: dict, values: tuple,
                training: bool) -> tuple[dict, tuple]:
        return batch, values

    def close(self) -> None:
        pass


class NucleusLogMass(Tap):
    """The old-log-prob pass under top-p (< 1): log P(nucleus) [B, S-1] joins the returned values."""

    def __init__(self, top_p: float):
        self.top_p = float(top_p)

    def on_head(self, logits, layout, head, batch, values, training):
        if training or self.top_p >= 1.0:
            return batch, values
        return batch, values + (layout.nucleus_logmass(logits, top_p=self.top_p, **head._asdict()),)


class HeadSignals(Tap):
    """A loss that takes them (PAEC): the same forward's nucleus entropy and top-two gap [B, S-1],
    detached, as the loss's micro-batch ``head_signals``."""

    def __init__(self, top_p: float):
        self.top_p = float(top_p)

    def on_head(self, logits, layout, head, batch, values, training):
        if not training:
            return batch, values
        return {**batch, "head_signals": layout.head_signals(logits, top_p=self.top_p, **head._asdict())}, values


class ReplayRoutes(Tap):
    """Rollout routing replay: each micro-batch's ``routed_experts`` [B, S, layers, k] replayed in this
    stage's routers (:class:`RouteReplay`); with ``stats`` the replay's ``tokens`` and ``differed``
    (the recorded routings, and those the router would have chosen otherwise) are added to it."""

    def __init__(self, stats: dict | None = None):
        self.stats, self.replay = stats, None

    def start(self, model, micro_batches, training):
        from megatron.core import parallel_state as ps

        if not any("routed_experts" in mb for mb in micro_batches):
            return
        if not all("routed_experts" in mb for mb in micro_batches):
            raise ValueError("routing replay: every micro-batch needs routed_experts, or none")
        config = model.config
        if ps.get_pipeline_model_parallel_world_size() > 1 and config.recompute_granularity is not None:
            raise ValueError("routing replay with activation recomputation under pipeline parallelism is not "
                             "supported (a recomputed forward would replay a later micro-batch's routes)")
        self.replay = RouteReplay(model)

    def before_forward(self, mb, layout, tp_rank, sp_tp):
        if self.replay is not None:
            self.replay.set(*layout.route_input(mb["routed_experts"], tp_rank=tp_rank, tp=sp_tp))

    def close(self):
        if self.replay is None:
            return
        self.replay.close()
        if self.stats is not None:  # tokens routed by replay, and those the router would have sent elsewhere
            self.stats["tokens"] = self.stats.get("tokens", 0) + self.replay.tokens
            self.stats["differed"] = self.stats.get("differed", 0) + self.replay.differed
        self.replay = None


class RouterStats(Tap):
    """A mixture of experts' router statistics over the real tokens (:class:`RouterMonitor`), summed
    into ``stats`` (``moe.router_metrics`` turns them into logged values); nothing for a dense model."""

    def __init__(self, stats: dict):
        self.stats, self.monitor = stats, None

    def start(self, model, micro_batches, training):
        if getattr(model.config, "num_moe_experts", None):
            self.monitor = RouterMonitor(model)

    def before_forward(self, mb, layout, tp_rank, sp_tp):
        if self.monitor is not None:
            self.monitor.set(layout.real_tokens(tp_rank=tp_rank, tp=sp_tp))

    def close(self):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor.add_to(self.stats)
            self.monitor = None


class AuxLossScale(Tap):
    """A training pass of a mixture of experts with a load-balancing loss: the coefficient divided by
    ``normaliser`` -- the step's real tokens over every data-parallel rank, over DP, as hapo's losses
    divide (``moe.scaled_aux_loss``). Without this tap such a pass is refused by name."""

    def __init__(self, normaliser: float | None):
        self.normaliser = normaliser

    def context(self, config, training):
        return scaled_aux_loss(config, self.normaliser, training=training)


class RouteReplay:
    """Replays recorded expert choices in this stage's routers (megatron-core's ``RouterReplay``,
    built with ``moe_enable_routing_replay``): :meth:`set` before a micro-batch's forward hands each
    router its tokens' recorded top-k (``[tokens, layers, k]`` in the model input's token order,
    ``RowLayout.route_input``); the routing weights are then the router's own softmax over the
    replayed experts (Hugging Face's routing with the indices given). It also counts how many tokens
    the router would have routed otherwise (:attr:`tokens`, :attr:`differed`): the recorded top-k
    set against the router's own top-k of the same logits."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.routers = stage_routers(model)
        missing = [i for i, r in self.routers if getattr(r, "router_replay", None) is None]
        if missing:
            raise ValueError("routing replay needs the model built with routing_replay=True "
                             f"(megatron-core's moe_enable_routing_replay); layers {missing[:4]} have no replay")
        self._action = RouterReplayAction.REPLAY_FORWARD
        self.tokens = self.differed = 0
        self._recorded = None
        self._hooks = [r.register_forward_pre_hook(self._count) for _, r in self.routers]

    def set(self, routes: torch.Tensor, recorded: torch.Tensor | None = None) -> None:
        """``routes`` [tokens, n_layers, k] for every layer of the model (this stage's are taken);
        ``recorded`` [tokens]: which of them the rollout recorded (the rest are filled in, not counted)."""
        self._recorded = recorded
        for i, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(routes[:, i].long())
            router.router_replay.set_router_replay_action(self._action)

    @torch.no_grad()
    def _count(self, router, args) -> None:
        target = router.router_replay.target_topk_idx
        if target is None:
            return
        logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
        own = torch.topk(logits.float(), target.shape[1], dim=-1).indices
        same = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, own, True).gather(1, target.to(own.device))
        differs = ~same.all(-1)
        if self._recorded is not None:  # a weighted sum, not a boolean index: no host sync
            w = self._recorded.to(differs.device).to(torch.float64)
        else:
            w = torch.ones(differs.shape, dtype=torch.float64, device=differs.device)
        self.tokens = self.tokens + w.sum()
        self.differed = self.differed + (differs.to(torch.float64) * w).sum()

    def close(self) -> None:
        for _, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        for h in self._hooks:
            h.remove()
        self._hooks = []


class RouterMonitor:
    """Router statistics of this stage's MoE layers over the micro-batches of a step, on the
    tokens the caller marks real (:meth:`set` before each forward): the entropy of each token's
    softmax over all experts, the tokens each expert received per layer (load) and the routings
    dropped (a capacity factor's; 0 for the dropless router). :meth:`add_to` sums them into a
    ``route_stats`` dict; :func:`router_metrics` turns that into the logged values. Each router
    call reads a few scalars back to the host (a GPU sync per layer: only when ``route_stats`` is
    asked for); with activation recomputation a recomputed forward is counted again, which leaves
    the means and ratios unchanged. The sums stay on the device (no host read per layer);
    :func:`reduce_route_stats` reads them once per step."""

    def __init__(self, model):
        self.routers = stage_routers(model)
        self.k = self.routers[0][1].config.moe_router_topk if self.routers else 0
        self.entropy = 0.0
        self.tokens = 0
        self.dropped = 0
        self.load: dict[int, torch.Tensor] = {}
        self._real = None
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in self.routers]
        self._pre = [r.register_forward_pre_hook(self._keep_input) for _, r in self.routers]
        self._input = None

    def set(self, real: torch.Tensor) -> None:
        self._real = real

    def _keep_input(self, router, args) -> None:
        self._input = args[0]

    def _hook(self, i: int):
        @torch.no_grad()
        def hook(router, args, output):
            logits = router.gating(self._input).reshape(-1, router.config.num_moe_experts).float()
            routing_map = output[1].reshape(logits.shape[0], -1)
            real = self._real.to(logits.device) if self._real is not None else torch.ones(
                logits.shape[0], dtype=torch.bool, device=logits.device)
            w = real.to(torch.float64)
            logp = torch.log_softmax(logits, -1)
            self.entropy = self.entropy + (-(logp.exp() * logp).sum(-1).double() * w).sum()
            self.tokens = self.tokens + w.sum()
            load = (routing_map.to(torch.float64) * w[:, None]).sum(0)
            self.dropped = self.dropped + w.sum() * self.k - load.sum()
            self.load[i] = self.load[i] + load if i in self.load else load
        return hook

    def add_to(self, stats: dict) -> None:
        stats["router_entropy_sum"] = stats.get("router_entropy_sum", 0.0) + self.entropy
        stats["router_tokens"] = stats.get("router_tokens", 0) + self.tokens
        stats["dropped"] = stats.get("dropped", 0) + self.dropped
        load = stats.setdefault("expert_load", {})
        for i, v in self.load.items():
            load[i] = load[i] + v if i in load else v

    def close(self) -> None:
        for h in self._hooks + self._pre:
            h.remove()
        self._hooks, self._pre = [], []
