"""Context parallelism's batch split (issue 58, its first piece): a packed (THD) micro-batch cut
the way Transformer Engine's context-parallel attention expects it, and put back together.

TE splits each packed sequence across the CP ranks load-balanced for causal attention: the
sequence, padded to a multiple of 2 x CP, is cut into 2 CP equal chunks and rank r holds chunks
r and 2 CP - 1 - r, in that order (TE ``thd_get_partitioned_indices``, the CUDA kernel
``thd_partition_indices_kernel`` in ``transformer_engine/common/fused_attn/context_parallel.cu``;
verl's ``preprocess_packed_seqs`` and NeMo-RL cut the same way). With sequence parallelism the
rank's tokens are further split over TP, so the padding is to a multiple of 2 x CP x TP
(``align``). Rank r's causal work -- sum over its tokens of the keys they attend to -- is then
the same for every r.

Everything here is host-side index arithmetic over Python ints (the lengths are on the host
before a micro-batch is built), so it adds no device sync. What each rank keeps:

* ``input_ids``, ``position_ids`` (the token's position in its sequence: RoPE for the chunks the
  rank holds) and ``labels`` -- the *global* next token of each held token, so a chunk's last
  token is labelled with the first token of the next chunk, which another rank holds (verl's
  ``need_roll``); ``loss_mask`` is 0 on padding and on each sequence's last real token (no next
  token), as the unsplit batch's;
* ``cu_seqlens`` (the real lengths) and ``cu_seqlens_padded`` (the padded ones), both global, as
  megatron-core's ``PackedSeqParams`` carries them for TE (``cu_seqlens_q`` / ``cu_seqlens_q_padded``);
* ``indices``: where each held token sits in the padded packed sequence (:func:`gather_to_global`
  puts per-token outputs of every rank back in that order).

After the forward, :func:`all_gather_tokens` gathers a rank's per-token outputs over the CP group
(differentiably) so that what follows runs on the whole micro-batch.

What TE's CP attention does with this split is in the tests' TE stand-in (``cp_group`` /
``cp_comm_type``: exact attention for each rank's tokens; tests/megatron/test_context_parallel.py
checks it equals one rank on this split, and that megatron-core's GPTModel at
``context_parallel_size`` 2 fed this split equals the model at CP=1). :class:`CPRows` is hapo's
log-prob path under CP on top of this split: ``schedule.logprobs_and_entropy`` and
``schedule.forward_backward`` take it when the parallel state has CP > 1 (THD, PP 1; the head's
nucleus log-mass and PAEC's signals too; a mixture of experts' routers see each rank's share, the
rollout's routes cut by the same positions), and megatron-core's DDP and distributed
optimizer reduce and shard over DP x CP. The policy actor runs it with ``megatron.context_parallel``
> 1 (its parallel state in ``setup.RANK_ORDER``: OpenRLHF's controller sends a replica's micro-batches
to all its CP ranks; the token budget counts each rank's share, :func:`tokens_per_rank`); a load-
balancing loss is megatron-core's, its expert counts reduced over TP x CP. Refused by name where
configured: PP x CP (megatron-core cannot start it in the actor's rank order) and the hierarchical
``a2a+p2p`` (TE runs it on sbhd / bshd only) -- docs/megatron.md, "Context parallelism".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .head import PlacedHeadValues


# the oldest Transformer Engine that runs each ``megatron.cp_comm_type`` on packed (THD) sequences:
# CP on THD arrived in TE 1.7; megatron-core hands TE a comm type only from TE 1.10 and silently runs
# p2p below it (``TEDotProductAttention.__init__``), so all_gather and a2a need 1.10
TE_MIN_VERSION = {"p2p": "1.7.0", "all_gather": "1.10.0", "a2a": "1.10.0"}


def te_problem(comm_type: str, te_version: str | None) -> str | None:
    """Why a Transformer Engine of ``te_version`` (None: not installed) cannot run context parallelism
    with ``comm_type``; None when it can. One line, naming the setting."""
    from packaging.version import InvalidVersion, Version

    if comm_type not in TE_MIN_VERSION:
        return f"megatron.cp_comm_type {comm_type!r} is not one of {sorted(TE_MIN_VERSION)}"
    need = TE_MIN_VERSION[comm_type]
    if te_version is None:
        return (f"megatron.context_parallel > 1 runs through Transformer Engine's attention, and transformer-engine "
                f"is not installed (cp_comm_type {comm_type} needs >= {need})")
    try:
        have = Version(str(te_version).split("+")[0])
    except InvalidVersion:
        return f"transformer-engine reports version {te_version!r}, which is not a version: cannot check it"
    if have < Version(need):
        return (f"megatron.cp_comm_type {comm_type} needs transformer-engine >= {need}, installed {te_version}"
                + (" (megatron-core would run p2p instead without a word)" if comm_type != "p2p" else ""))
    return None


def check_installed_te(comm_type: str) -> None:
    """:func:`te_problem` for the Transformer Engine megatron-core sees (its ``get_te_version``);
    raises ValueError. The policy actor calls it before its process groups exist."""
    from megatron.core.utils import get_te_version

    try:
        have = get_te_version()
    except Exception:  # noqa: BLE001 - no TE, or no packaging: megatron-core cannot report one
        have = None
    problem = te_problem(comm_type, None if have is None else str(have))
    if problem:
        raise ValueError(problem)


def align_size(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple each sequence is padded to: 2 CP (x TP with sequence parallelism); without CP,
    TP with sequence parallelism (megatron splits the tokens over TP), else 1."""
    _check_sizes(cp, tp)
    tp_part = tp if sequence_parallel else 1
    return 2 * cp * tp_part if cp > 1 else tp_part


def _check_sizes(cp: int, tp: int) -> None:
    for name, v in (("context_parallel", cp), ("tensor_parallel", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def padded_lengths(lengths: list[int], align: int) -> list[int]:
    """Each length rounded up to a multiple of ``align``."""
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"every packed sequence needs at least one token, got lengths {lengths[:8]}")
    return [-(-n // align) * align for n in lengths]


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def rank_indices(cu_seqlens_padded: list[int], cp: int, rank: int) -> torch.Tensor:
    """[total / CP] int64: the positions in the padded packed sequence that CP rank ``rank`` holds,
    in its order -- per sequence, chunk ``rank`` then chunk 2 CP - 1 - ``rank`` of its 2 CP chunks."""
    _check_sizes(cp, 1)
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank must be in [0, {cp}), got {rank}")
    if cp == 1:  # no split: the whole packed sequence, in order
        return torch.arange(cu_seqlens_padded[-1] if cu_seqlens_padded else 0)
    out = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
        n = end - start
        if n % (2 * cp):
            raise ValueError(f"a padded sequence of {n} tokens does not split into 2 x {cp} equal chunks")
        c = n // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            out.append(torch.arange(start + k * c, start + (k + 1) * c))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


@dataclass
class CPShard:
    """One CP rank's share of a packed micro-batch (module docstring)."""

    indices: torch.Tensor  # [Tr] positions in the padded packed sequence
    input_ids: torch.Tensor  # [Tr]
    position_ids: torch.Tensor  # [Tr] position within the token's own sequence
    labels: torch.Tensor  # [Tr] the global next token (pad where there is none)
    loss_mask: torch.Tensor  # [Tr] bool: a real token with a next token
    cu_seqlens: list[int]  # global, real lengths
    cu_seqlens_padded: list[int]  # global, padded lengths
    max_seqlen: int  # the longest padded sequence


def shard(sequences: list[torch.Tensor], cp: int, rank: int, *, tp: int = 1, sequence_parallel: bool = False,
          pad_id: int = 0) -> CPShard:
    """CP rank ``rank``'s share of the packed sequences ``sequences`` (each a 1-D token tensor)."""
    lengths = [int(s.numel()) for s in sequences]
    padded = padded_lengths(lengths, align_size(cp, tp, sequence_parallel))
    cu, cu_p = cumulative(lengths), cumulative(padded)
    total = cu_p[-1]
    ids = torch.full((total,), pad_id, dtype=torch.long)
    labels = torch.full((total,), pad_id, dtype=torch.long)
    pos = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total, dtype=torch.bool)
    for s, start, n, n_pad in zip(sequences, cu_p[:-1], lengths, padded):
        ids[start:start + n] = s
        labels[start:start + n - 1] = s[1:]  # the next token of the same sequence, whoever holds it
        mask[start:start + n - 1] = True
        pos[start:start + n_pad] = torch.arange(n_pad)
    idx = rank_indices(cu_p, cp, rank)
    return CPShard(idx, ids[idx], pos[idx], labels[idx], mask[idx], cu, cu_p, max(padded) if padded else 0)


def gather_to_global(parts: list[torch.Tensor], cu_seqlens_padded: list[int], cp: int) -> torch.Tensor:
    """Per-token outputs of every CP rank (``parts[r]`` in rank r's order, first dimension its tokens)
    back in the padded packed order: what an all-gather over the CP group followed by this gives."""
    if len(parts) != cp:
        raise ValueError(f"need one part per context-parallel rank ({cp}), got {len(parts)}")
    total = cu_seqlens_padded[-1]
    out = parts[0].new_zeros((total, *parts[0].shape[1:]))
    for r, part in enumerate(parts):
        idx = rank_indices(cu_seqlens_padded, cp, r)
        if part.shape[0] != idx.numel():
            raise ValueError(f"rank {r}'s part holds {part.shape[0]} tokens, its share is {idx.numel()}")
        out[idx] = part
    return out


def tokens_per_rank(lengths: list[int], cp: int, *, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The tokens one CP rank holds for these sequences (the padded total / CP): what a token budget
    (``max_tokens_per_gpu``) counts per rank under context parallelism."""
    return sum(padded_lengths(lengths, align_size(cp, tp, sequence_parallel))) // cp


class _AllGatherTokens(torch.autograd.Function):
    """Forward: every CP rank's per-token tensor, back in the padded packed order. Backward: this
    rank's rows of the incoming gradient, as they are -- every CP rank computes the same loss on the
    gathered tensor, so each rank's own tokens get that loss's gradient once, not CP times."""

    @staticmethod
    def forward(ctx, local, cu_seqlens_padded, group):
        import torch.distributed as dist

        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rows = rank_indices(cu_seqlens_padded, cp, rank).to(local.device)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return gather_to_global(parts, cu_seqlens_padded, cp)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.rows), None, None


def all_gather_tokens(local: torch.Tensor, cu_seqlens_padded: list[int], group) -> torch.Tensor:
    """This CP rank's per-token outputs ``local`` ([tokens it holds, ...], in its order: log-probs,
    entropy, any token-local signal) -> the whole micro-batch's, [padded total, ...] in the padded
    packed order, on every rank of ``group`` (the CP group), differentiable. What comes after the
    forward then runs on the whole micro-batch as without CP -- each CP rank the same loss, its
    normaliser and batch statistics over every token -- while the backward sends each rank only its
    own tokens' gradient, so the parameters' gradients summed over the CP group (megatron-core's DDP
    reduces over DP x CP) are the whole batch's. verl gathers log-probs over CP the same way
    (``postprocess_packed_seqs``). Costs a [padded total] vector per output, not activations."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return local
    return _AllGatherTokens.apply(local, list(cu_seqlens_padded), group)


class CPRows(PlacedHeadValues):
    """A micro-batch's rows under context parallelism, with the interface the schedule uses of
    ``schedule.RowLayout`` (``model_inputs`` and the head's values, ``head.PlacedHeadValues``): the rows
    of a left/right padded [B, S] batch packed (THD), each padded to the split's multiple
    (:func:`align_size`: 2 CP, x TP with sequence parallelism), this CP rank's share forwarded with
    ``PackedSeqParams`` holding the global ``cu_seqlens`` and ``cu_seqlens_padded`` (what megatron-core's
    THD RoPE and TE's CP attention read), each held token scored against its global next token, the
    values gathered back (:func:`all_gather_tokens`) into the caller's [B, S-1] on every CP rank,
    differentiable. ``schedule.forward_backward`` and ``schedule.logprobs_and_entropy`` use it when
    megatron-core's parallel state has CP > 1.

    Everything is planned on the host from the rows' sizes; the token ids never leave their device:
    the split is made of *positions* in the flattened [B, S] batch (-1 for padding), which pick this
    rank's ids and labels with one gather each."""

    def __init__(self, starts: list[int], lengths: list[int], input_ids: torch.Tensor, cp_group, *, tp: int = 1,
                 sequence_parallel: bool = False):
        """``starts`` / ``lengths``: each row's first real position and real tokens, host ints (what
        ``schedule.RowLayout.of`` reads from the mask, with its checks)."""
        import torch.distributed as dist

        self.group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        cp = 1 if self.group is None else dist.get_world_size(self.group)
        B, S = self.shape = tuple(input_ids.shape)
        self.device = input_ids.device
        self.starts_host, self.lengths_host = list(starts), list(lengths)
        self._real: torch.Tensor | None = None  # real_tokens(), made on first use (a mixture of experts)
        where = [torch.arange(b * S + s, b * S + s + n) for b, (s, n) in enumerate(zip(starts, lengths))]
        self.shard = shard(where, cp, 0 if self.group is None else dist.get_rank(self.group), tp=tp,
                           sequence_parallel=sequence_parallel, pad_id=-1)
        flat = input_ids.reshape(-1)

        def pick(pos):  # the ids at these positions of the batch, 0 where the split padded
            pos = pos.to(self.device)
            return torch.where(pos >= 0, flat.index_select(0, pos.clamp(min=0)), 0)

        self.input_ids, self.labels = pick(self.shard.input_ids), pick(self.shard.labels)
        # each row's next-token positions: (padded packed index, index into the caller's [B, S-1])
        src = [a + i for a, n in zip(self.shard.cu_seqlens_padded[:-1], lengths) for i in range(n - 1)]
        dst = [b * (S - 1) + s + i for b, (s, n) in enumerate(zip(starts, lengths)) for i in range(n - 1)]
        self.src, self.dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (src, dst))

    def model_inputs(self, input_ids: torch.Tensor | None = None) -> dict:
        """kwargs for ``GPTModel.forward``: this CP rank's tokens, packed (``input_ids`` is read at
        construction)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        sh, dev = self.shard, self.device
        cu, cu_p = (torch.tensor(c, dtype=torch.int32, device=dev) for c in (sh.cu_seqlens, sh.cu_seqlens_padded))
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                                 cu_seqlens_kv_padded=cu_p, max_seqlen_q=sh.max_seqlen, max_seqlen_kv=sh.max_seqlen)
        return {"input_ids": self.input_ids[None], "position_ids": sh.position_ids[None].to(dev),
                "attention_mask": None, "packed_seq_params": packed}

    # a mixture of experts under CP: this rank's routers see its share (the split's padding marked)
    def real_tokens(self, tp_rank: int = 0, tp: int = 1) -> torch.Tensor:
        """[tokens this rank holds] bool: True on the rows' real tokens, False on the split's padding; a
        TP rank's chunk with sequence parallelism (``tp`` > 1)."""
        if self._real is None:  # moved to the device once: the routers' statistics and the mask both read it
            self._real = (self.shard.input_ids >= 0).to(self.device, non_blocking=True)
        return self._real.chunk(tp, 0)[tp_rank] if tp > 1 else self._real

    def padding_mask(self, tp_rank: int = 0, tp: int = 1) -> torch.Tensor:
        """GPTModel's ``padding_mask`` [1, tokens]: True where the split padded (the routers leave those
        tokens out of their load-balancing loss and counts); megatron-core scatters it over TP itself."""
        mask = ~self.real_tokens()[None]
        return mask.T.chunk(tp, 0)[tp_rank].T.contiguous() if tp > 1 else mask

    def route_input(self, routes: torch.Tensor, tp_rank: int = 0, tp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout's recorded expert choices [B, S, layers, k] (``moe.recorded_routes``: checked, the
        unrecorded last token and the padding completed) -> this CP rank's tokens' [tokens, layers, k]
        in the order its routers see them, this TP rank's chunk with sequence parallelism; and each
        token's recorded flag. The routes are cut by the same positions as the tokens, on the host."""
        from .moe import recorded_routes

        B, S = self.shape
        full = recorded_routes(routes, (B, S), self.starts_host, self.lengths_host)
        pos = self.shard.input_ids  # positions in the flattened batch (host), -1 where the split padded
        flat = full.reshape(B * S, *full.shape[2:]).index_select(0, pos.clamp(min=0))
        pad = pos < 0
        if bool(pad.any()):  # padding: experts 0 ... k-1, not recorded
            fill = torch.arange(full.shape[-1], dtype=full.dtype)
            flat[pad, :-1] = fill
            flat[pad, -1] = 0
        flat = flat.chunk(tp, 0)[tp_rank] if tp > 1 else flat
        return flat[:, :-1].to(self.device, non_blocking=True), flat[:, -1, 0].bool().to(self.device, non_blocking=True)

    # the head's values (head.PlacedHeadValues): every held position is scored, against the global next
    # token of its sequence (which another CP rank may hold)
    def _scored(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def _labels(self, model_ids=None) -> torch.Tensor:
        return self.labels[None]

    def _place(self, v: torch.Tensor) -> torch.Tensor:
        B, S = self.shape
        whole = all_gather_tokens(v[0], self.shard.cu_seqlens_padded, self.group)
        return whole.new_zeros(B * (S - 1)).index_copy(0, self.dst, whole.index_select(0, self.src)).view(B, S - 1)
