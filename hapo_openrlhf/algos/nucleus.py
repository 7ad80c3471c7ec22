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
    also does (``num_keep`` of the ``duplicate_logit`` group). No rank sees a whole row, so:

    1. each rank sorts its shard's probabilities ascending in place (``SORT_ROWS`` rows at
       a time) and takes their cumulative sum -- the only [C, Vr] buffers besides the
       chunk's probabilities;
    2. ``BISECT_STEPS`` bisection steps find the largest threshold t whose dropped mass
       (p <= t, summed over the ranks) is <= 1 - top_p; each step is a binary search per
       row in the sorted shard and one [C] all-reduce -- no pass over [C, Vr];
    3. the next probability above t (v, the smallest over the ranks) is the straddling
       group: floor((1 - top_p - dropped) / v) of its tokens are dropped as well, never
       the most probable token.

    4. ``entropy``: the nucleus entropy H_S = log P(S) - sum_{i in S} p_i log p_i / P(S)
       (PAEC's signal; the full entropy at ``top_p`` 1): p log p is written into the
       cumulative-sum buffer and summed cumulatively in float64 (the kept part is a
       difference of sums of up to V terms, divided by P(S)), and the dropped part is
       subtracted as the mass is (the straddling group's share is ``extra * v log v``).
    5. ``top2_gap``: log p(1st) - log p(2nd) = z(1st) - z(2nd) at the temperature, from
       each shard's top two and three [C] all-reduces (the largest; how many ranks'
       top two equal it; the largest below it) -- nothing gathered.

    Cost per chunk: one segmented sort and one cumsum over [C, Vr] (with ``entropy`` a
    second, into a float64 [C, Vr]), then O(C log Vr) per step. Nothing at ``top_p`` 1
    unless ``entropy`` or ``top2_gap``.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0, got {temperature}, {chunk_size}")
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
        for r in range(0, C, SORT_ROWS):  # ascending, in place
            p[r:r + SORT_ROWS] = p[r:r + SORT_ROWS].sort(-1).values
        csum = p.cumsum(-1)

        def n_at_most(t: torch.Tensor) -> torch.Tensor:  # [C] how many of this shard's p are <= t
            return torch.searchsorted(p, t.unsqueeze(-1).contiguous(), right=True).squeeze(-1) if nv \
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

        lo = torch.zeros_like(m)
        hi = reduce(p[:, nv - 1].clone() if nv else torch.zeros_like(m), dist.ReduceOp.MAX)
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
        total = reduce(csum[:, -1].clone() if nv else torch.zeros_like(m), dist.ReduceOp.SUM)
        kept = total - gone - extra * v
        out[s:s + C] = kept.log()
        if ent is not None:  # the same split, of p log p, its cumulative sum in float64: the kept
            # part is a difference of two sums of up to V terms, and the nucleus can hold a tiny mass
            csum = torch.cumsum(torch.xlogy(p, p, out=csum), -1, dtype=torch.float64)
            n = n_at_most(lo)
            plogp = csum.gather(-1, (n - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1) if nv else torch.zeros_like(m)
            zero = torch.zeros(C, dtype=torch.float64, device=m.device)
            gone_plogp = reduce(torch.where(n > 0, plogp, zero), dist.ReduceOp.SUM)
            all_plogp = reduce(csum[:, -1].clone() if nv else zero, dist.ReduceOp.SUM)
            vc = v.clamp(max=1).double()
            kept_plogp = all_plogp - gone_plogp - extra.double() * torch.xlogy(vc, vc)
            kept64 = total.double() - gone.double() - extra.double() * vc
            ent[s:s + C] = (kept64.log() - kept_plogp / kept64).clamp(min=0).float()
        p = csum = None  # freed before the next chunk
    view = (lambda t: None if t is None else t.view(lead))
    return NucleusStats(out.view(lead), view(ent), view(gap))


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
