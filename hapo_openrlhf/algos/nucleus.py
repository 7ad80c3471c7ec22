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
# <= max p * 2**-BISECT_STEPS wide (about 1e-12), so a token is misplaced only if its
# probability lies within 1e-12 of the nucleus boundary
BISECT_STEPS = 40


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

    No rank need see a whole row, so the nucleus boundary is found as a probability
    threshold instead of by a sort: the dropped tokens are those with p <= t for the
    largest t whose dropped mass is <= 1 - top_p (the sort rule's longest ascending
    prefix), by ``BISECT_STEPS`` bisection steps (each one [C] all-reduce over ``group``),
    then the kept mass. The same path serves one process: no [C, V] sort, index or cumsum
    buffers, so a chunk holds its probabilities and one masked copy, as the fused heads'
    log-prob pass does. Cost: ``BISECT_STEPS`` no-grad passes over [C, Vr], for a metric;
    nothing at ``top_p`` 1.
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

    for s in range(0, flat.shape[0], chunk_size):
        if weight is not None:
            z = (flat[s:s + chunk_size].to(weight.dtype) @ weight[:nv].t()).float()
        else:
            z = flat[s:s + chunk_size, :nv].float()
        if temperature != 1.0:
            z = z / temperature
        m = reduce(z.amax(-1) if nv else z.new_full((z.shape[0],), -torch.inf), dist.ReduceOp.MAX)
        p = torch.exp(z - m.unsqueeze(-1))  # not in place: z may be the caller's own logits
        del z
        p.div_(reduce(p.sum(-1), dist.ReduceOp.SUM).unsqueeze(-1))
        lo = torch.zeros_like(m)
        hi = reduce(p.amax(-1) if nv else torch.zeros_like(m), dist.ReduceOp.MAX)
        for _ in range(BISECT_STEPS):
            mid = (lo + hi) / 2
            dropped = reduce(p.masked_fill(p > mid.unsqueeze(-1), 0).sum(-1), dist.ReduceOp.SUM)
            ok = dropped <= 1.0 - top_p
            lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        out[s:s + chunk_size] = reduce(p.masked_fill(p <= lo.unsqueeze(-1), 0).sum(-1), dist.ReduceOp.SUM).log()
    return out.view(lead)
