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
