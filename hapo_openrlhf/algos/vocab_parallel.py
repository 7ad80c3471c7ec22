"""Log-probs and entropy when the vocabulary is split across tensor-parallel ranks.

Each rank holds logits for its slice ``[vocab_start, vocab_start + V_r)`` of the
vocabulary (Megatron's ``ColumnParallelLinear`` output layer). Per token, three
all-reduces over the tensor-parallel group give everything:

* ``m = max_v z_v``            (MAX; for a stable exp)
* ``S = sum_v exp(z_v - m)``   (SUM), so ``log Z = m + log S``
* ``E = sum_v exp(z_v - m) z_v`` (SUM), so ``sum_v p_v z_v = E / S``
* the label's logit: only the owning rank contributes it (SUM)

    log p(label) = z_label - log Z,    H = log Z - sum_v p_v z_v

The full vocabulary is never gathered, and rows are processed ``chunk_size`` at
a time, so a rank's fp32 scratch is one ``[chunk, V_r]`` block. The backward
needs no communication: with ``log Z`` and ``E_p[z]`` saved per token, each rank
forms its own slice of the gradient,

    d log p / d z_v = 1[v = label] - p_v,    d H / d z_v = -p_v (z_v - E_p[z]),

recomputing ``p`` from its local logits chunk by chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .entropy import DEFAULT_CHUNK


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, n_valid, temperature, chunk_size, group):
        N = logits.shape[0]
        Vr = n_valid  # columns past n_valid are vocabulary padding: not part of the distribution
        logz = torch.empty(N, dtype=torch.float32, device=logits.device)
        mean_z = torch.empty_like(logz)
        logp = torch.empty_like(logz)
        local = labels - vocab_start
        owned = (local >= 0) & (local < Vr)
        for s in range(0, N, chunk_size):
            z = logits[s : s + chunk_size, :Vr].float() / temperature
            m = z.max(-1).values if Vr else z.new_full((z.shape[0],), -torch.inf)
            m = _all_reduce(m, dist.ReduceOp.MAX, group)
            e = torch.exp(z - m.unsqueeze(-1))
            sums = torch.stack([e.sum(-1), (e * z).sum(-1)])
            own = owned[s : s + chunk_size]
            zl = (torch.where(own, z.gather(-1, local[s : s + chunk_size].clamp(0, Vr - 1).unsqueeze(-1)).squeeze(-1),
                              torch.zeros((), dtype=z.dtype, device=z.device)) if Vr else torch.zeros_like(m))
            sums = _all_reduce(torch.cat([sums, zl.unsqueeze(0)]), dist.ReduceOp.SUM, group)
            logz[s : s + chunk_size] = m + sums[0].log()
            mean_z[s : s + chunk_size] = sums[1] / sums[0]
            logp[s : s + chunk_size] = sums[2] - logz[s : s + chunk_size]
        ctx.save_for_backward(logits, local, owned, logz, mean_z)
        ctx.temperature, ctx.chunk_size, ctx.n_valid = temperature, chunk_size, n_valid
        return logp, logz - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local, owned, logz, mean_z = ctx.saved_tensors
        T, C, Vr = ctx.temperature, ctx.chunk_size, ctx.n_valid
        N = logits.shape[0]
        grad = torch.zeros_like(logits)  # padding columns get no gradient
        g_logp = torch.zeros(N, device=logits.device) if g_logp is None else g_logp.float()
        g_ent = torch.zeros(N, device=logits.device) if g_ent is None else g_ent.float()
        for s in range(0, N, C):
            sl = slice(s, s + C)
            z = logits[sl, :Vr].float() / T
            p = torch.exp(z - logz[sl].unsqueeze(-1))
            # d/dz of (g_logp * log p(label) + g_ent * H)
            gz = -p * (g_logp[sl].unsqueeze(-1) + g_ent[sl].unsqueeze(-1) * (z - mean_z[sl].unsqueeze(-1)))
            rows = torch.nonzero(owned[sl], as_tuple=True)[0]
            gz[rows, local[sl][rows]] += g_logp[sl][rows]
            grad[sl, :Vr] = (gz / T).to(logits.dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int | None = None,
    group=None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy), both fp32 of shape ``labels.shape``, from this rank's
    vocabulary shard ``logits [..., V_r]`` (global ids ``vocab_start .. vocab_start+V_r``).

    ``vocab_size``: the real vocabulary size when the shards are padded (Megatron pads
    the vocabulary to a multiple of the tensor-parallel size): ids at or past it are
    excluded from the softmax and get zero gradient. ``group``: the tensor-parallel process group (None: the default group when
    torch.distributed is initialised, else a single process holding the whole
    vocabulary). Differentiable in ``logits`` through both outputs.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0, got {temperature}, {chunk_size}")
    Vr = logits.shape[-1]
    n_valid = Vr if vocab_size is None else max(0, min(Vr, int(vocab_size) - int(vocab_start)))
    if vocab_size is not None and bool((labels >= vocab_size).any()):
        raise ValueError(f"a label is >= vocab_size {vocab_size}")
    lead = labels.shape
    logp, ent = _VocabParallelLogpEntropy.apply(
        logits.reshape(-1, Vr), labels.reshape(-1).long(), int(vocab_start), n_valid, float(temperature),
        int(chunk_size), group)
    return logp.reshape(lead), ent.reshape(lead)
