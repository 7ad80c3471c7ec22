"""The fused vocabulary-parallel head: per-token log-prob and entropy straight from the
last hidden states and this rank's output-layer shard, never building [T, V/TP] logits.

Shape legend: N tokens, H hidden size, Vr this rank's rows of the (padded) vocabulary,
nv of them real (the last rank may hold padding rows), C a chunk of tokens.

Megatron's output layer is a ``ColumnParallelLinear``: rank r holds rows
``[r * Vr, (r + 1) * Vr)`` of the head, and its logits shard is ``[T, Vr]``, 4 * Vr
bytes a token in fp32 plus as much again for its gradient (``docs/megatron.md``).
Here, chunk by chunk of C tokens, each rank computes its fp32 logits ``z = h W_r^T / T``
([C, nv], the matmul in the weight's dtype as the model's own head) and reduces over the
tensor-parallel group, as ``algos.vocab_parallel`` does from a logits shard:

* ``m = max_v z_v`` (MAX), then with ``e = exp(z - m)``:
* ``S = sum_v e_v``, ``E = sum_v e_v (z_v - m)`` and the label's shifted logit (owned by
  one rank) in one SUM, so
  ``log p(label) = (z_label - m) - log S`` and ``H = log S - E / S``.

The backward recomputes each chunk's logits from ``h`` and ``W_r`` (one more matmul;
``log Z`` and ``E_p[z]`` are kept from the forward, so no communication) and applies

    d log p(label) / dz = onehot(label) - p,    dH / dz = -p (z - E_p[z])

(divided by T), accumulating ``gz^T h`` into one fp32 [Vr, H] weight gradient in place
(``algos.fused.weight_grad_gemm``) and ``gz W_r`` into this rank's part of the hidden
gradient, which the tensor-parallel input mapping sums over ranks (all-reduce, or
reduce-scatter under sequence parallelism; Megatron's own ``ColumnParallelLinear`` does
the same). Peak extra memory: two [C, nv] fp32 buffers and the [Vr, H] weight gradient,
whatever T is.

:func:`install` makes a GPTModel's last stage hand its final hidden states (after the
final norm, through the same tensor-parallel input mapping) to the loss instead of
logits; :func:`output_weight` is the head weight the fused function then uses (the
embedding when tied, at PP = 1; the last stage's copy of it at PP > 1).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from ..algos.fused import weight_grad_gemm
from ..algos.nucleus import sharded_nucleus_logmass, sharded_nucleus_stats
from ..algos.vocab_parallel import _all_reduce, vocab_parallel_logprobs_entropy

# megatron.head in the config (docs/configs.md): fused (this module) or logits (the output
# layer's [T, V/TP] shard, then algos.vocab_parallel; kept for comparison); auto = fused with
# megatron.attention: flash, logits with Megatron's local attention
HEADS = ("auto", "fused", "logits")


def _chunk_logits(h_CH: torch.Tensor, w_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 z = h W^T / T, [C, nv]: the matmul in the weight's dtype, as the model's head."""
    z = (h_CH.to(w_VH.dtype) @ w_VH.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


class _FusedVocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, vocab_start: int, n_valid: int, temperature: float,
                chunk: int, group):
        N, dev = hidden_NH.shape[0], hidden_NH.device
        w = weight_VH[:n_valid]  # rows past n_valid are vocabulary padding: not in the softmax
        local = labels_N - vocab_start
        owned = (local >= 0) & (local < n_valid)
        logz = torch.empty(N, dtype=torch.float32, device=dev)
        mean_z = torch.empty_like(logz)
        logp = torch.empty_like(logz)
        for s in range(0, N, chunk):
            sl = slice(s, min(s + chunk, N))
            C = sl.stop - sl.start
            if n_valid:
                z = _chunk_logits(hidden_NH[sl], w, temperature)
                m = z.amax(-1)
            else:
                z, m = None, torch.full((C,), -torch.inf, device=dev)
            m = _all_reduce(m, dist.ReduceOp.MAX, group)
            sums = torch.zeros(3, C, dtype=torch.float32, device=dev)
            if z is not None:
                z.sub_(m.unsqueeze(-1))  # z - m (<= 0)
                own = owned[sl]
                sums[2] = torch.where(own, z.gather(-1, local[sl].clamp(0, n_valid - 1).unsqueeze(-1)).squeeze(-1), 0.0)
                e = z.exp()
                sums[0] = e.sum(-1)
                sums[1] = (e.unsqueeze(1) @ z.unsqueeze(-1)).view(-1)  # sum e (z - m), no [C, nv] product
                del e, z
            sums = _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_s = sums[0].log()
            logz[sl] = m + log_s
            mean_z[sl] = m + sums[1] / sums[0]
            logp[sl] = sums[2] - log_s
        ctx.save_for_backward(hidden_NH, weight_VH, local, owned, logz, mean_z)
        ctx.args = (n_valid, temperature, chunk)
        return logp, logz - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local, owned, logz, mean_z = ctx.saved_tensors
        n_valid, T, chunk = ctx.args
        N, dev = hidden.shape[0], hidden.device
        w = weight[:n_valid]
        g_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if ctx.needs_input_grad[0] else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if ctx.needs_input_grad[1] else None
        g_logp = torch.zeros_like(logz) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(logz) if g_ent is None else g_ent.float()
        for s in range(0, N if n_valid else 0, chunk):
            sl = slice(s, min(s + chunk, N))
            h = hidden[sl]
            z = _chunk_logits(h, w, T)
            p = (z - logz[sl].unsqueeze(-1)).exp_()
            # gz = -p (g_logp + g_ent (z - E_p[z])) + g_logp onehot(label), all / T; in z's buffer
            gz = z.sub_(mean_z[sl].unsqueeze(-1)).mul_(g_ent[sl].unsqueeze(-1)).add_(g_logp[sl].unsqueeze(-1))
            gz.mul_(p).neg_()
            del p
            own = owned[sl]
            gz.scatter_add_(-1, local[sl].clamp(0, n_valid - 1).unsqueeze(-1),
                            torch.where(own, g_logp[sl], 0.0).unsqueeze(-1))
            if T != 1.0:
                gz.div_(T)
            if g_hidden is not None:
                g_hidden[sl] = (gz.to(w.dtype) @ w).float()
            if g_weight is not None:
                weight_grad_gemm(gz, h, weight.dtype, out=g_weight[:n_valid])  # in place, no [Vr, H] temporary
            del gz, z
        return (g_hidden.to(hidden.dtype) if g_hidden is not None else None,
                g_weight.to(weight.dtype) if g_weight is not None else None,
                None, None, None, None, None, None)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, sum over ``group`` backward: a hidden state that every rank of the
    group holds and each rank's vocabulary shard reads (Megatron's
    ``copy_to_tensor_model_parallel_region``, without needing megatron-core)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        _all_reduce(g, dist.ReduceOp.SUM, ctx.group)
        return g, None


def fused_vocab_parallel_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int | None = None,
    group=None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    reduce_hidden_grad: bool = True,
    labels_checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy of softmax(z / T)), fp32, shaped like ``labels``, from the
    hidden states ``[..., H]`` and this rank's head shard ``weight [Vr, H]`` (global ids
    ``vocab_start .. vocab_start + Vr``): what ``algos.vocab_parallel`` computes from
    ``hidden @ weight.T``, without the logits.

    ``vocab_size``: the real vocabulary (rows at or past it are padding: out of the
    softmax, zero gradient). ``group``: the tensor-parallel group (None: the default group
    when torch.distributed is up, else one process with the whole vocabulary).
    ``reduce_hidden_grad``: sum the hidden states' gradient over ``group`` (the hidden
    states are replicated on its ranks); False when the caller's own tensor-parallel
    mapping does it (:func:`install`). Differentiable in ``hidden`` and ``weight``
    through both outputs."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [Vr, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0, got {temperature}, {chunk_size}")
    Vr = weight.shape[0]
    n_valid = Vr if vocab_size is None else max(0, min(Vr, int(vocab_size) - int(vocab_start)))
    # (a host sync on a GPU: callers that checked the ids on the CPU say so)
    if not labels_checked and vocab_size is not None and labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(f"a label is >= vocab_size {vocab_size}")
    if reduce_hidden_grad and hidden.requires_grad:
        hidden = _CopyToGroup.apply(hidden, group)
    lead = labels.shape
    logp, ent = _FusedVocabParallel.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).long(),
                                          int(vocab_start), n_valid, float(temperature), int(chunk_size), group)
    return logp.view(lead), ent.view(lead)


# ------------------------------------------------------------------ the GPTModel side

def _unwrap(model):
    while hasattr(model, "module"):  # Megatron's DDP / Float16Module wrappers
        model = model.module
    return model


def _hidden_passthrough(self, input_, weight=None, runtime_gather_output=None):
    """``ColumnParallelLinear.forward`` for the fused head: the input goes through the
    tensor-parallel mapping the output layer applies (sequence parallel: all-gather
    forward, reduce-scatter backward; else copy forward, all-reduce backward) and comes
    back as the "logits", so GPTModel returns the hidden states [B, S, H].

    The all-reduce is :class:`_CopyToGroup`, not megatron-core 0.16.1's
    ``copy_to_tensor_model_parallel_region``: its ``_reduce`` all-reduces
    ``grad.contiguous()`` and returns the original, so a non-contiguous gradient -- which
    GPTModel's [S, B, H] -> [B, S, H] transpose hands back whenever B > 1 -- would go
    unreduced (its own output layer never meets one: its matmul's gradient is
    contiguous). tests/megatron/test_tensor_parallel.py caught this at TP=2, padded rows."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    if self.sequence_parallel:  # its reduce-scatter copies the gradient contiguous first
        return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=self.tp_group), None
    if self.tp_group is not None and self.tp_group.size() > 1:
        return _CopyToGroup.apply(input_, self.tp_group), None
    return input_, None


def install(model) -> None:
    """Make this GPTModel stage's output layer hand back the final hidden states (the
    fused head computes log-probs and entropy from them; :func:`is_installed`). Only the
    layer's ``forward`` changes (an instance attribute): its weight, state dict and
    checkpoint keys stay Megatron's. A no-op on stages without the output layer."""
    m = _unwrap(model)
    layer = getattr(m, "output_layer", None) if getattr(m, "post_process", False) else None
    if layer is not None:
        layer.forward = types.MethodType(_hidden_passthrough, layer)
        m.hapo_fused_head = True


def is_installed(model) -> bool:
    return bool(getattr(_unwrap(model), "hapo_fused_head", False))


def output_weight(model) -> torch.Tensor:
    """The head weight the last stage's logits come from: the shared embedding when tied
    (at PP > 1 the last stage's copy, which the embedding group keeps equal), else the
    output layer's own."""
    m = _unwrap(model)
    if m.share_embeddings_and_output_weights:
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


def token_logprobs_entropy(out: torch.Tensor, labels: torch.Tensor, *, weight: torch.Tensor | None, vocab_size: int,
                           temperature: float, chunk_size: int, tp_group, tp_rank: int,
                           labels_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` [B, T] and entropy [B, T] at each position of the last stage's output
    ``out`` [B, T, *]: this rank's logits shard [B, T, V/TP] (``weight`` None: the ``logits`` head), or
    the hidden states [B, T, H] with the head shard ``weight`` (the fused head); the shard's vocabulary
    offset is here. The caller pairs positions and labels (``PlacedHeadValues``: the next input token,
    or under CP the next token of the sequence, which another rank may hold)."""
    if weight is None:
        return vocab_parallel_logprobs_entropy(
            out, labels, vocab_start=tp_rank * out.shape[-1], vocab_size=vocab_size,
            group=tp_group, temperature=temperature, chunk_size=chunk_size)
    # the hidden states' gradient is summed over TP by install()'s mapping, not here
    return fused_vocab_parallel_logprobs_entropy(
        out, weight, labels, vocab_start=tp_rank * weight.shape[0], vocab_size=vocab_size,
        group=tp_group, temperature=temperature, chunk_size=chunk_size, reduce_hidden_grad=False,
        labels_checked=labels_checked)


def token_nucleus_logmass(out: torch.Tensor, *, top_p: float, weight: torch.Tensor | None, vocab_size: int,
                          temperature: float, chunk_size: int, tp_group, tp_rank: int) -> torch.Tensor:
    """log P(top-p nucleus) [B, T] of the distribution at each position of ``out`` (as
    :func:`token_logprobs_entropy` reads it), over the tensor-parallel group
    (``algos.nucleus.sharded_nucleus_logmass``; no grad)."""
    Vr = out.shape[-1] if weight is None else weight.shape[0]
    return sharded_nucleus_logmass(out, top_p, weight=weight, temperature=temperature,
                                   n_valid=vocab_size - tp_rank * Vr, group=tp_group, chunk_size=chunk_size)


def token_head_signals(out: torch.Tensor, *, top_p: float, weight: torch.Tensor | None, vocab_size: int,
                       temperature: float, chunk_size: int, tp_group, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nucleus entropy, top-two log-prob gap) [B, T] -- PAEC's signals -- of the distribution at each
    position of ``out`` (as :func:`token_logprobs_entropy` reads it), over the tensor-parallel group,
    detached (``algos.nucleus.sharded_nucleus_stats``: no [T, V/TP])."""
    Vr = out.shape[-1] if weight is None else weight.shape[0]
    st = sharded_nucleus_stats(out.detach(), top_p, weight=None if weight is None else weight.detach(),
                               temperature=temperature, n_valid=vocab_size - tp_rank * Vr, group=tp_group,
                               chunk_size=chunk_size, entropy=True, top2_gap=True)
    return st.entropy, st.top2_gap


def resolve(head: str, attention: str) -> str:
    """``megatron.head`` -> ``fused`` or ``logits`` (``auto``: fused with flash attention)."""
    if head not in HEADS:
        raise ValueError(f"megatron.head must be one of {HEADS}, got {head!r}")
    if head == "auto":
        return "fused" if attention == "flash" else "logits"
    return head


class PlacedHeadValues:
    """The head's token-local values -- log-probs and entropy, log P(nucleus), PAEC's signals --
    computed from a model output and placed in the caller's [B, S-1] layout. A layout gives
    ``_scored(out)`` (the output at the positions that predict a token), ``_labels(model_ids)``
    (the token each of those positions predicts) and ``_place(v)``: ``schedule.RowLayout`` (the
    model's own input, shifted by one) and ``context_parallel.CPRows`` (a CP rank's tokens and their
    global next tokens) share these three methods."""

    def logprobs_entropy(self, out: torch.Tensor, model_ids: torch.Tensor | None = None, *, vocab_size: int,
                         temperature: float, chunk_size: int, tp_group, tp_rank: int, weight=None,
                         labels_checked: bool = False):
        """Log-probs and entropy [B, S-1] (zeros where a row has no next real token)."""
        lp, en = token_logprobs_entropy(self._scored(out), self._labels(model_ids), weight=weight,
                                        vocab_size=vocab_size, temperature=temperature, chunk_size=chunk_size,
                                        tp_group=tp_group, tp_rank=tp_rank, labels_checked=labels_checked)
        return self._place(lp), self._place(en)

    def nucleus_logmass(self, out: torch.Tensor, *, top_p: float, vocab_size: int, temperature: float,
                        chunk_size: int, tp_group, tp_rank: int, weight=None) -> torch.Tensor:
        """log P(top-p nucleus) of each next-token distribution [B, S-1] (no grad)."""
        return self._place(token_nucleus_logmass(self._scored(out), top_p=top_p, weight=weight, vocab_size=vocab_size,
                                                 temperature=temperature, chunk_size=chunk_size, tp_group=tp_group,
                                                 tp_rank=tp_rank))

    def head_signals(self, out: torch.Tensor, *, top_p: float, vocab_size: int, temperature: float,
                     chunk_size: int, tp_group, tp_rank: int, weight=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(nucleus entropy, top-two gap) [B, S-1] of each next-token distribution, detached."""
        ne, gap = token_head_signals(self._scored(out), top_p=top_p, weight=weight, vocab_size=vocab_size,
                                     temperature=temperature, chunk_size=chunk_size, tp_group=tp_group,
                                     tp_rank=tp_rank)
        return self._place(ne), self._place(gap)
