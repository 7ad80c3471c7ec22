"""Mixture-of-experts layers of the Megatron back end (Qwen3-MoE; ``families``): the
megatron-core config that computes what Hugging Face computes, and the expert weights between
the two layouts. Pure tensor code and config; megatron-core's own ``MoELayer`` does the work.

**Hugging Face layouts.** A checkpoint on disk (what ``from_pretrained``, vLLM and every
Qwen3-MoE release read) holds one tensor per expert::

    model.layers.{i}.mlp.gate.weight                    [E, H]   the router
    model.layers.{i}.mlp.experts.{j}.gate_proj.weight   [I, H]
    model.layers.{i}.mlp.experts.{j}.up_proj.weight     [I, H]
    model.layers.{i}.mlp.experts.{j}.down_proj.weight   [H, I]

transformers 5.15's ``Qwen3MoeExperts`` keeps them fused in memory (its
``conversion_mapping``, ``qwen2_moe`` entry: ``MergeModulelist`` + ``Concatenate``)::

    model.layers.{i}.mlp.experts.gate_up_proj           [E, 2I, H]  expert j: [gate_j; up_j]
    model.layers.{i}.mlp.experts.down_proj              [E, H, I]

:func:`to_checkpoint_names` / :func:`to_fused_names` move between the two; the converter
speaks the checkpoint's names (:func:`hf_layer_to_megatron` accepts either).

**Megatron layout** (local spec, ``SequentialMLP``; EP rank ``e`` of ``ep`` holds experts
``e * E/ep ... (e+1) * E/ep - 1`` as local ``0 ... E/ep - 1``; expert tensor parallelism is TP)::

    decoder.layers.{l}.mlp.router.weight                              [E, H] replicated
    decoder.layers.{l}.mlp.experts.local_experts.{j}.linear_fc1.weight [2I/tp, H]  [gate_r; up_r]
    decoder.layers.{l}.mlp.experts.local_experts.{j}.linear_fc2.weight [H, I/tp]

The TE spec's ``TEGroupedMLP`` (one grouped GEMM per projection) holds the same tensors as the
GEMMs of two TE ``GroupedLinear`` modules, ``mlp.experts.linear_fc1.weight{j}`` and
``linear_fc2.weight{j}`` (:func:`to_grouped_gemm_names` / :func:`to_sequential_names`; the
converters speak SequentialMLP's names).

**Token dispatch** is a collective over the expert-parallel group in every MoE layer of every
forward: the ranks of a group must run the same number of micro-batches (the actor must even
them out before it trains a MoE model), and the ``allgather`` dispatcher also needs the same
token count per micro-batch on each (fixed-shape padded rows; packed THD micro-batches vary).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Mapping

import torch

from .families import check_moe_layout, moe_of  # noqa: F401  (check_moe_layout: importable from here as before)


# experts: megatron-core's SequentialMLP (the local spec) keys each expert's module
# (local_experts.{j}.linear_fc1.weight); its TEGroupedMLP (the TE spec: one grouped GEMM per
# projection) keys each GEMM's weight of one TE GroupedLinear (linear_fc1.weight{j})
_PER_EXPERT = re.compile(r"^(.*mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_PER_GEMM = re.compile(r"^(.*mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def to_grouped_gemm_names(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SequentialMLP's expert names -> TEGroupedMLP's (the rest unchanged)."""
    return {(_PER_EXPERT.sub(r"\1\3.weight\2", k)): v for k, v in sd.items()}


def to_sequential_names(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TEGroupedMLP's expert names -> SequentialMLP's (the rest unchanged)."""
    return {(_PER_GEMM.sub(r"\1local_experts.\3.\2.weight", k)): v for k, v in sd.items()}


# megatron-core router settings that are safe for RL, and where each default comes from
# (docs/megatron.md, "Mixture of experts")
ROUTER_DEFAULTS = {
    # slime's Qwen3-30B-A3B recipe (--moe-aux-loss-coeff 0); NeMo-RL reports that the sequence aux loss makes
    # log-prob errors diverge under GRPO (as issue 41 cites it)
    "moe_aux_loss_coeff": 0.0,
    "moe_router_dtype": "fp32",  # the router's softmax and top-k in fp32 (the same recipe: --moe-router-dtype fp32)
    "moe_router_enable_expert_bias": False,  # no aux-loss-free bias update: routing only moves with the weights
    "moe_token_dispatcher_type": "alltoall",
}
DISPATCHERS = ("alltoall", "allgather")


def moe_config_kwargs(hf_config, *, ep: int = 1, dispatcher: str = "alltoall", aux_loss_coeff: float = 0.0,
                      tp: int = 1, sequence_parallel: bool = False, **router) -> dict:
    """megatron-core ``TransformerConfig`` keywords for the config's MoE layers ({} when dense).
    MoE at ``tp`` > 1 needs ``sequence_parallel``: without it every TP rank holds every token,
    the dispatcher gathers them from each TP rank, and each expert's gradient counts every token
    TP times (megatron-core refuses it in training, ``MoELayer.forward``); sequence parallelism
    needs Transformer Engine's spec."""
    moe = moe_of(hf_config)
    if moe is None:
        return {}
    if tp > 1 and not sequence_parallel:
        raise ValueError(f"a mixture of experts at tensor_parallel {tp} needs sequence parallelism (every TP rank "
                         f"would hold every token and each expert's gradient count it {tp} times; megatron-core "
                         f"refuses it in training): set sequence_parallel with layer_spec: te, or use expert "
                         f"parallelism with tensor_parallel 1")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"MoE token dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if aux_loss_coeff < 0:
        raise ValueError(f"moe aux_loss_coeff must be >= 0, got {aux_loss_coeff}")
    kw = {**ROUTER_DEFAULTS, **router}
    kw.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.ffn,
              # Hugging Face: softmax over all experts, then the top k, renormalised when norm_topk_prob --
              # megatron-core's top-k of the logits, then a softmax over them; else softmax first
              moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
              moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=float(aux_loss_coeff),
              # dropless: no capacity factor, every token reaches its k experts
              moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
              moe_grouped_gemm=False, moe_permute_fusion=False, expert_model_parallel_size=ep)
    return kw


@contextmanager
def scaled_aux_loss(config, normaliser: float | None, *, training: bool):
    """The load-balancing loss's weight during one training pass of ``schedule.forward_backward``.

    megatron-core under ``calculate_per_token_loss`` (as hapo runs it) multiplies each
    micro-batch's load-balancing loss by the micro-batch's real routed tokens and leaves the
    division by the step's token count to ``finalize_model_grads``; hapo's losses arrive already
    divided, and nothing divides again. So for the pass the coefficient is divided by
    ``normaliser`` -- the step's real tokens over every data-parallel rank, over DP, as hapo's
    losses divide -- and restored afterwards. The step's load-balancing term is then ``coeff`` x
    the token-weighted mean over its micro-batches of megatron-core's own per-micro-batch loss,
    summed over layers: what megatron-core's training adds when every token is in the loss.
    megatron-core 0.19 weights each micro-batch's loss by TP x CP times more tokens under
    sequence parallelism than 0.16 (``compat.aux_loss_token_factor``): that factor is divided out
    too. Forward-only passes (old log-probs, the reference) add none."""
    coeff = getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0
    if not (training and getattr(config, "num_moe_experts", None) and coeff):
        yield
        return
    if not isinstance(coeff, (int, float)):
        raise ValueError(f"moe_aux_loss_coeff {coeff!r}: one load-balancing loss (a number) is supported")
    if normaliser is None or not normaliser > 0:
        raise ValueError(f"a load-balancing loss (moe_aux_loss_coeff {coeff}) needs forward_backward's "
                         f"aux_loss_normaliser > 0 (the step's real tokens over DP), got {normaliser!r}")
    from .compat import aux_loss_token_factor

    factor = 1.0
    if aux_loss_token_factor() == "tp_cp":  # megatron-core 0.19: x TP x CP more tokens per micro-batch
        from megatron.core import parallel_state as ps

        factor = float(ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size())
    config.moe_aux_loss_coeff = coeff / (float(normaliser) * factor)
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coeff


def _prefix(i: int) -> str:
    return f"model.layers.{i}.mlp."


def to_checkpoint_names(sd: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """transformers 5.15's in-memory state dict (fused experts) -> the checkpoint's per-expert names."""
    moe = moe_of(hf_config)
    out = dict(sd)
    if moe is None:
        return out
    for i in range(hf_config.num_hidden_layers):
        p = _prefix(i) + "experts."
        if p + "gate_up_proj" not in out:
            continue
        gate_up, down = out.pop(p + "gate_up_proj"), out.pop(p + "down_proj")
        for j in range(moe.num_experts):
            gate, up = gate_up[j].chunk(2, 0)
            out[f"{p}{j}.gate_proj.weight"], out[f"{p}{j}.up_proj.weight"] = gate, up
            out[f"{p}{j}.down_proj.weight"] = down[j]
    return out


def to_fused_names(sd: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert names -> transformers 5.15's fused in-memory names."""
    moe = moe_of(hf_config)
    out = dict(sd)
    if moe is None:
        return out
    for i in range(hf_config.num_hidden_layers):
        p = _prefix(i) + "experts."
        if f"{p}0.gate_proj.weight" not in out:
            continue
        gate = [out.pop(f"{p}{j}.gate_proj.weight") for j in range(moe.num_experts)]
        up = [out.pop(f"{p}{j}.up_proj.weight") for j in range(moe.num_experts)]
        out[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[p + "down_proj"] = torch.stack([out.pop(f"{p}{j}.down_proj.weight") for j in range(moe.num_experts)])
    return out


def _expert(hf: Mapping[str, torch.Tensor], i: int, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) of global expert ``j`` of layer ``i``, from either Hugging Face layout."""
    p = _prefix(i) + "experts."
    if f"{p}{j}.gate_proj.weight" in hf:
        return hf[f"{p}{j}.gate_proj.weight"], hf[f"{p}{j}.up_proj.weight"], hf[f"{p}{j}.down_proj.weight"]
    gate, up = hf[p + "gate_up_proj"][j].chunk(2, 0)
    return gate, up, hf[p + "down_proj"][j]


def hf_layer_to_megatron(hf: Mapping[str, torch.Tensor], i: int, hf_config, *, tp: int, tp_rank: int, ep: int,
                         ep_rank: int) -> dict[str, torch.Tensor]:
    """The MoE MLP of global layer ``i`` for one (TP rank, EP rank), without the
    ``decoder.layers.{l}.`` prefix."""
    moe = moe_of(hf_config)
    per = moe.num_experts // ep
    out = {"mlp.router.weight": hf[_prefix(i) + "gate.weight"].clone()}
    for j in range(per):
        gate, up, down = _expert(hf, i, ep_rank * per + j)
        m = f"mlp.experts.local_experts.{j}."
        out[m + "linear_fc1.weight"] = torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]])
        out[m + "linear_fc2.weight"] = down.chunk(tp, 1)[tp_rank].clone()
    return out


def _experts_to_hf(i: int, e: int, per: int, by_tp: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors of EP rank ``e``'s experts in global layer ``i``, from its
    Megatron expert tensors per TP rank (prefix-free names)."""
    p, out = _prefix(i), {}
    for j in range(per):
        m = f"mlp.experts.local_experts.{j}."
        fc1 = [t[m + "linear_fc1.weight"].chunk(2, 0) for t in by_tp]
        g = e * per + j
        out[f"{p}experts.{g}.gate_proj.weight"] = torch.cat([a for a, _ in fc1])
        out[f"{p}experts.{g}.up_proj.weight"] = torch.cat([b for _, b in fc1])
        out[f"{p}experts.{g}.down_proj.weight"] = torch.cat([t[m + "linear_fc2.weight"] for t in by_tp], 1)
    return out


def megatron_layer_to_hf(parts: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], i: int,
                         hf_config) -> dict[str, torch.Tensor]:
    """The checkpoint-named Hugging Face experts of global layer ``i`` from its Megatron
    tensors per (EP rank, TP rank) (prefix-free names, as :func:`hf_layer_to_megatron` writes);
    the router is the dense part's (``convert._layer_to_hf``)."""
    moe = moe_of(hf_config)
    ep = 1 + max(e for e, _ in parts)
    tp = 1 + max(r for _, r in parts)
    out = {}
    for e in range(ep):
        out.update(_experts_to_hf(i, e, moe.num_experts // ep, [parts[(e, r)] for r in range(tp)]))
    return out


def _expert_names(i: int, e: int, per: int) -> list[str]:
    p = _prefix(i) + "experts."
    return [f"{p}{g}.{w}_proj.weight" for g in range(e * per, (e + 1) * per) for w in ("gate", "up", "down")]


class ExpertStream:
    """The experts' part of ``convert.stream_hf_tensors`` (the vLLM weight sync, the final save)
    for a mixture-of-experts model: each layer's experts go to ``dst`` from the ranks that hold
    them -- expert-tensor-parallel rank 0 of each (pipeline stage, expert-parallel rank) in
    ``dst``'s expert-data-parallel replica, which all-gathers its expert-TP shards first -- one
    tensor at a time by point-to-point sends, in the checkpoint's order (:func:`hf_layer_shapes`).
    Built collectively (every rank's place in the layout is all-gathered once)."""

    def __init__(self, model, hf_config, dst: int):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.cfg, self.dst, self.rank = hf_config, dst, dist.get_rank()
        self.ep = ps.get_expert_model_parallel_world_size()
        self.per = moe_of(hf_config).num_experts // self.ep
        me = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
              ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
        table = [None] * dist.get_world_size()
        dist.all_gather_object(table, me)
        self.stage, self.ep_rank, self.etp_rank, edp = me
        self.takes_part = edp == table[dst][3]
        # (stage, EP rank) -> the global rank that sends those experts
        self.owner = {(s, e): r for r, (s, e, t, d) in enumerate(table) if t == 0 and d == table[dst][3]}
        self.etp, self.etp_group = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()

        self.sd = {k: v for k, v in to_sequential_names(model.state_dict(keep_vars=True)).items()
                   if ".local_experts." in k and not k.endswith("_extra_state")}
        self.ref = next(model.parameters())

    def _local(self, i: int, local: int) -> dict[str, torch.Tensor]:
        """This rank's experts of global layer ``i`` (``local`` on this stage), on expert-TP rank 0
        (a collective over the expert-TP group)."""
        import torch.distributed as dist

        m = f"decoder.layers.{local}."
        by_tp = [dict() for _ in range(self.etp)]
        for k, v in self.sd.items():
            if not k.startswith(m):
                continue
            t = v.detach().contiguous()
            parts = [t]
            if self.etp > 1:
                parts = [torch.empty_like(t) for _ in range(self.etp)]
                dist.all_gather(parts, t, group=self.etp_group)
            for r, x in enumerate(parts):
                by_tp[r][k[len(m):]] = x
        return _experts_to_hf(i, self.ep_rank, self.per, by_tp) if self.etp_rank == 0 else {}

    def emit(self, s: int, i: int, local: int, fn) -> int:
        """Layer ``i``'s experts (stage ``s``; ``local`` its index there) to ``dst``'s ``fn``;
        how many tensors ``dst`` received (0 elsewhere)."""
        import torch.distributed as dist

        items = self._local(i, local) if self.takes_part and self.stage == s else {}
        if self.rank == self.dst:
            shapes, n_got = hf_layer_shapes(i, self.cfg), 0
            for e in range(self.ep):
                src = self.owner[(s, e)]
                for n in _expert_names(i, e, self.per):
                    if src == self.rank:
                        t = items[n]
                    else:
                        t = torch.empty(shapes[n], dtype=self.ref.dtype, device=self.ref.device)
                        dist.recv(t, src=src)
                    fn(n, t)
                    n_got += 1
            return n_got
        if items:
            for n in _expert_names(i, self.ep_rank, self.per):
                dist.send(items[n].contiguous(), dst=self.dst)
        return 0


def hf_layer_shapes(i: int, hf_config) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of layer ``i``'s MoE tensors."""
    moe = moe_of(hf_config)
    H, p = hf_config.hidden_size, _prefix(i)
    out = {p + "gate.weight": (moe.num_experts, H)}
    for j in range(moe.num_experts):
        out.update({f"{p}experts.{j}.gate_proj.weight": (moe.ffn, H), f"{p}experts.{j}.up_proj.weight": (moe.ffn, H),
                    f"{p}experts.{j}.down_proj.weight": (H, moe.ffn)})
    return out


# ------------------------------------------------------------------ rollout routing replay (R3)
def stage_routers(model) -> list[tuple[int, object]]:
    """(global layer index, megatron-core ``TopKRouter``) of every MoE layer of this stage, in
    layer order."""
    out = []
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((int(layer.layer_number) - 1, router))
    return out


def recorded_routes(routes: torch.Tensor, shape: tuple[int, int], starts, lengths) -> torch.Tensor:
    """A micro-batch's recorded expert choices [B, S, layers, k] (``shape`` = [B, S]; not recorded: -1,
    or 255 in a uint8 tensor) on the host, checked and completed: only a row's last real token may
    lack a record (no forward of the engine ever took it as input; its output feeds no log-prob) --
    it gets experts 0 ... k-1, as do padding tokens; a gap anywhere else is refused. Returns
    [B, S, layers + 1, k]: the routes, then a row of each token's recorded flag (what a layout
    flattens alongside)."""
    B, S = shape
    if routes.dim() != 4 or tuple(routes.shape[:2]) != (B, S):
        raise ValueError(f"routed experts must be [B, S, layers, top_k] with [B, S] = {[B, S]}, got "
                         f"{list(routes.shape)}")
    routes, starts, lengths = routes.cpu(), torch.as_tensor(starts).cpu(), torch.as_tensor(lengths).cpu()
    missing = routes == 255 if routes.dtype == torch.uint8 else routes < 0
    k = routes.shape[-1]
    fill = torch.arange(k, dtype=routes.dtype)
    ar = torch.arange(S)
    real = (ar[None] >= starts[:, None]) & (ar[None] < (starts + lengths)[:, None])
    last = ar[None] == (starts + lengths - 1)[:, None]
    unknown = missing.any(-1).any(-1)
    gap = unknown & real & ~last
    if bool(gap.any()):
        rows = gap.any(-1).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows[:8]} have real tokens without recorded routes (only a row's last token "
                         f"may lack them): the rollout's routed experts do not cover its tokens")
    known = ~unknown & real  # [B, S]
    routes = torch.where(known[:, :, None, None], routes, fill)
    return torch.cat([routes, known[:, :, None, None].to(routes.dtype).expand(B, S, 1, k)], 2)


def reduce_route_stats(stats: dict | None, hf_config, group=None) -> dict[str, float]:
    """:func:`router_metrics` of ``forward_backward``'s ``route_stats`` summed over ``group``
    (default: every rank -- data-parallel ranks route different tokens, pipeline stages
    different layers): one all-reduce and one host read. Collective; ``stats`` may be empty
    on a rank that routed nothing. The same keys on every rank."""
    import torch.distributed as dist

    moe = moe_of(hf_config)
    L, E = int(hf_config.num_hidden_layers), moe.num_experts
    stats = stats or {}
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    vec = torch.zeros(5 + L * E, dtype=torch.float64, device=dev)
    for j, k in enumerate(("router_entropy_sum", "router_tokens", "dropped", "tokens", "differed")):
        vec[j] = torch.as_tensor(stats.get(k, 0.0), dtype=torch.float64).to(dev)
    for i, v in stats.get("expert_load", {}).items():
        vec[5 + i * E:5 + (i + 1) * E] = v.to(dev, torch.float64)
    if dist.is_initialized():
        dist.all_reduce(vec, group=group)
    vec = vec.cpu()
    total = dict(zip(("router_entropy_sum", "router_tokens", "dropped", "tokens", "differed"), vec[:5].tolist()))
    total["expert_load"] = {i: vec[5 + i * E:5 + (i + 1) * E] for i in range(L)}
    return router_metrics(total)


def router_metrics(stats: dict) -> dict[str, float]:
    """The logged router values from ``forward_backward``'s ``route_stats`` (summed over ranks by
    the caller where tokens were split): ``moe/router_entropy`` (mean over tokens and layers, nats),
    ``moe/expert_load_max_over_mean`` (the busiest expert's tokens over the mean, the worst layer;
    1 is balanced), ``moe/dropped_routings``, and with replay ``moe/replay_differed_fraction``
    (the recorded routings the router would have chosen otherwise)."""
    out = {}
    if float(stats.get("router_tokens", 0)):
        out["moe/router_entropy"] = float(stats["router_entropy_sum"]) / float(stats["router_tokens"])
        ratios = [float(v.max() / v.mean()) for v in stats["expert_load"].values() if float(v.sum()) > 0]
        if ratios:
            out["moe/expert_load_max_over_mean"] = max(ratios)
        out["moe/dropped_routings"] = float(stats["dropped"])
    if float(stats.get("tokens", 0)):
        out["moe/replay_differed_fraction"] = float(stats["differed"]) / float(stats["tokens"])
    return out
