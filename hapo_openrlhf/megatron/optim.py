"""Gradient finalisation and clipping for a Megatron GPTModel trained with a plain
torch optimizer (no Megatron DDP wrapper; docs/megatron.md says why).

After ``schedule.forward_backward`` each rank holds the gradient of its own shard
for its own data-parallel replica. ``finalize_grads`` does what Megatron's
``finalize_model_grads`` does for a DDP-wrapped model:

1. with tied embeddings and PP > 1, sum the first stage's embedding gradient and
   the last stage's head gradient over the embedding group;
2. with sequence parallelism, sum the gradients of the parameters every TP rank
   holds in full (layer norms) over the tensor-parallel group -- each rank only saw
   its slice of the sequence;
3. average every gradient over the data-parallel group (hapo's losses divide by
   ``global count / dp_size``, as OpenRLHF's do, so the average is the gradient of
   the whole step).

``clip_grad_norm`` computes the global L2 norm counting every weight once (shared
embedding copies and TP-duplicated parameters are skipped; squares are summed over
the model-parallel group) and scales the gradients like ``clip_grad_norm_``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .schedule import allreduce_tied_embedding_grads


def finalize_grads(model) -> None:
    """Tied-embedding, sequence-parallel and data-parallel gradient reductions (collective)."""
    from megatron.core import parallel_state as ps

    allreduce_tied_embedding_grads(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if model.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        for p in params:
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        group = ps.get_data_parallel_group()
        for p in params:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)


def _counted_once(p) -> bool:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)


def grad_norm(model) -> float:
    """Global L2 norm of the model's gradient (every weight once), identical on every rank."""
    from megatron.core import parallel_state as ps

    grads = [p.grad for p in model.parameters() if p.grad is not None and _counted_once(p)]
    dev = next(model.parameters()).device
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    return float(sq.sqrt())


def clip_grad_norm(model, max_norm: float) -> float:
    """Scale the gradients so their global norm is at most ``max_norm`` (``<= 0``: no
    clipping); returns the norm before clipping."""
    norm = grad_norm(model)
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm
