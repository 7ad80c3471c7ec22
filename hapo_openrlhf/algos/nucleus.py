"""The top-p nucleus as vLLM and Hugging Face sample from it, and its log-mass.

With logits ``z`` at the rollout temperature and ``p = softmax(z)``, top-p sampling
keeps the nucleus S: sort the probabilities ascending and drop the longest prefix whose
cumulative sum is <= 1 - top_p, never the most probable token (vLLM's
``apply_top_k_top_p``; transformers' ``TopPLogitsWarper`` with ``min_tokens_to_keep=1``).
The sampler then draws from p restricted to S and renormalised, so a sampled token's
*processed* log-prob (vLLM's ``processed_logprobs``) is::

    log mu(a) = log p(a) - log P(S),     P(S) = sum_{i in S} p_i <= 1

while the trainer's old log-prob is the full-vocabulary ``log p(a)``. The mismatch
correction's log-ratio ``old - rollout`` therefore carries ``log P(S) <= 0`` per token
under ``behaviour: processed`` (docs/method.md 6b); :func:`nucleus_logmass` is that term.
Rows are processed in chunks of ``chunk_size`` (a sort of one [chunk, V] block at a time).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


def metric_due(top_p: float, every: int, steps_done: int) -> bool:
    """Whether the RL step after ``steps_done`` finished steps logs ``rollout/nucleus_logmass``
    (``rollout.nucleus_metric_every``): under top-p < 1, on steps 1, 1 + every, ...; never at 0."""
    return top_p < 1.0 and every > 0 and steps_done % every == 0


def _check(logits: torch.Tensor, top_p: float) -> None:
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits need a non-empty vocabulary dimension, got shape {tuple(logits.shape)}")


def nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: True for the tokens of the top-p nucleus (the sampler's rule)."""
    _check(logits, top_p)
    if top_p == 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    return _mask_of(torch.softmax(logits.float(), -1), top_p)


def _mask_of(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(-1)  # ascending
    drop_sorted = sorted_p.cumsum(-1) <= 1 - top_p
    drop_sorted[..., -1] = False  # the most probable token always stays
    return ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def nucleus_logprobs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] log-probs renormalised over the nucleus (-inf outside): vLLM's
    ``processed_logprobs`` for logits already divided by the temperature."""
    z = logits.float().masked_fill(~nucleus_mask(logits, top_p), float("-inf"))
    return torch.log_softmax(z, -1)


@torch.no_grad()
def nucleus_logmass(logits: torch.Tensor, top_p: float, chunk_size: int = 1024) -> torch.Tensor:
    """[...] log P(S) of each position's nucleus under ``softmax(logits)`` (0 at top_p 1)."""
    _check(logits, top_p)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.zeros(flat.shape[0], dtype=torch.float32, device=logits.device)
    if top_p < 1.0:
        for s in range(0, flat.shape[0], chunk_size):
            probs = torch.softmax(flat[s:s + chunk_size].float(), -1)
            out[s:s + chunk_size] = (probs * _mask_of(probs, top_p)).sum(-1).log()
    return out.reshape(logits.shape[:-1])


# a fixed count keeps every rank's collectives in step; the threshold interval ends
# <= max p * 2**-BISECT_STEPS wide (about 1e-12), so two *distinct* probabilities are
# confused only if they lie within 1e-12 of each other at the nucleus boundary
BISECT_STEPS = 40
# rows sorted at once (the sort's index buffer is [SORT_ROWS, Vr] int64, beside the chunk)
SORT_ROWS = 64
# the largest probabilities taken per row (each rank's top TOP_K, merged over the ranks) before a
# row is sorted whole: a nucleus of at most TOP_K tokens -- a trained model's usual token -- is
# read from them alone (issue 61); a row whose nucleus is larger is sorted as before
TOP_K = 64


class NucleusStats(NamedTuple):
    """Per position, [...] float32: log P(S); the entropy of p renormalised over S (None
    unless asked for); log p(1st) - log p(2nd), the two most probable tokens (None unless
    asked for; +inf with a one-token vocabulary)."""

    logmass: torch.Tensor
    entropy: torch.Tensor | None
    top2_gap: torch.Tensor | None


@torch.no_grad()
def sharded_nucleus_logmass(x: torch.Tensor, top_p: float, **kw) -> torch.Tensor:
    """[...] log P(S) from a vocabulary shard (:func:`sharded_nucleus_stats`)."""
    return sharded_nucleus_stats(x, top_p, **kw).logmass


@torch.no_grad()
def sharded_nucleus_stats(
    x: torch.Tensor,
    top_p: float,
    *,
    weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    n_valid: int | None = None,
    group=None,
    chunk_size: int = 1024,
    entropy: bool = False,
    top2_gap: bool = False,
    top_k: int = TOP_K,
) -> NucleusStats:
    """[...] log P(S) -- and the nucleus entropy and top-two gap when asked -- from a
    vocabulary shard, never the full [N, V] logits.

    ``x``: this rank's logits shard ``[..., Vr]``, or with ``weight`` ([Vr, H], this
    rank's LM-head rows) the last hidden states ``[..., H]`` (the fused heads: each
    chunk's logits are recomputed, one matmul in the weight's dtype). Logits are divided
    by ``temperature``; columns at or past ``n_valid`` are vocabulary padding. ``group``:
    the tensor-parallel group whose ranks hold the other shards of the same rows; None:
    this process holds the whole vocabulary (a data-parallel job's ranks hold different
    rows, so the default group is never assumed).

    The boundary is vLLM's: its sort rule (``apply_top_k_top_p_pytorch``) drops the longest
    ascending prefix whose cumulative mass is <= 1 - top_p, so a group of *tied*
    probabilities straddling the boundary is split by count, as its Triton pivot kernel
    also does (``num_keep`` of the ``duplicate_logit`` group). Equivalently, from the top:
    S is the fewest most probable tokens whose mass reaches P - (1 - top_p) (P the total,
    1 up to rounding), tied tokens counted one by one. No rank sees a whole row, so:

    1. **the top of each row** (``top_k``, issue 61): each rank's ``top_k`` largest
       probabilities, merged over the ranks (an all-reduce of [ranks, C, top_k]), hold the
       global top ``top_k``, descending; where their cumulative mass reaches the target,
       S is read from them alone: log P(S), and the entropy from their cumulative p and
       p log p in float64 -- no sort of the vocabulary;
    2. **the other rows** (a nucleus of more than ``top_k`` tokens: flat rows), named by
       one host read per chunk, go through the sorted shard as before:
       each rank sorts its shard's probabilities ascending in place (``SORT_ROWS`` rows
       at a time) and takes their cumulative sum; ``BISECT_STEPS`` bisection steps find
       the largest threshold t whose dropped mass (p <= t, summed over the ranks) is
       <= 1 - top_p (a binary search per row in the sorted shard and one [C] all-reduce
       each); the next probability above t (v, the smallest over the ranks) is the
       straddling group: floor((1 - top_p - dropped) / v) of its tokens are dropped as
       well, never the most probable token; ``entropy``: H_S = log P(S) - sum_{i in S}
       p_i log p_i / P(S), from the cumulative sum of p log p in float64.
    3. ``top2_gap``: log p(1st) - log p(2nd) = z(1st) - z(2nd) at the temperature, from
       each shard's top two and three [C] all-reduces (the largest; how many ranks'
       top two equal it; the largest below it) -- nothing gathered.

    ``top_p`` 1: S is the vocabulary; the entropy is one pass of p log p (float64 sums).

    Cost per chunk: the softmax's passes and a top-``top_k`` over [C, Vr]; for the rows of
    2., one segmented sort and one cumsum over [C', Vr] (with ``entropy`` a second, into
    a float64 [C', Vr]), then O(C' log Vr) per step. ``top_k`` 0 sorts every row.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0, got {temperature}, {chunk_size}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: sort every row), got {top_k}")
    if weight is not None and (weight.dim() != 2 or weight.shape[1] != x.shape[-1]):
        raise ValueError(f"weight must be [Vr, H={x.shape[-1]}], got {tuple(weight.shape)}")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros(flat.shape[0], dtype=torch.float32, device=x.device)
    ent = torch.zeros_like(out) if entropy else None
    gap = torch.zeros_like(out) if top2_gap else None
    if top_p == 1.0 and not (entropy or top2_gap):
        return NucleusStats(out.view(lead), None, None)
    Vr = weight.shape[0] if weight is not None else flat.shape[-1]
    nv = Vr if n_valid is None else max(0, min(Vr, int(n_valid)))
    if nv == 0 and group is None:
        raise ValueError("no vocabulary columns (n_valid is 0)")

    def reduce(t: torch.Tensor, op) -> torch.Tensor:  # over the shards of the same rows, if any
        if group is not None:
            dist.all_reduce(t, op=op, group=group)
        return t

    budget = 1.0 - top_p
    for s in range(0, flat.shape[0], chunk_size):
        if weight is not None:
            z = (flat[s:s + chunk_size].to(weight.dtype) @ weight[:nv].t()).float()
        else:
            z = flat[s:s + chunk_size, :nv].float()
        own = z._base is None  # a matmul's or a dtype cast's output, not a view of the caller's logits
        if temperature != 1.0:
            z = z.div_(temperature) if own else z / temperature
            own = True
        C = z.shape[0]
        if gap is not None:
            gap[s:s + C] = _top2_gap(z, nv, reduce)
        if top_p == 1.0 and ent is None:
            continue
        m = reduce(z.amax(-1) if nv else z.new_full((C,), -torch.inf), dist.ReduceOp.MAX)
        # the probabilities, in place when z is ours (not the caller's logits)
        p = (z.sub_(m.unsqueeze(-1)) if own else z - m.unsqueeze(-1)).exp_()
        del z
        p.div_(reduce(p.sum(-1), dist.ReduceOp.SUM).unsqueeze(-1))
        # P, for the paths that read it (the sorted one takes its own from its cumulative sums)
        total = reduce(p.sum(-1), dist.ReduceOp.SUM) if top_p == 1.0 or top_k > 0 else None
        if top_p == 1.0:  # S is the vocabulary: its entropy in one pass
            out[s:s + C] = total.log()
            plogp = reduce(torch.xlogy(p, p).sum(-1, dtype=torch.float64), dist.ReduceOp.SUM)
            ent[s:s + C] = (total.double().log() - plogp / total.double()).clamp(min=0).float()
            continue
        if top_k > 0:
            found, kept, kept_ent = _nucleus_from_top(p, nv, top_k, total - budget, group, reduce, ent is not None)
            out[s:s + C] = kept.log()
            if ent is not None:
                ent[s:s + C] = kept_ent
            rows = (~found).nonzero().flatten()  # the one host read: which rows the top did not settle
        else:
            rows = torch.arange(C, device=p.device)
        if rows.numel():
            if rows.numel() < C:  # those rows moved to the front of p in place (p's other rows are done)
                for r in range(0, rows.numel(), SORT_ROWS):
                    block = rows[r:r + SORT_ROWS]
                    p[r:r + block.numel()] = p[block]
            kept, kept_ent = _nucleus_from_sorted(p[:rows.numel()], nv, budget, reduce, ent is not None)
            out[s + rows] = kept.log()
            if ent is not None:
                ent[s + rows] = kept_ent
        p = None  # freed before the next chunk
    view = (lambda t: None if t is None else t.view(lead))
    return NucleusStats(out.view(lead), view(ent), view(gap))


def _nucleus_from_top(p: torch.Tensor, nv: int, k: int, target: torch.Tensor, group, reduce, entropy: bool):
    """Step 1 of :func:`sharded_nucleus_stats` for every row of ``p`` [C, >= nv] (this rank's
    probabilities): (found [C] bool -- the rows this settles, the same on every rank -- P(S) [C]
    float32, H_S [C] float32 or None); the other rows' values are meaningless."""
    C = p.shape[0]
    kk = min(k, nv)
    q = p.new_zeros(C, k)
    if kk:
        q[:, :kk] = p[:, :nv].topk(kk, -1, sorted=False).values
    if group is not None:  # every rank's top k, in its slot: the global top k lies among them
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        every = q.new_zeros(world, C, k)
        every[rank] = q
        q = reduce(every, dist.ReduceOp.SUM).permute(1, 0, 2).reshape(C, world * k)
    q = q.sort(-1, descending=True).values[:, :k]  # the global top k, descending (zeros pad)
    csum = q.cumsum(-1)
    # the fewest top tokens whose mass reaches the target (ties counted one by one: the sort rule's
    # split of a straddling group); settled where that is inside the top k
    at = (csum < target.unsqueeze(-1)).sum(-1)
    found = at < k
    i = at.clamp(max=k - 1).unsqueeze(-1)
    kept = csum.gather(-1, i).squeeze(-1)
    if not entropy:
        return found, kept, None
    q64 = q.double()
    kept64 = q64.cumsum(-1).gather(-1, i).squeeze(-1)
    plogp = torch.xlogy(q64, q64).cumsum(-1).gather(-1, i).squeeze(-1)
    return found, kept, (kept64.log() - plogp / kept64).clamp(min=0).float()


def _nucleus_from_sorted(p: torch.Tensor, nv: int, budget: float, reduce, entropy: bool):
    """Step 2 of :func:`sharded_nucleus_stats` for every row of ``p`` [C, >= nv] (this rank's
    probabilities, sorted here in place): (P(S) [C] float32, H_S [C] float32 or None)."""
    C = p.shape[0]
    for r in range(0, C, SORT_ROWS):  # ascending, in place
        p[r:r + SORT_ROWS] = p[r:r + SORT_ROWS].sort(-1).values
    csum = p.cumsum(-1)
    zero32 = torch.zeros(C, dtype=p.dtype, device=p.device)

    def n_at_most(t: torch.Tensor) -> torch.Tensor:  # [C] how many of this shard's p are <= t
        return torch.searchsorted(p[:, :nv], t.unsqueeze(-1).contiguous(), right=True).squeeze(-1) if nv \
            else torch.zeros(C, dtype=torch.long, device=t.device)

    def dropped(t: torch.Tensor) -> torch.Tensor:  # the mass of the n smallest, summed over the ranks
        n = n_at_most(t)
        mass = csum.gather(-1, (n - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1) if nv else torch.zeros_like(t)
        return reduce(torch.where(n > 0, mass, torch.zeros_like(mass)), dist.ReduceOp.SUM)

    def next_above(k: torch.Tensor) -> torch.Tensor:  # [C] this shard's (k+1)-th smallest p, inf past the end
        if not nv:
            return torch.full((C,), torch.inf, dtype=p.dtype, device=p.device)
        got = p.gather(-1, k.clamp(max=nv - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(k < nv, got, torch.full_like(got, torch.inf))

    lo = zero32.clone()
    hi = reduce(p[:, nv - 1].clone() if nv else zero32.clone(), dist.ReduceOp.MAX)
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        ok = dropped(mid) <= budget
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    k = n_at_most(lo)
    gone = dropped(lo)
    # the straddling group: v, the smallest p above lo over the ranks, and how many hold it
    v = reduce(next_above(k), dist.ReduceOp.MIN)
    n_v = reduce((n_at_most(v) - k).to(torch.float32), dist.ReduceOp.SUM)
    n_above = reduce((nv - k).to(torch.float32), dist.ReduceOp.SUM)
    extra = torch.floor((budget - gone).clamp(min=0) / v)
    extra = torch.minimum(torch.minimum(extra, n_v), n_above - 1).clamp(min=0)
    total = reduce(csum[:, nv - 1].clone() if nv else zero32.clone(), dist.ReduceOp.SUM)
    kept = total - gone - extra * v
    if not entropy:
        return kept, None
    # the same split, of p log p, its cumulative sum in float64: the kept part is a difference of
    # two sums of up to V terms, and the nucleus can hold a tiny mass
    csum = torch.cumsum(torch.xlogy(p, p, out=csum), -1, dtype=torch.float64)
    n = n_at_most(lo)
    zero = torch.zeros(C, dtype=torch.float64, device=p.device)
    plogp = csum.gather(-1, (n - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1) if nv else zero
    gone_plogp = reduce(torch.where(n > 0, plogp, zero), dist.ReduceOp.SUM)
    all_plogp = reduce(csum[:, nv - 1].clone() if nv else zero, dist.ReduceOp.SUM)
    vc = v.clamp(max=1).double()
    kept_plogp = all_plogp - gone_plogp - extra.double() * torch.xlogy(vc, vc)
    kept64 = total.double() - gone.double() - extra.double() * vc
    return kept, (kept64.log() - kept_plogp / kept64).clamp(min=0).float()


def _top2_gap(z: torch.Tensor, nv: int, reduce) -> torch.Tensor:
    """[C] z(1st) - z(2nd) over the ranks' shards of the rows of ``z`` [C, >= nv] (its first
    nv columns are vocabulary): the largest m; if two or more of the ranks' top-two values
    equal m, the gap is 0; else m minus the largest value below m."""
    C = z.shape[0]
    ninf = torch.full((C, 2), -torch.inf, dtype=torch.float32, device=z.device)
    top = z[:, :nv].topk(min(2, nv), -1).values if nv else ninf[:, :0]
    top = torch.cat([top, ninf[:, : 2 - top.shape[1]]], -1)  # [C, 2], descending, -inf padded
    m = reduce(top[:, 0].clone(), dist.ReduceOp.MAX)
    at_m = reduce((top == m.unsqueeze(-1)).sum(-1).to(torch.float32), dist.ReduceOp.SUM)
    below = torch.where(top < m.unsqueeze(-1), top, ninf).amax(-1)
    second = torch.where(at_m >= 2, m, reduce(below, dist.ReduceOp.MAX))
    return m - second
