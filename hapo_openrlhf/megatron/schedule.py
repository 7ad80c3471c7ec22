"""The HAPO/PPO loss through Megatron-core's forward-backward schedule.

Micro-batches run through ``get_forward_backward_func()`` (1F1B across pipeline
stages, plain accumulation without pipelining); the loss is evaluated on the last
stage from the vocabulary-parallel log-probs and entropy. Every micro-batch's loss
is already divided by the **global** normaliser (e.g. the number of valid tokens
of the whole optimizer step for token-mean), and the model config sets
``calculate_per_token_loss=True`` so the schedule does not rescale it: the
accumulated gradient is exactly the gradient of one big batch.

How a micro-batch's rows reach the model (``layout``):

* ``"thd"`` (packed): the rows' real tokens are concatenated into one [1, T]
  sequence with ``PackedSeqParams(qkv_format="thd", cu_seqlens)``; attention is
  varlen (``attention.FlashCoreAttention``), RoPE restarts per sequence, the
  next-token labels are shifted within each sequence. No padding is computed.
* ``"padded"``: each row's tokens are moved to start at position 0 (right padding)
  and the batch runs causal attention without a mask (``FlashCoreAttention``).
* ``"masked"``: Megatron's own ``DotProductAttention`` with an explicit [B, 1, S, S]
  mask (``megatron.attention: local``; kept for comparison and benchmarks).

Whatever the layout, ``loss_fn`` receives log-probs and entropy in the caller's
[B, S-1] layout (position ``p`` predicts token ``p + 1`` of the row as given), zero
where the row has no next real token. Rows must hold their real tokens contiguously
(left and/or right padding, as OpenRLHF's experiences do).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..algos.entropy import DEFAULT_CHUNK
from . import head as heads
from .model import attention_inputs, default_layout
from .moe import recorded_routes
from .taps import AuxLossScale, Head, ReplayRoutes, Tap

# loss_fn(logp [B, S-1], entropy [B, S-1], micro_batch) -> (scalar loss, {metric: float tensor})
LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]
LAYOUTS = ("thd", "padded", "masked")


def _rows_and_offsets(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``counts[b]`` items in row b (``total`` of them, known on the host): each item's
    row and its offset within the row, [total] each, on ``counts``' device. The size is given,
    so nothing waits for the GPU to count."""
    row = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=total)
    off = torch.arange(total, device=counts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                              output_size=total)
    return row, off


@dataclass
class RowLayout(heads.PlacedHeadValues):
    """Where each row's real tokens are in the caller's [B, S] batch and in the model's
    input, and the index maps between the two for the [*, S-1] next-token values."""

    shape: tuple[int, int]
    starts: torch.Tensor  # [B] first real position of each row
    lengths: torch.Tensor  # [B] real tokens per row
    layout: str
    # the model input's token count is padded to a multiple of this (sequence parallelism
    # splits it over TP ranks): THD appends a padding sequence, padded rows grow
    pad_to: int = 1
    max_len: int = 0  # the longest row's real tokens
    total: int = 0  # real tokens in all rows
    # host copies of starts / lengths (from the CPU mask ``of`` reads): what route_input computes with
    starts_host: torch.Tensor | None = None
    lengths_host: torch.Tensor | None = None

    @classmethod
    def of(cls, attention_mask: torch.Tensor, layout: str, pad_to: int = 1,
           device: torch.device | None = None) -> "RowLayout":
        """From a [B, S] attention mask. The checks and the host-side sizes read the mask:
        give it on the CPU (the actor keeps its micro-batches' masks there) and nothing here
        waits for the GPU; ``device`` is where the index tensors go (default: the mask's)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown micro-batch layout {layout!r}; expected one of {LAYOUTS}")
        am = attention_mask.bool()
        B, S = am.shape
        lengths = am.sum(-1)
        pos = torch.arange(S, device=am.device).expand(B, S)
        starts = torch.where(am, pos, S).min(-1).values.clamp(max=S)
        ends = torch.where(am, pos, -1).max(-1).values + 1
        bad = ((ends - starts) != lengths) & (lengths > 0)
        if bool(bad.any()):
            raise ValueError(f"rows {bad.nonzero().flatten().tolist()[:8]} have holes in their attention mask; "
                             f"packing needs each row's tokens contiguous (left/right padding only)")
        if bool((lengths == 0).any()):
            raise ValueError(f"rows {(lengths == 0).nonzero().flatten().tolist()[:8]} have no tokens")
        dev = am.device if device is None else torch.device(device)
        host = am.device.type == "cpu"
        return cls((B, S), starts.to(dev), lengths.to(dev), layout, max(1, int(pad_to)), int(lengths.max()),
                   int(lengths.sum()), starts if host else None, lengths if host else None)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0)).to(torch.int32)

    def _maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(source index into the model's flattened next-token values, destination index
        into the caller's flattened [B, S-1]) for every (row, position) that has a next
        real token."""
        B, S = self.shape
        dev = self.lengths.device
        n = self.lengths - 1  # next-token positions per row
        row, off = _rows_and_offsets(n, self.total - B)
        dst = row * (S - 1) + self.starts[row] + off
        if self.layout == "thd":
            src = self.cu_seqlens.to(dev).long()[row] + off  # the packed [T] values
        else:  # the right-aligned [B, Lp-1] values
            Lp = -(-self.max_len // self.pad_to) * self.pad_to
            src = row * (Lp - 1) + off
        return src, dst

    def model_inputs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """kwargs for ``GPTModel.forward`` (plus ``labels_ids`` [1 or B, *] for the head)."""
        B, S = self.shape
        dev = input_ids.device
        if self.layout == "masked":
            pos, mask = attention_inputs((torch.arange(S, device=dev)[None] >= self.starts[:, None])
                                         & (torch.arange(S, device=dev)[None] < (self.starts + self.lengths)[:, None]))
            return {"input_ids": input_ids, "position_ids": pos, "attention_mask": mask}
        L = self.max_len
        ar = torch.arange(L, device=dev)
        valid = ar[None] < self.lengths[:, None]  # [B, L]
        idx = (self.starts[:, None] + ar[None]).clamp(max=S - 1)
        ids = torch.where(valid, input_ids.gather(1, idx), 0)
        if self.layout == "padded":
            Lp = -(-L // self.pad_to) * self.pad_to
            ids = torch.nn.functional.pad(ids, (0, Lp - L))
            return {"input_ids": ids, "position_ids": torch.arange(Lp, device=dev).expand(B, Lp), "attention_mask": None}
        from megatron.core.packed_seq_params import PackedSeqParams

        # the valid (row, position) pairs in row-major order, as ids[valid] would give them,
        # by a gather of known size (boolean indexing would wait for the GPU to count them)
        row, off = _rows_and_offsets(self.lengths, self.total)
        keep = row * L + off
        flat, pos = ids.view(-1).index_select(0, keep), ar.expand(B, L).reshape(-1).index_select(0, keep)
        cu = self.cu_seqlens.to(dev)
        extra = -self.total % self.pad_to
        if extra:  # a padding sequence of its own: attends only to itself, its outputs are dropped
            flat = torch.cat([flat, flat.new_zeros(extra)])
            pos = torch.cat([pos, torch.arange(extra, device=dev)])
            cu = torch.cat([cu, cu[-1:] + extra])
        Lm = max(L, extra)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=Lm, max_seqlen_kv=Lm)
        return {"input_ids": flat[None], "position_ids": pos[None], "attention_mask": None, "packed_seq_params": packed}

    def real_tokens(self, tp_rank: int = 0, tp: int = 1) -> torch.Tensor:
        """[tokens] bool in the model input's token order (THD packed; padded and masked
        sequence-major): True on the rows' real tokens, False on what the layout adds; a TP
        rank's chunk with sequence parallelism (``tp`` > 1)."""
        B, S = self.shape
        dev = self.lengths.device
        if self.layout == "thd":
            mask = torch.ones(self.total + (-self.total % self.pad_to), dtype=torch.bool, device=dev)
            mask[self.total:] = False
        elif self.layout == "padded":
            Lp = -(-self.max_len // self.pad_to) * self.pad_to
            mask = (torch.arange(Lp, device=dev)[:, None] < self.lengths[None, :]).reshape(-1)
        else:
            ar = torch.arange(S, device=dev)
            mask = ((ar[:, None] >= self.starts[None, :]) & (ar[:, None] < (self.starts + self.lengths)[None, :]))
            mask = mask.reshape(-1)
        return mask.chunk(tp, 0)[tp_rank] if tp > 1 else mask

    def padding_mask(self, tp_rank: int = 0, tp: int = 1) -> torch.Tensor:
        """GPTModel's ``padding_mask`` for a mixture-of-experts model: the model input's shape
        ([1, T] packed, [B, S] padded and masked), True where the layout added a token. Its
        routers then leave those tokens out of the load-balancing loss and its token counts.
        With sequence parallelism megatron-core scatters the mask over TP itself, but only on the
        first pipeline stage (``GPTModel._preprocess``): a later stage passes ``tp`` > 1 and gets
        this TP rank's sequence chunk ([1, T / TP] or [B, S / TP]), the tokens its routers see."""
        real = self.real_tokens()
        mask = ~real[None] if self.layout == "thd" else ~real.view(-1, self.shape[0]).T.contiguous()
        if tp > 1:  # megatron-core's scatter_to_sequence_parallel_region on the sequence dimension
            mask = mask.T.chunk(tp, 0)[tp_rank].T.contiguous()
        return mask

    def route_input(self, routes: torch.Tensor, tp_rank: int = 0, tp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Recorded expert choices [B, S, layers, k] (not recorded: -1, or 255 in a uint8 tensor) ->
        [tokens, layers, k] in the order the model's routers see this micro-batch's tokens (THD: the
        packed tokens; padded and masked: sequence-major), this TP rank's share with sequence
        parallelism (``tp`` > 1). Only a row's last real token may lack a record (no forward of the
        engine ever took it as input; its output feeds no log-prob): it gets experts 0 ... k-1, as
        do padding tokens; a gap anywhere else is refused. Returns (routes in their own dtype,
        recorded [tokens] bool) on the layout's device.

        Everything is computed on the host, where the actor keeps the routes (and ``of`` keeps the
        rows' sizes): the checks wait for no GPU, and only this TP rank's routes of this
        micro-batch are moved."""
        B, S = self.shape
        dev = self.lengths.device
        starts = (self.starts_host if self.starts_host is not None else self.starts).cpu()
        lengths = (self.lengths_host if self.lengths_host is not None else self.lengths).cpu()
        # [B, S, layers + 1, k]: the recorded flag rides along
        routes = recorded_routes(routes, (B, S), starts, lengths)
        fill = torch.arange(routes.shape[-1], dtype=routes.dtype)
        if self.layout == "masked":
            flat = routes.transpose(0, 1).reshape(S * B, *routes.shape[2:])
        else:
            L = self.max_len
            idx = (starts[:, None] + torch.arange(L)[None]).clamp(max=S - 1)
            per_row = routes.gather(1, idx[:, :, None, None].expand(B, L, *routes.shape[2:]))  # [B, L, layers, k]
            if self.layout == "padded":
                Lp = -(-L // self.pad_to) * self.pad_to
                pad = fill.expand(B, Lp - L, *routes.shape[2:]).clone()
                pad[:, :, -1] = 0  # not recorded
                per_row = torch.cat([per_row, pad], 1)
                # positions past a row's end were gathered from its last real position: not recorded there
                per_row[:, :, -1] *= (torch.arange(Lp)[None] < lengths[:, None]).to(routes.dtype)[:, :, None]
                flat = per_row.transpose(0, 1).reshape(Lp * B, *routes.shape[2:])
            else:
                row, off = _rows_and_offsets(lengths, self.total)
                flat = per_row.reshape(B * L, *routes.shape[2:]).index_select(0, row * L + off)
                extra = -self.total % self.pad_to
                if extra:
                    pad = fill.expand(extra, *routes.shape[2:]).clone()
                    pad[:, -1] = 0
                    flat = torch.cat([flat, pad])
        flat = flat.chunk(tp, 0)[tp_rank] if tp > 1 else flat
        return flat[:, :-1].to(dev, non_blocking=True), flat[:, -1, 0].bool().to(dev, non_blocking=True)

    # the head's values (head.PlacedHeadValues): the last stage's output (this rank's logits shard, or
    # the hidden states for the fused head) at every position but the last, each predicting the next
    # input token -- thd: [1, T, *], value t predicts packed token t + 1 (unused across a sequence
    # boundary); padded: [B, L, *]; masked: the caller's own rows
    def _scored(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, :-1]

    def _labels(self, model_ids: torch.Tensor) -> torch.Tensor:
        return model_ids[:, 1:]

    def _place(self, v: torch.Tensor) -> torch.Tensor:
        """The model's next-token values -> the caller's [B, S-1] (zeros where a row has no
        next real token)."""
        if self.layout == "masked":
            return v
        B, S = self.shape
        src, dst = self._maps()
        src, dst = src.to(v.device), dst.to(v.device)
        out = v.new_zeros(B * (S - 1))
        return out.index_copy(0, dst, v.reshape(-1).index_select(0, src)).view(B, S - 1)


def ids_within_vocabulary(mb: dict, vocab_size: int) -> bool:
    """Whether the micro-batch's token ids were checked against the vocabulary here, on the
    CPU copy the caller keeps (``input_ids_cpu``; the Megatron actor does), so the head need
    not check them on the device (a host sync). False: the head checks (and names a bad id)."""
    ids = mb.get("input_ids_cpu")
    return ids is not None and (not ids.numel() or int(ids.max()) < vocab_size)


def logprobs_and_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, vocab_size: int,
                         temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK, tp_group=None,
                         tp_rank: int = 0, layout: str | None = None,
                         pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropy [B, S-1] (fp32) of a single-stage GPTModel (or
    the last stage with ``pp == 1``), from vocabulary shards: the full vocabulary is
    never gathered, and with the fused head (``head.install``) no logits shard exists
    either. ``layout``: :class:`RowLayout` (default: the model's,
    :func:`~.model.default_layout`); ``pad_to``: pad the model input's token count to a
    multiple of this (default: TP with sequence parallelism, which splits the tokens over
    the TP ranks; else 1). ``tp_group`` / ``tp_rank``: default Megatron's tensor-parallel group. With
    context parallelism in the parallel state each CP rank forwards its share and every rank gets
    the whole batch's values (:class:`~.context_parallel.CPRows`)."""
    if pad_to is None:
        cfg = model.config
        pad_to = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    from megatron.core import parallel_state as ps

    if tp_group is None:  # the model's own TP group (None would reduce the vocabulary over the whole job)
        tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    if ps.get_context_parallel_world_size() > 1:  # this rank's share, the values gathered (context_parallel.py)
        lay = cp_layouts([{"input_ids": input_ids, "attention_mask": attention_mask}], layout or "thd",
                         model.config)[0]
        out = model(**lay.model_inputs())
        weight = heads.output_weight(model) if heads.is_installed(model) else None
        return lay.logprobs_entropy(out, vocab_size=vocab_size, temperature=temperature, chunk_size=chunk_size,
                                    tp_group=tp_group, tp_rank=tp_rank, weight=weight)
    lay = RowLayout.of(attention_mask, layout or default_layout(model), pad_to)
    inputs = lay.model_inputs(input_ids)
    out = model(**inputs)  # [B or 1, S or T, V / tp], or the hidden states [.., H] for the fused head
    weight = heads.output_weight(model) if heads.is_installed(model) else None
    return lay.logprobs_entropy(out, inputs["input_ids"], vocab_size=vocab_size, temperature=temperature,
                                chunk_size=chunk_size, tp_group=tp_group, tp_rank=tp_rank, weight=weight)


def cp_layouts(micro_batches: list[dict], layout: str, config) -> list:
    """Under context parallelism: each micro-batch's :class:`~.context_parallel.CPRows` (THD, PP 1; the
    rest refused by name). Every tap runs on it: the head's token-local values, and for a mixture of
    experts the routers' statistics and routing replay over each rank's share."""
    from megatron.core import parallel_state as ps

    from .context_parallel import CPRows

    if layout != "thd":
        raise ValueError(f"context parallelism splits packed (THD) sequences only, got layout {layout!r}")
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the config refuses PP x CP (megatron-core's rank order)
        raise ValueError("context parallelism through pipeline stages is not supported (the actor's rank order "
                         "cannot start it in megatron-core; untested): run it with pipeline parallelism 1")
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_group()
    out = []
    for mb in micro_batches:
        lay = RowLayout.of(mb.get("attention_mask_cpu", mb["attention_mask"]).cpu(), "thd")  # its checks
        out.append(CPRows(lay.starts_host.tolist(), lay.lengths_host.tolist(), mb["input_ids"], group, tp=tp,
                          sequence_parallel=config.sequence_parallel))
    return out


def forward_backward(model, micro_batches: list[dict[str, torch.Tensor]], loss_fn: LossFn | None, *,
                     vocab_size: int, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                     forward_only: bool = False, layout: str | None = None, taps: Sequence[Tap] = ()) -> list[Any]:
    """Run ``micro_batches`` (dicts with ``input_ids`` and ``attention_mask`` [B, S], plus
    whatever ``loss_fn`` reads) through the schedule on every rank of the model-parallel
    group. Returns, on the last pipeline stage, one entry per micro-batch: the metrics
    dict (with ``loss``), or with ``loss_fn=None`` the ``(logp, entropy)`` pair (the
    old-log-prob pass), to which taps may add (``taps.NucleusLogMass``); other stages get an
    empty list. Gradients accumulate into the parameters (with Megatron's DDP wrapper,
    ``ddp.wrap``: into its fp32 buffers) unless ``forward_only``.

    ``taps`` (``megatron/taps.py``): what else a pass does around its micro-batches -- the head's
    extra values, rollout routing replay, router statistics, the load-balancing loss's weight.

    ``layout`` (module docstring; default :func:`~.model.default_layout`): ``thd`` and
    ``padded`` need the model built with ``attention="flash"``; ``masked`` with Megatron's
    local attention. With pipeline
    parallelism and ``masked`` every micro-batch must have one shape; ``thd`` and
    ``padded`` need ``variable_seq_lengths`` in the model config (``build_gpt_model``
    sets it for PP > 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward: no micro-batches")
    config = model.config
    pp = ps.get_pipeline_model_parallel_world_size()
    layout = layout or default_layout(model)
    # sequence parallelism splits the tokens over TP ranks: pad the token count to a multiple of TP
    pad_to = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    # from the CPU copy of each mask when the caller keeps one (the actor does): no host sync
    if ps.get_context_parallel_world_size() > 1:  # each CP rank forwards its share (context_parallel.py)
        layouts = cp_layouts(micro_batches, layout, config)
    else:
        layouts = [RowLayout.of(mb.get("attention_mask_cpu", mb["attention_mask"]), layout, pad_to,
                                device=mb["input_ids"].device) for mb in micro_batches]
    if layout == "masked" or (pp > 1 and not config.variable_seq_lengths):
        shape = micro_batches[0]["input_ids"].shape
        bad = [i for i, mb in enumerate(micro_batches) if mb["input_ids"].shape != shape]
        if pp > 1 and bad:
            raise ValueError(f"micro-batches {bad} differ in shape from {tuple(shape)}: pipeline stages exchange "
                             f"fixed [S, B, H] activations, pad every micro-batch to one shape")
    if not config.calculate_per_token_loss:
        raise ValueError("the model config needs calculate_per_token_loss=True (hapo divides by the global "
                         "normaliser itself; Megatron would otherwise divide again)")
    if any("routed_experts" in mb for mb in micro_batches) and not any(isinstance(t, ReplayRoutes) for t in taps):
        raise ValueError("micro-batches carry routed_experts but no taps.ReplayRoutes is given: the routes would "
                         "not be replayed")
    training = not (forward_only or loss_fn is None)
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    checked = [ids_within_vocabulary(mb, vocab_size) for mb in micro_batches]
    it = iter(zip(micro_batches, layouts, checked))
    sp_tp = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    moe = bool(getattr(config, "num_moe_experts", None))
    # a load-balancing loss is refused by name without its scale (taps.AuxLossScale)
    taps = list(taps) if any(isinstance(t, AuxLossScale) for t in taps) else [*taps, AuxLossScale(None)]

    def forward_step(data_iterator: Iterable, model):
        mb, lay, ids_checked = next(data_iterator)
        inputs = lay.model_inputs(mb["input_ids"])
        if moe:  # the layout's own tokens stay out of the routers' load-balancing loss and counts
            later = not _unwrap(model).pre_process  # megatron-core scatters the mask on the first stage only
            inputs["padding_mask"] = lay.padding_mask(tp_rank=tp_rank, tp=sp_tp) if later else lay.padding_mask()
        for tap in taps:
            tap.before_forward(mb, lay, tp_rank, sp_tp)
        output = model(**inputs)

        def loss_func(logits: torch.Tensor, non_loss_data: bool = False):
            # with the fused head the last stage's "logits" are its final hidden states
            weight = heads.output_weight(model) if heads.is_installed(model) else None
            lp, en = lay.logprobs_entropy(logits, inputs["input_ids"], vocab_size=vocab_size, temperature=temperature,
                                          chunk_size=chunk_size, tp_group=tp_group, tp_rank=tp_rank, weight=weight,
                                          labels_checked=ids_checked)
            head = Head(vocab_size, temperature, chunk_size, tp_group, tp_rank, weight)
            batch, vals = mb, (lp.detach(), en.detach()) if loss_fn is None else ()
            for tap in taps:
                batch, vals = tap.on_head(logits, lay, head, batch, vals, loss_fn is not None)
            if loss_fn is None:  # forward only: hand the values back
                return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), vals
            loss, metrics = loss_fn(lp, en, batch)
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach(), **metrics}

        return output, loss_func

    # the fixed-shape schedule's tensor shape (ignored with variable_seq_lengths)
    if layout == "thd":
        seq_length, mbs = max(getattr(l, "total", 1) for l in layouts), 1  # no PP under CP: not read
        seq_length = -(-seq_length // pad_to) * pad_to
    elif layout == "padded":
        seq_length, mbs = max(-(-l.max_len // pad_to) * pad_to for l in layouts), micro_batches[0]["input_ids"].shape[0]
    else:
        seq_length, mbs = micro_batches[0]["input_ids"].shape[1], micro_batches[0]["input_ids"].shape[0]
    fb = get_forward_backward_func()
    inner = _unwrap(model)
    with contextlib.ExitStack() as stack:
        for tap in taps:  # closed in reverse order, on error too
            stack.callback(tap.close)
            tap.start(inner, micro_batches, training)
        for tap in taps:
            stack.enter_context(tap.context(inner.config, training))
        return fb(forward_step_func=forward_step, data_iterator=it, model=model,
                  num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=mbs,
                  forward_only=forward_only or loss_fn is None)


def _unwrap(model):
    """The GPTModel inside Megatron's DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def token_budget_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of rows grouped into micro-batches of at most ``max_tokens`` real tokens
    each (first fit over the rows sorted longest first, OpenRLHF's
    ``get_minimum_num_micro_batch_size`` rule; a row longer than the budget gets a
    micro-batch of its own). Every index appears exactly once; within a micro-batch the
    rows keep their original order."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        for b in range(len(bins)):
            if n <= room[b]:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return [sorted(b) for b in bins]


def even_out(groups: list[list[int]], lengths: list[int], n: int) -> list[list[int]]:
    """``groups`` (row indices per micro-batch) split into exactly ``n`` micro-batches: while
    there are fewer, the micro-batch with the most tokens (of those with two rows or more) is
    cut in two, its rows in order, where the token counts are closest to halves. Only smaller
    micro-batches result (a token budget still holds) and every row stays exactly once: what
    lets every rank of an expert-parallel group run the same number of micro-batches through
    the dispatcher's collectives. Refused by name when the rows cannot make ``n``."""
    out = [list(g) for g in groups]
    if len(out) > n:
        raise ValueError(f"even_out: {len(out)} micro-batches are more than the {n} asked for")
    while len(out) < n:
        cands = [i for i, g in enumerate(out) if len(g) > 1]
        if not cands:
            raise ValueError(f"{sum(map(len, out))} rows cannot make the {n} micro-batches another data-parallel rank "
                             f"runs (a mixture of experts needs equal micro-batch counts over each expert-parallel "
                             f"group): the ranks hold different numbers of rows")
        i = max(cands, key=lambda j: (sum(lengths[r] for r in out[j]), -j))
        g = out[i]
        sizes = [lengths[r] for r in g]
        total, acc, cut, best = sum(sizes), 0, 1, None
        for c in range(1, len(g)):
            acc += sizes[c - 1]
            if best is None or abs(2 * acc - total) < best:
                best, cut = abs(2 * acc - total), c
        out[i:i + 1] = [g[:cut], g[cut:]]
    return out


def allreduce_tied_embedding_grads(model) -> None:
    """With tied embeddings and PP > 1 the first stage's embedding and the last stage's
    head are two copies of one weight: sum their gradients over Megatron's embedding group
    (what its DDP wrapper does in ``finalize_model_grads``; ``ddp.MegatronOptimizer.step``)
    so both copies take the same step, for a model stepped without that wrapper. A no-op
    otherwise. Call after ``forward_backward``, before the optimizer step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    weight = None
    if getattr(model, "share_embeddings_and_output_weights", False) and ps.get_pipeline_model_parallel_world_size() > 1 \
            and (ps.is_pipeline_first_stage(ignore_virtual=True) or ps.is_pipeline_last_stage(ignore_virtual=True)):
        weight = model.shared_embedding_or_output_weight()
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def allreduce_tp_replicated_grads(model) -> None:
    """Weights replicated over the tensor-parallel group whose gradient each rank holds only
    part of: Qwen3's QK-norm (each rank normalises only its own heads) and, with sequence
    parallelism, every norm weight (each rank normalises only its share of the tokens). Add
    their gradients over TP, once each -- megatron-core's condition in ``finalize_model_grads``
    (``_allreduce_non_tensor_model_parallel_grads``), which its DDP wrapper runs
    (``ddp.MegatronOptimizer.step``) -- for a model stepped without that wrapper. A no-op at
    TP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    cfg = model.config
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if (cfg.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                cfg.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
