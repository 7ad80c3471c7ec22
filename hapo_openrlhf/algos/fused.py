"""Fused LM head + log-prob + entropy, memory bounded by one chunk of tokens.

Shape legend: N tokens, H hidden size, V vocabulary, C chunk of tokens.

From the last hidden states h [N,H] and the LM-head weight W [V,H] compute, per
token, log pi(label) and the entropy of softmax(h W^T / T) without ever holding
the [N,V] logits: each chunk's fp32 logits [C,V] live only inside the loop. The
backward recomputes each chunk's logits instead of storing them and applies

    d logp_label / dz = onehot(label) - p
    d H / dz          = -p * (log p + H)

(z = logits / T), so gradients flow to h and W through both outputs — the
entropy term included, for EntroReg. Peak extra memory: a few [C,V] fp32
buffers plus the [V,H] weight gradient, independent of N.
"""

from __future__ import annotations

import torch


class _FusedLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, temperature: float, chunk: int):
        N = hidden_NH.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
        ent = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        w = weight_VH.float()
        for s in range(0, N, chunk):
            z = (hidden_NH[s : s + chunk].float() @ w.t()).div_(temperature)
            lse = torch.logsumexp(z, dim=-1)
            lab = labels_N[s : s + chunk]
            logp_all = z.sub_(lse.unsqueeze(-1))  # in place: z is now log p
            logp[s : s + chunk] = logp_all.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
            # H = -sum p log p: summing p * log p (each <= 0) avoids the cancellation of
            # lse - sum p z when logits are large
            ent[s : s + chunk] = -(logp_all.exp() * logp_all).sum(-1)
            lse_all[s : s + chunk] = lse
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, lse_all, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, lse_all, ent = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        w = weight.float()
        g_hidden = torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        g_weight = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        g_logp = torch.zeros_like(lse_all) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse_all) if g_ent is None else g_ent.float()
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].float()
            z = (h @ w.t()).div_(T)
            logp_all = z.sub_(lse_all[s : s + chunk].unsqueeze(-1))  # z is now log p
            p = logp_all.exp()
            # grad wrt z: g_ent * (-p (log p + H)) - g_logp * p, then + g_logp at the label
            gz = logp_all.add_(ent[s : s + chunk].unsqueeze(-1)).mul_(p).mul_(-g_ent[s : s + chunk].unsqueeze(-1))
            gz.sub_(p.mul_(g_logp[s : s + chunk].unsqueeze(-1)))
            gz.scatter_add_(-1, labels[s : s + chunk].unsqueeze(-1), g_logp[s : s + chunk].unsqueeze(-1))
            gz.div_(T)
            if g_hidden is not None:
                g_hidden[s : s + chunk] = gz @ w
            if g_weight is not None:
                g_weight.addmm_(gz.t(), h)
        return (
            g_hidden.to(hidden.dtype) if g_hidden is not None else None,
            g_weight.to(weight.dtype) if g_weight is not None else None,
            None, None, None,
        )


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of ``labels``, entropy), fp32, shaped like ``labels``.

    hidden: [..., H] last hidden states; weight: [V, H] LM head (no bias, as in
    Qwen2); labels: [...] next-token ids. Equivalent to
    ``logprobs_and_entropy(hidden @ weight.T, labels, ...)`` without the logits.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0, got {temperature}, {chunk_size}")
    lead = labels.shape
    logp, ent = _FusedLogpEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), float(temperature), int(chunk_size)
    )
    return logp.view(lead), ent.view(lead)
