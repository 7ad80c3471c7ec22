"""Per-token log-probs and entropy from logits, chunked over tokens.

Shape legend: B batch, T tokens, V vocabulary, N = B*T flattened tokens.

Only one chunk of ``chunk_size`` rows is ever materialised in fp32; the full
[N, V] logits stay in their own dtype. With autograd enabled each chunk runs
under activation checkpointing, so the backward recomputes the chunk's fp32
softmax instead of keeping every chunk's scratch alive.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 1024


def _check_logits(logits: torch.Tensor, temperature: float) -> None:
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _chunk_stats(logits_NV: torch.Tensor, labels_N: torch.Tensor | None, temperature: float):
    z = logits_NV.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    entropy = lse - (p * z).sum(-1)
    if labels_N is None:
        return entropy, entropy.new_zeros(())
    logp = z.gather(-1, labels_N.unsqueeze(-1)).squeeze(-1) - lse
    return entropy, logp


def _run_chunks(logits, labels, chunk_size, temperature, want_logp):
    _check_logits(logits, temperature)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1) if want_logp else None
    ent, lp = [], []
    use_ckpt = torch.is_grad_enabled() and flat.requires_grad
    for s in range(0, flat.shape[0], chunk_size):
        chunk = flat[s : s + chunk_size]
        lab = flat_labels[s : s + chunk_size] if want_logp else None
        if use_ckpt:
            e, l = checkpoint(_chunk_stats, chunk, lab, temperature, use_reentrant=False)
        else:
            e, l = _chunk_stats(chunk, lab, temperature)
        ent.append(e)
        lp.append(l)
    entropy = torch.cat(ent).reshape(lead) if ent else flat.new_zeros(lead, dtype=torch.float32)
    if not want_logp:
        return entropy, None
    logp = torch.cat(lp).reshape(lead) if lp else entropy.clone()
    return entropy, logp


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK, temperature: float = 1.0
) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z with z = logits / temperature, in fp32.

    logits: [..., V] -> entropy: [...] (fp32).
    """
    return _run_chunks(logits, None, chunk_size, temperature, want_logp=False)[0]


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels] in fp32. logits [..., V], labels [...]."""
    return logprobs_and_entropy(logits, labels, chunk_size, temperature)[0]


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of labels, entropy), both [...] fp32, from one chunked pass."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:-1])}"
        )
    entropy, logp = _run_chunks(logits, labels, chunk_size, temperature, want_logp=True)
    return logp, entropy


def check_finite(name: str, t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise a ``FloatingPointError`` naming ``name`` if any (masked) value is NaN/inf."""
    vals = t[mask.bool()] if mask is not None else t
    bad = ~torch.isfinite(vals)
    if bool(bad.any()):
        raise FloatingPointError(
            f"non-finite {name}: {int(bad.sum())} of {vals.numel()} values are NaN/inf"
        )
