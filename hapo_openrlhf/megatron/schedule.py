"""The HAPO/PPO loss through Megatron-core's forward-backward schedule.

Micro-batches run through ``get_forward_backward_func()`` (1F1B across pipeline
stages, plain accumulation without pipelining); the loss is evaluated on the last
stage from the vocabulary-parallel log-probs and entropy. Every micro-batch's loss
is already divided by the **global** normaliser (e.g. the number of valid tokens
of the whole optimizer step for token-mean), and the model config sets
``calculate_per_token_loss=True`` so the schedule does not rescale it: the
accumulated gradient is exactly the gradient of one big batch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..algos.entropy import DEFAULT_CHUNK
from .model import attention_inputs, shard_logprobs_entropy

# loss_fn(logp [B, S-1], entropy [B, S-1], micro_batch) -> (scalar loss, {metric: float tensor})
LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def forward_backward(model, micro_batches: list[dict[str, torch.Tensor]], loss_fn: LossFn | None, *,
                     vocab_size: int, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                     forward_only: bool = False) -> list[Any]:
    """Run ``micro_batches`` (dicts with ``input_ids`` and ``attention_mask`` [B, S], all of
    one shape, plus whatever ``loss_fn`` reads) through the schedule on every rank of the
    model-parallel group. Returns, on the last pipeline stage, one entry per micro-batch:
    the metrics dict (with ``loss``), or with ``loss_fn=None`` the ``(logp, entropy)`` pair
    (the old-log-prob pass); other stages get an empty list. Gradients accumulate in
    ``param.grad`` unless ``forward_only``."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward: no micro-batches")
    shape = micro_batches[0]["input_ids"].shape
    bad = [i for i, mb in enumerate(micro_batches) if mb["input_ids"].shape != shape]
    if bad:
        raise ValueError(f"micro-batches {bad} differ in shape from {tuple(shape)}: pipeline stages exchange "
                         f"fixed [S, B, H] activations, pad every micro-batch to one shape")
    config = model.config
    if not config.calculate_per_token_loss:
        raise ValueError("the model config needs calculate_per_token_loss=True (hapo divides by the global "
                         "normaliser itself; Megatron would otherwise divide again)")
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()

    def forward_step(data_iterator: Iterable, model):
        mb = next(data_iterator)
        pos, mask = attention_inputs(mb["attention_mask"])
        output = model(input_ids=mb["input_ids"], position_ids=pos, attention_mask=mask)

        def loss_func(logits: torch.Tensor, non_loss_data: bool = False):
            lp, en = shard_logprobs_entropy(logits, mb["input_ids"], vocab_size=vocab_size, temperature=temperature,
                                            chunk_size=chunk_size, tp_group=tp_group, tp_rank=tp_rank)
            if loss_fn is None:  # forward only: hand the values back
                return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), (lp.detach(), en.detach())
            loss, metrics = loss_fn(lp, en, mb)
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach(), **metrics}

        return output, loss_func

    fb = get_forward_backward_func()
    return fb(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
              num_microbatches=len(micro_batches), seq_length=shape[1], micro_batch_size=shape[0],
              forward_only=forward_only or loss_fn is None)


def allreduce_tied_embedding_grads(model) -> None:
    """With tied embeddings and PP > 1 the first stage's embedding and the last stage's
    head are two copies of one weight: sum their gradients over Megatron's embedding group
    (what its DDP wrapper does in ``finalize_model_grads``) so both copies take the same
    step. A no-op otherwise. Call after ``forward_backward``, before the optimizer step
    (``optim.MainParams.step`` does this on its fp32 main grads)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .optim import tied_weight

    weight = tied_weight(model)
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())
