"""Fused LM head + log-prob + entropy, memory bounded by one chunk of tokens.

Shape legend: N tokens, H hidden size, V vocabulary, C chunk of tokens.

From the last hidden states h [N,H] and the LM-head weight W [V,H] compute, per
token, log pi(label) and the entropy of softmax(h W^T / T) without ever holding
the [N,V] logits: each chunk's fp32 logits [C,V] live only inside the loop, and
one chunk needs two [C,V] fp32 buffers (log p and p).

Two autograd forms:

* :func:`fused_logprobs_entropy` returns per-token (log-prob, entropy) for any
  loss. Its backward recomputes each chunk's logits (one extra matmul; the
  logsumexp is kept from the forward, so no renormalisation) and applies

      d logp_label / dz = onehot(label) - p
      d H / dz          = -p * (log p + H)

  (z = logits / T), so gradients flow to h and W through both outputs — the
  entropy term included, for EntroReg.
* :func:`fused_token_loss` takes a *token-local* loss (each token's term depends
  on its own log-prob and entropy, e.g. PPO-clip, EntroReg) and computes the
  gradient of each chunk while its logits are still in memory, as Liger's fused
  linear cross-entropy does: no recomputation, three matmuls like the naive head.

The matmul runs in the weight's dtype (bf16 on GPU, like the model's own head);
softmax, log-prob, entropy and the weight-gradient accumulator are fp32. Peak
extra memory: two [C,V] fp32 buffers plus the [V,H] fp32 weight gradient,
independent of N.
"""

from __future__ import annotations

from typing import Callable

import torch


def _chunk_logp_p(h_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float, lse_C: torch.Tensor | None = None):
    """(log p [C,V], p [C,V], logsumexp [C]) in fp32 for one chunk: two [C,V] buffers.

    With ``lse_C`` given (the backward, from the forward) the normalisation is not
    recomputed: log p = z - lse, p = exp(log p).
    """
    z = h_CH.to(weight_VH.dtype) @ weight_VH.t()
    z = z.float()  # a no-op for fp32 weights
    if temperature != 1.0:
        z.div_(temperature)
    if lse_C is not None:
        z.sub_(lse_C.unsqueeze(-1))
        return z, z.exp(), lse_C
    m = z.amax(-1, keepdim=True)
    z.sub_(m)
    p = z.exp()
    s = p.sum(-1, keepdim=True)
    p.div_(s)
    log_s = s.log_()
    return z.sub_(log_s), p, (m + log_s).squeeze(-1)  # z is now log p


def _entropy(logp_CV: torch.Tensor, p_CV: torch.Tensor) -> torch.Tensor:
    # H = -sum p log p as a batched dot product (no [C,V] product buffer); summing
    # p * log p (each <= 0) avoids the cancellation of lse - sum p z for large logits
    return -(p_CV.unsqueeze(1) @ logp_CV.unsqueeze(-1)).view(-1)


def _chunk_grad(logp, p, ent, labels, g_logp, g_ent, temperature):
    """d(g_logp . logp_label + g_ent . H)/dz, written into the log p buffer (returned)."""
    # gz = p * (-g_ent * (log p + H) - g_logp) + g_logp * onehot(label), all / T
    gz = logp.add_(ent.unsqueeze(-1)).mul_(-g_ent.unsqueeze(-1)).sub_(g_logp.unsqueeze(-1)).mul_(p)
    gz.scatter_add_(-1, labels.unsqueeze(-1), g_logp.unsqueeze(-1))
    if temperature != 1.0:
        gz.div_(temperature)
    return gz


def weight_grad_gemm(gz_CV: torch.Tensor, h_CH: torch.Tensor, dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """gz^T h, [V,H] fp32: the LM-head weight gradient of one chunk; with ``out`` (a [V,H]
    fp32 accumulator) it is added into ``out`` in place and ``out`` is returned, so a
    backward over many chunks allocates no [V,H] temporary per chunk.

    On CUDA with bf16/fp16 weights the GEMM runs in the weight's dtype with fp32
    accumulation *and* fp32 output (``torch.mm`` / ``torch.addmm`` with
    ``out_dtype=float32``, cuBLAS): the tensor-core rate instead of an fp32 GEMM over
    a [V,H] product, which is about a sixth of a 7B actor's arithmetic. On CPU (and
    for fp32 weights) it stays fp32: there is no fast low-precision GEMM to gain, and
    the CPU tests compare against an fp32 reference.
    """
    if gz_CV.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        a, b = gz_CV.t().to(dtype), h_CH.to(dtype)
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    if out is None:
        return gz_CV.t() @ h_CH.float()
    return out.addmm_(gz_CV.t(), h_CH.float())


def _accumulate(gz, h, weight, g_hidden, g_weight, s):
    if g_hidden is not None:
        g_hidden[s : s + gz.shape[0]] = (gz.to(weight.dtype) @ weight).float()
    if g_weight is not None:
        weight_grad_gemm(gz, h, weight.dtype, out=g_weight)  # in place: no [V,H] temporary per chunk


class _FusedLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, temperature: float, chunk: int):
        N = hidden_NH.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, N, chunk):
            lp_all, p, lse[s : s + chunk] = _chunk_logp_p(hidden_NH[s : s + chunk], weight_VH, temperature)
            logp[s : s + chunk] = lp_all.gather(-1, labels_N[s : s + chunk].unsqueeze(-1)).squeeze(-1)
            ent[s : s + chunk] = _entropy(lp_all, p)
            del lp_all, p
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, ent, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, ent, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        g_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        g_logp = torch.zeros_like(ent) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(ent) if g_ent is None else g_ent.float()
        for s in range(0, hidden.shape[0], chunk):
            sl = slice(s, s + chunk)
            h = hidden[sl]
            lp_all, p, _ = _chunk_logp_p(h, weight, T, lse[sl])
            gz = _chunk_grad(lp_all, p, ent[sl], labels[sl], g_logp[sl], g_ent[sl], T)
            del p
            _accumulate(gz, h, weight, g_hidden, g_weight, s)
            del gz, lp_all
        return (
            g_hidden.to(hidden.dtype) if g_hidden is not None else None,
            g_weight.to(weight.dtype) if g_weight is not None else None,
            None, None, None,
        )


def _check(hidden, weight, labels, temperature, chunk_size):
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0, got {temperature}, {chunk_size}")


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
    _check(hidden, weight, labels, temperature, chunk_size)
    lead = labels.shape
    logp, ent = _FusedLogpEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), float(temperature), int(chunk_size)
    )
    return logp.view(lead), ent.view(lead)


TokenLoss = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, token_loss: TokenLoss, temperature: float, chunk: int):
        N = hidden_NH.shape[0]
        dev = hidden_NH.device
        logp = torch.empty(N, dtype=torch.float32, device=dev)
        ent = torch.empty_like(logp)
        g_hidden = torch.empty(hidden_NH.shape, dtype=torch.float32, device=dev) if hidden_NH.requires_grad else None
        g_weight = torch.zeros(weight_VH.shape, dtype=torch.float32, device=dev) if weight_VH.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for s in range(0, N, chunk):
            sl = slice(s, min(s + chunk, N))
            h, lab = hidden_NH[sl], labels_N[sl]
            lp_all, p, _ = _chunk_logp_p(h, weight_VH, temperature)
            lp = lp_all.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
            en = _entropy(lp_all, p)
            logp[sl], ent[sl] = lp, en
            # the chunk's loss and its gradient w.r.t. the chunk's (log-prob, entropy): [C] tensors only
            lp_leaf, en_leaf = lp.detach().requires_grad_(True), en.detach().requires_grad_(True)
            with torch.enable_grad():
                loss = token_loss(lp_leaf, en_leaf, sl)
                g_lp, g_en = torch.autograd.grad(loss, (lp_leaf, en_leaf), allow_unused=True)
            total += loss.detach().float()
            g_lp = torch.zeros_like(lp) if g_lp is None else g_lp.float()
            g_en = torch.zeros_like(en) if g_en is None else g_en.float()
            gz = _chunk_grad(lp_all, p, en, lab, g_lp, g_en, temperature)
            del p
            _accumulate(gz, h, weight_VH, g_hidden, g_weight, s)
            del gz, lp_all
        ctx.save_for_backward(g_hidden, g_weight)
        ctx.dtypes = (hidden_NH.dtype, weight_VH.dtype)
        ctx.mark_non_differentiable(logp, ent)
        return total, logp, ent

    @staticmethod
    def backward(ctx, g_total, _g_logp, _g_ent):
        g_hidden, g_weight = ctx.saved_tensors
        one = bool(g_total == 1)  # loss.backward(): hand the stored gradients over unscaled
        gh = (g_hidden if one else g_hidden * g_total).to(ctx.dtypes[0]) if g_hidden is not None else None
        gw = (g_weight if one else g_weight * g_total).to(ctx.dtypes[1]) if g_weight is not None else None
        return gh, gw, None, None, None, None


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLoss,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, log-probs, entropy) with the loss's gradient computed chunk by chunk in the forward.

    ``token_loss(logp_C, ent_C, sl)`` returns the (already normalised) loss of the
    flattened tokens ``sl``; the total loss is the sum over chunks, so the loss
    must be a sum of per-token terms (token-local). A chunk that covers whole rows
    (``chunk_size`` a multiple of the row length) also admits per-row aggregations.
    log-probs and entropy come back detached, shaped like ``labels``, for metrics.
    Calling ``loss.backward()`` only scales the stored gradients.
    """
    _check(hidden, weight, labels, temperature, chunk_size)
    lead = labels.shape
    total, logp, ent = _FusedTokenLoss.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), token_loss, float(temperature),
        int(chunk_size),
    )
    return total, logp.view(lead), ent.view(lead)
