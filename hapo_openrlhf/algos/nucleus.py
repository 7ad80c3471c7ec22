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


@torch.no_grad()
def sharded_nucleus_logmass(
    x: torch.Tensor,
    top_p: float,
    *,
    weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    n_valid: int | None = None,
    group=None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """[...] log P(S) from a vocabulary shard, never the full [N, V] logits.

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

    Cost per chunk: one segmented sort and one cumsum over [C, Vr], then O(C log Vr) per
    step. Nothing at ``top_p`` 1.
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
    if top_p == 1.0:
        return out.view(lead)
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
        out[s:s + C] = (total - gone - extra * v).log()
        p = csum = None  # freed before the next chunk
    return out.view(lead)
